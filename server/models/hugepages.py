"""Large CPU buffers on transparent huge pages: a decode step streams every weight and much of the KV cache,
and with 4 KiB pages each 2 MiB of that costs 512 TLB misses.

Linux backs memory with 2 MiB pages only where asked (`transparent_hugepage/enabled` is `madvise` on most
distributions), so the weights and the KV cache are moved into one private anonymous mapping each, advised
MADV_HUGEPAGE before first touch. Where the kernel or Python cannot (not Linux, THP `never`), the same
buffer comes back on ordinary pages; nothing else changes.

Buffers can be committed (`commit_in_rows`): the kernel then backs their pages before they are used instead of
at each first write, which on a VM costs ~1.5-3 ms per 2 MiB page. The KV cache is: a prefill step whose blocks
crossed into fresh pages faulted one in each of its 60 layer tensors at once and stalled 170-360 ms. Backing all of
its 1.4 GiB took 3.2-3.5 s of a 8.5 s start-up on a VM whose host had not backed the memory yet (0.2-0.4 s where it
had), so the first huge page of each layer's tensor (its first blocks, the ones the block pool hands out first) is
backed before the server starts, and the rest from a background thread in the same order.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor in an arena starts on a cache line


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` starting on a 2 MiB boundary, advised MADV_HUGEPAGE where the OS allows."""
    size = nbytes + HUGE_PAGE  # room to slide the start onto a huge-page boundary
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: shared memory has its own THP knob
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    offset = -address % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError as exc:  # THP compiled out or disabled
            log.debug("MADV_HUGEPAGE refused: %s", exc)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+ (<linux/mman.h>); Python 3.11's mmap does not name it


def _libc_madvise():
    """libc's madvise(2) through ctypes, which lets go of the GIL for the call (mmap.madvise holds it), or None."""
    try:
        madvise = ctypes.CDLL("libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):  # not glibc
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _populate(madvise, start: int, end: int) -> bool:
    """Back the pages of [start, end) (addresses; widened to whole pages) without writing them; False if refused."""
    low = start - start % mmap.PAGESIZE
    high = end + -end % mmap.PAGESIZE
    return madvise(low, high - low, _MADV_POPULATE_WRITE) == 0


def commit_in_rows(tensors: list[torch.Tensor]) -> threading.Thread | None:
    """Back every page of `tensors` (CPU tensors whose leading dimension is rows handed out from the first on, as
    the KV cache's blocks are) in row order: the first huge page of each tensor now, then the next of each, and so
    on from a daemon thread at the lowest priority, so the rows a pool uses first are backed before it starts and
    the rest while it serves. Populating never writes, so a row in use while the thread passes keeps its values;
    where the kernel refuses MADV_POPULATE_WRITE every page is written now instead. Returns the thread (None when
    nothing was left for it)."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel()]
    rounds = max((-(-(end - start) // HUGE_PAGE) for start, end in spans), default=0)
    madvise = _libc_madvise()

    def back(r: int) -> bool:
        return all(_populate(madvise, start + r * HUGE_PAGE, min(end, start + (r + 1) * HUGE_PAGE))
                   for start, end in spans if start + r * HUGE_PAGE < end)

    if madvise is None or not back(0):  # an older kernel (EINVAL) or no libc: write every page (1.4 GiB: 1.1 s)
        log.debug("MADV_POPULATE_WRITE refused: touching each page")
        for t in tensors:
            t.view(-1).view(torch.uint8)[::mmap.PAGESIZE].zero_()
        return None
    if rounds <= 1:
        return None

    def rest(held: list[torch.Tensor]) -> None:  # (held: keeps the mapping alive while the thread backs it)
        start = time.perf_counter()
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only, on Linux
        except (AttributeError, OSError):
            pass
        for r in range(1, rounds):
            if not back(r):
                log.warning("backing the rest of %.0f MiB in the background stopped at huge page %d of %d: "
                            "its pages are backed at their first write instead", _mib(spans), r, rounds)
                return
        log.info("all %.0f MiB backed in the background in %.2f s", _mib(spans), time.perf_counter() - start)

    thread = threading.Thread(target=rest, args=(tensors,), name="commit-in-rows", daemon=True)
    thread.start()
    return thread


def _mib(spans: list[tuple[int, int]]) -> float:
    return sum(end - start for start, end in spans) / 2**20


def _views_in_huge_pages(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Uninitialised contiguous tensors of the (shape, dtype) specs, laid out in one huge-page buffer."""
    sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // _ALIGN) * _ALIGN)
    arena = huge_page_buffer(max(starts[-1], 1))
    return [arena[start:start + size].view(dtype).view(shape)
            for (shape, dtype), start, size in zip(specs, starts, sizes)]


def into_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU `tensors` packed into one huge-page buffer (same shapes, dtypes and values)."""
    copies = _views_in_huge_pages([(tuple(t.shape), t.dtype) for t in tensors])
    for copy, t in zip(copies, tensors):
        copy.copy_(t)
    return copies


def empty_in_huge_pages(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Uninitialised CPU tensors of `shapes` in one huge-page buffer, its pages backed as they are first written (or
    by commit_in_rows)."""
    return _views_in_huge_pages([(tuple(shape), dtype) for shape in shapes])


def return_freed_heap() -> None:
    """Hand the heap's freed pages back to the OS (glibc's malloc_trim); a no-op elsewhere.

    Loading converts and packs every weight once, and glibc keeps the freed originals mapped: after load
    that is a third of the process's resident size, never to be reused."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
