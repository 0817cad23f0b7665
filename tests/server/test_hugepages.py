"""Weights and KV cache moved onto huge-page mappings keep their values, shapes and separate storage."""

import mmap
from pathlib import Path

import pytest
import torch

from server.models import hugepages
from server.models.hugepages import HUGE_PAGE, empty_in_huge_pages, huge_page_buffer, into_huge_pages
from server.models.llama import KVCache


def test_copies_keep_values_shapes_and_dtypes():
    originals = [torch.randn(3, 5).to(torch.bfloat16), torch.arange(7), torch.randn(2, 2, 9)]
    moved = into_huge_pages(originals)
    assert moved[0].data_ptr() % HUGE_PAGE == 0
    for before, after in zip(originals, moved):
        assert after.dtype == before.dtype and after.shape == before.shape and after.is_contiguous()
        assert torch.equal(after, before) and after.data_ptr() != before.data_ptr()
        assert after.data_ptr() % 64 == 0
    moved[1].zero_()  # the arena's tensors do not overlap
    assert torch.equal(moved[0], originals[0]) and torch.equal(moved[2], originals[2])


def test_kv_cache_layers_are_separate_tensors_of_the_cache_layout():
    cache = KVCache(num_layers=3, num_blocks=5, num_kv_heads=2, block_size=4, head_dim=8, dtype=torch.bfloat16)
    tensors = cache.k + cache.v
    assert all(t.shape == (5, 2, 4, 8) and t.is_contiguous() and t.dtype == torch.bfloat16 for t in tensors)
    for i, t in enumerate(tensors):
        t.fill_(i)
    assert [int(t[4, 1, 3, 7]) for t in tensors] == list(range(6))
    assert cache.nbytes() == 6 * 5 * 2 * 4 * 8 * 2


def test_empty_tensors_need_not_be_zero_but_are_writable():
    a, b = empty_in_huge_pages([(4, 4), (3,)], torch.float32)
    a.fill_(1.5)
    b.fill_(-2)
    assert a.sum() == 24 and b.sum() == -6


def _smaps_of(address: int) -> dict[str, list[str]]:
    """The /proc/self/smaps fields of the mapping that holds `address` (name -> the words after it)."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            if inside:
                break
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside:
            fields[head.rstrip(":")] = line.split()[1:]
    return fields


def _process_rss() -> int:
    """This process's resident bytes (VmRSS): adjacent anonymous mappings merge, so a buffer's own is read as a delta."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


linux_rss = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status (Linux)")


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not Path("/proc/self/smaps").exists()
                    or not Path("/sys/kernel/mm/transparent_hugepage").is_dir(),
                    reason="needs Linux with transparent huge pages built in (MADV_HUGEPAGE, /proc/self/smaps)")
def test_the_mapping_is_advised_huge_pages():
    buf = huge_page_buffer(3 * HUGE_PAGE)
    assert "hg" in _smaps_of(buf.data_ptr())["VmFlags"]  # hg: the VMA carries MADV_HUGEPAGE


@linux_rss
@pytest.mark.parametrize("populate", ["madvise", "touch"])
def test_a_committed_buffer_is_resident_before_its_first_write(monkeypatch, populate):
    if populate == "touch":  # a kernel without MADV_POPULATE_WRITE refuses the advice: each page is written instead
        monkeypatch.setattr(hugepages, "_MADV_POPULATE_WRITE", -1)
    nbytes = 16 * HUGE_PAGE
    before = _process_rss()
    lazy = huge_page_buffer(nbytes)
    after_lazy = _process_rss()
    committed = huge_page_buffer(nbytes)
    thread = hugepages.commit_in_rows([committed])
    after_first = _process_rss()
    assert (thread is None) == (populate == "touch")  # the rest in the background only where nothing is written
    if thread is not None:
        assert after_first - after_lazy >= 0.9 * HUGE_PAGE  # the first huge page at once
        thread.join(timeout=60)
    assert after_lazy - before < nbytes // 4
    assert _process_rss() - after_lazy >= 0.9 * nbytes
    assert int(committed.max()) == 0 and lazy.numel() == committed.numel() == nbytes


@linux_rss
def test_the_kv_caches_first_blocks_are_committed_when_made_and_the_rest_behind_them():
    before = _process_rss()
    # 4 layer tensors of 4 MiB: each one's first huge page (its first 512 blocks) now, the second behind them
    cache = KVCache(num_layers=2, num_blocks=1024, num_kv_heads=2, block_size=16, head_dim=64, dtype=torch.bfloat16)
    made = _process_rss() - before
    assert made >= 0.9 * 4 * HUGE_PAGE
    tensors = cache.k + cache.v
    for i, t in enumerate(tensors):  # rows written while the thread backs the pages (before or after it passes)
        t[1023].fill_(i + 1)
        t[700].fill_(-i)
    assert cache.committing is not None
    cache.committing.join(timeout=60)
    assert not cache.committing.is_alive()
    assert _process_rss() - before >= 0.9 * cache.nbytes()  # 16 MiB, every page resident
    for i, t in enumerate(tensors):  # backing a page never wrote it
        assert bool((t[1023] == i + 1).all()) and bool((t[700] == -i).all())


def test_backing_pages_in_the_background_keeps_what_they_hold():
    tensors = empty_in_huge_pages([(3 * 512, 4096)] * 2, torch.uint8)  # two tensors of three huge pages
    for i, t in enumerate(tensors):
        t[600:].fill_(i + 7)  # written (so backed) before the thread comes by
    thread = hugepages.commit_in_rows(tensors)
    assert thread is not None
    thread.join(timeout=60)
    assert all(bool((t[600:] == i + 7).all()) for i, t in enumerate(tensors))


def test_a_pool_of_one_huge_page_a_tensor_needs_no_thread():
    tensors = empty_in_huge_pages([(16, 64)] * 3, torch.float32)
    assert hugepages.commit_in_rows(tensors) is None
