from __future__ import annotations

import ctypes
import sys

import torch

_MADV_HUGEPAGE = 14
_HUGE = 1 << 21


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back a large CPU tensor with transparent huge pages (where the system allows
    it only on request). Best effort: returns whether the advice was taken."""
    if not sys.platform.startswith("linux") or t.device.type != "cpu" or t.nbytes < 4 * _HUGE:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    addr = t.data_ptr()
    start = (addr + _HUGE - 1) & ~(_HUGE - 1)
    length = (addr + t.nbytes - start) & ~(_HUGE - 1)
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0


# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Make this process's malloc keep what it frees for reuse: no block of its own mapping
    for large requests, no trimming of the heap's free top (glibc only; elsewhere a no-op).

    A CPU forward allocates its large intermediate tensors anew each step (a 2,048-token
    chunk's gate/up product alone is 50 MB for Qwen3-0.6B). glibc serves every request past
    32 MB (the most its adaptive threshold reaches) with a fresh mmap and unmaps it on free, so
    the next step pays a page fault and the kernel's zeroing for every 4 KiB of it again. From
    the heap, the pages stay mapped. The price: the process keeps its peak heap rather than
    giving it back. Returns whether the settings were taken."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has neither the soname nor mallopt)
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the OS now (glibc's malloc_trim), for a process that
    is done with a large engine it built under `keep_freed_memory` but goes on running (a
    benchmark that starts a server next). Returns whether anything was released."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False
