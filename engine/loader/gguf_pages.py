"""Keep a GGUF's memory map out of the resident set while its tensors are copied into the engine's own memory.

GGUFReader maps the whole file. Every page a tensor copy touches then counts in the process's RSS until the map is
dropped at the end of the load, so a first start held the file's weights twice at its peak (the map and the engine's
copy: 1795 MB against 942 MB on a restart, for a 669 MB Q4_K_M). Once a tensor's bytes are copied, its pages are
given back with madvise(MADV_DONTNEED): on a read-only file mapping that only unmaps them from this process (they
stay in the page cache, and a later touch faults them in again from there), so it never changes what is read.
"""
from __future__ import annotations

import mmap
from typing import Any

import numpy as np


def _mapping(array: np.ndarray) -> mmap.mmap | None:
    """The mmap object under a view of a np.memmap (None for an array that is not one)."""
    base: Any = array
    while base is not None:
        mm = getattr(base, "_mmap", None)
        if isinstance(mm, mmap.mmap):
            return mm
        base = getattr(base, "base", None)
    return None


def release_pages(data: np.ndarray, offset: int, nbytes: int) -> None:
    """Drop the pages of bytes [offset, offset + nbytes) of the file mapped under `data` from the resident set.
    Pages at either end may be shared with a neighbouring tensor; dropping them only costs that tensor a re-read
    from the page cache."""
    mm = _mapping(data)
    if mm is None or nbytes <= 0 or not hasattr(mm, "madvise"):
        return
    start = offset - offset % mmap.PAGESIZE
    end = min(offset + nbytes, len(mm))
    if end > start:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)
