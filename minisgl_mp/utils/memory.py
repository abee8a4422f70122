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
