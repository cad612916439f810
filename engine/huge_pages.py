"""Weights in 2 MiB pages.

A decode step streams every weight once. With 4 KiB pages that is one TLB entry per 4 KiB, and on these machines the
page walks cost the quantized kernels a fifth of their bandwidth: one 1B Q4_K_M decode step took 39.7 ms on 4 KiB
pages and 31.0 ms on 2 MiB pages (Q8_0 56.6 -> 47.6 ms; bf16, whose kernel does less work per byte, 81.7 -> 77.7;
docs/benchmarks.md "Weights in 2 MiB pages"). Transparent huge pages are usually enabled only for memory that asks
(`madvise` in /sys/kernel/mm/transparent_hugepage/enabled), so after a model is loaded `advise` asks for the weights'
memory and collapses it into huge pages at once (MADV_COLLAPSE, Linux 6.1 on; before that, khugepaged collapses it
over the following minutes).

Only the weights: torch's allocator can ask for huge pages for every allocation of 2 MiB or more
(THP_MEM_ALLOC_ENABLE=1), but served that way the KV pool and the activations were touched 2 MiB at a time, peak RSS
rose 90-340 MiB on the 1B files, and bf16 decode was slower (ITL 93 against 78 ms at one client), for no gain on
the weights that the collapse does not give.

It is a request: where the kernel says no (THP `never`), the weights stay on 4 KiB pages and everything works as
before, only slower.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def thp_mode() -> str:
    """The kernel's transparent huge page setting (always, madvise or never), or "unavailable"."""
    try:
        text = _THP_ENABLED.read_text()
    except OSError:
        return "unavailable"
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else "unavailable"


def _spans(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The 2 MiB-aligned interiors of the tensors' storages, each storage once: only a whole 2 MiB page inside one
    tensor can be asked for without touching memory that is not the weights'."""
    seen: set[int] = set()
    spans = []
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.device.type != "cpu" or s.nbytes() < HUGE_PAGE:
            continue
        seen.add(s.data_ptr())
        start = -(-s.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (s.data_ptr() + s.nbytes()) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            spans.append((start, end))
    return spans


class Advice(NamedTuple):
    asked: int  # bytes asked for
    collapsed: int  # of which collapsed into huge pages now: 0 where the kernel has no MADV_COLLAPSE (Linux < 6.1)
    # of which the kernel could not collapse for want of a free 2 MiB page (EAGAIN / ENOMEM: memory fragmented);
    # khugepaged may still collapse them later
    refused: int


def advise(tensors: Iterable[torch.Tensor]) -> Advice:
    """Ask for huge pages under these CPU tensors and collapse what they hold into them now (where the kernel has
    no MADV_COLLAPSE the pages become huge only as khugepaged gets to them)."""
    asked = collapsed = refused = 0
    if thp_mode() in ("never", "unavailable"):
        return Advice(0, 0, 0)
    can_collapse = True
    for start, end in _spans(tensors):
        if _libc.madvise(start, end - start, _MADV_HUGEPAGE) != 0:
            continue
        asked += end - start
        if not can_collapse:
            continue
        if _libc.madvise(start, end - start, _MADV_COLLAPSE) == 0:
            collapsed += end - start
        elif ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS):  # no MADV_COLLAPSE (Linux < 6.1)
            can_collapse = False
        elif ctypes.get_errno() in (errno.EAGAIN, errno.ENOMEM):
            refused += end - start
    return Advice(asked, collapsed, refused)


def process_huge_page_bytes() -> int:
    """Anonymous memory of this process held in transparent huge pages (AnonHugePages in /proc/self/smaps_rollup)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
