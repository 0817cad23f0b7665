"""neuronmm::balanced_for (csrc/work_split.h), the threads' shared work list under every GEMM and attention call."""

import pytest
import torch

from server.models import fused_ops

pytestmark = pytest.mark.skipif(not fused_ops.load(), reason="no C++ compiler: the fused ops cannot be built")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("costs", [[5] * 64, [100] + [1] * 99, [0, 0, 3, 1, 0, 0], [0] * 7, [7], list(range(50)),
                                   list(range(50, 0, -1))])
@pytest.mark.parametrize("stall_us", [0, 2000])
def test_every_item_runs_once(two_threads, costs, stall_us):
    """Whatever the costs (zero-cost items at either end, fewer items than threads) and however late a thread
    starts, each item runs once (the op fails on a second run; -1 marks one never run)."""
    owners = torch.ops.neuronmm.balanced_for_owners(torch.tensor(costs, dtype=torch.long), stall_us)
    assert owners.shape == (len(costs),)
    assert bool((owners >= 0).all()) and bool((owners < 2).all())


def test_a_late_thread_s_stretch_is_taken_by_the_other(two_threads):
    """Thread 0 sleeps 200 ms before its first item: thread 1 runs its own half, then takes thread 0's items from
    the back, so it runs more than half of them (with a static split it would run exactly half)."""
    owners = torch.ops.neuronmm.balanced_for_owners(torch.full((64,), 5, dtype=torch.long), 200_000)
    assert int((owners == 1).sum()) > 32
    # thread 0's items, if any, are a prefix: it took them from the front of its own stretch
    ran_by_0 = (owners == 0).nonzero().flatten().tolist()
    assert ran_by_0 == list(range(len(ran_by_0)))


def test_one_thread_runs_everything():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        owners = torch.ops.neuronmm.balanced_for_owners(torch.ones(10, dtype=torch.long), 0)
    finally:
        torch.set_num_threads(before)
    assert owners.tolist() == [0] * 10


@pytest.mark.parametrize("first,second", [([5] * 16, [3] * 40), ([100] + [1] * 20, [1] * 7), ([7], [2] * 9),
                                          ([0] * 4, [1]), ([1] * 9, [])])
@pytest.mark.parametrize("stall_us", [0, 20_000])
def test_two_phases_run_every_item_once_and_in_order(two_threads, first, second, stall_us):
    """balanced_for_then (X·U then ·V of a low-rank projection in one region): every item of both phases runs once,
    and no second-phase item starts before the whole first phase has ended, even when the first item claimed takes
    20 ms while the other thread runs out of first-phase work (the op fails on either)."""
    owners = torch.ops.neuronmm.balanced_for_then_owners(torch.tensor(first, dtype=torch.long),
                                                         torch.tensor(second, dtype=torch.long), stall_us)
    assert owners.shape == (len(first) + len(second),)
    assert bool((owners >= 0).all()) and bool((owners < 2).all())


def test_two_phases_on_one_thread_do_not_wait_for_themselves():
    """With one thread the two phases run in turn on it: its barrier passes at once."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        owners = torch.ops.neuronmm.balanced_for_then_owners(torch.ones(6, dtype=torch.long),
                                                             torch.ones(4, dtype=torch.long), 0)
    finally:
        torch.set_num_threads(before)
    assert owners.tolist() == [0] * 10


def test_two_phases_inside_another_parallel_region(two_threads):
    """Called from a thread already in a parallel region (ATen runs the inner region inline on that thread): the
    phases still run every item once, in order, on that thread, and return."""
    owners = torch.ops.neuronmm.balanced_for_then_owners(torch.ones(6, dtype=torch.long),
                                                         torch.ones(4, dtype=torch.long), 0, nested=True)
    assert owners.tolist() == [0] * 10


def test_region_times_are_recorded_only_while_switched_on(two_threads):
    """Thread 0 sleeps 20 ms before its first item while thread 1 runs every item: the region's tail (from the first
    thread's end to the last's) holds that sleep. Switched off, a region adds nothing."""
    times = torch.ops.neuronmm.region_times
    times(True)  # on, and whatever an earlier test left is cleared
    torch.ops.neuronmm.balanced_for_owners(torch.full((64,), 5, dtype=torch.long), 20_000)
    regions, fork, tail, join, wall, barrier = times(False)
    assert regions == 1
    assert tail >= 15_000_000 and wall >= tail
    assert 0 <= fork <= wall and 0 <= join <= wall
    assert barrier == 0  # one phase: no barrier
    torch.ops.neuronmm.balanced_for_owners(torch.full((64,), 5, dtype=torch.long), 0)
    assert times(False) == [0, 0, 0, 0, 0, 0]


def test_a_two_phase_regions_barrier_holds_the_skew_of_its_threads_arrivals(two_threads):
    """One first-phase item sleeps 20 ms; the other thread takes every other item, reaches the barrier first and waits
    there for the sleeper: the barrier time holds that wait, and the region's tail does not."""
    times = torch.ops.neuronmm.region_times
    times(True)
    torch.ops.neuronmm.balanced_for_then_owners(torch.full((64,), 5, dtype=torch.long),
                                                torch.full((64,), 5, dtype=torch.long), 20_000)
    regions, fork, tail, join, wall, barrier = times(False)
    assert regions == 1
    assert 15_000_000 <= barrier <= wall
    assert tail < 15_000_000
