"""Large CPU buffers on transparent huge pages: a decode step streams every weight and much of the KV cache,
and with 4 KiB pages each 2 MiB of that costs 512 TLB misses.

Linux backs memory with 2 MiB pages only where asked (`transparent_hugepage/enabled` is `madvise` on most
distributions), so the weights and the KV cache are moved into one private anonymous mapping each, advised
MADV_HUGEPAGE before first touch. Where the kernel or Python cannot (not Linux, THP `never`), the same
buffer comes back on ordinary pages; nothing else changes.

A buffer can be committed when it is made (`commit`): the kernel then backs every page up front instead of at
its first write, which on a VM costs ~1.5-3 ms per 2 MiB page. The KV cache is: a prefill step whose blocks
crossed into fresh pages faulted one in each of its 60 layer tensors at once and stalled 170-360 ms.
"""

from __future__ import annotations

import ctypes
import logging
import mmap

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor in an arena starts on a cache line


def huge_page_buffer(nbytes: int, commit: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` starting on a 2 MiB boundary, advised MADV_HUGEPAGE where the OS allows;
    with `commit`, every page backed now (its contents then zero)."""
    size = nbytes + HUGE_PAGE  # room to slide the start onto a huge-page boundary
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: shared memory has its own THP knob
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    offset = -address % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError as exc:  # THP compiled out or disabled
            log.debug("MADV_HUGEPAGE refused: %s", exc)
    tensor = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
    if commit:
        _commit(buf, tensor)
    return tensor


_MADV_POPULATE_WRITE = 23  # Linux 5.14+ (<linux/mman.h>); Python 3.11's mmap does not name it


def _commit(buf: mmap.mmap, tensor: torch.Tensor) -> None:
    """Back every page of `buf` now: MADV_POPULATE_WRITE where the kernel has it (1.44 GiB in huge pages on the VM
    measured: 0.17-0.43 s where the host already backs the memory, 3.5 s where it does not, on one thread or two),
    else a write to each page (1.1 s)."""
    try:
        buf.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError, AttributeError) as exc:  # an older kernel (EINVAL), or no madvise at all
        log.debug("MADV_POPULATE_WRITE refused (%s): touching each page", exc)
        tensor[::mmap.PAGESIZE].zero_()


def _views_in_huge_pages(specs: list[tuple[tuple[int, ...], torch.dtype]], commit: bool = False) -> list[torch.Tensor]:
    """Uninitialised contiguous tensors of the (shape, dtype) specs, laid out in one huge-page buffer."""
    sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // _ALIGN) * _ALIGN)
    arena = huge_page_buffer(max(starts[-1], 1), commit)
    return [arena[start:start + size].view(dtype).view(shape)
            for (shape, dtype), start, size in zip(specs, starts, sizes)]


def into_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU `tensors` packed into one huge-page buffer (same shapes, dtypes and values)."""
    copies = _views_in_huge_pages([(tuple(t.shape), t.dtype) for t in tensors])
    for copy, t in zip(copies, tensors):
        copy.copy_(t)
    return copies


def empty_in_huge_pages(shapes: list[tuple[int, ...]], dtype: torch.dtype, commit: bool = False) -> list[torch.Tensor]:
    """Uninitialised CPU tensors of `shapes` in one huge-page buffer: its pages committed now with `commit`, else as
    they are first written."""
    return _views_in_huge_pages([(tuple(shape), dtype) for shape in shapes], commit)


def return_freed_heap() -> None:
    """Hand the heap's freed pages back to the OS (glibc's malloc_trim); a no-op elsewhere.

    Loading converts and packs every weight once, and glibc keeps the freed originals mapped: after load
    that is a third of the process's resident size, never to be reused."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
