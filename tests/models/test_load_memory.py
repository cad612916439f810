"""A GGUF's load holds one copy of the weights: each quantized weight's file blocks are dropped once it is
installed, and the file's memory map leaves the resident set as tensors are copied out of it."""
from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from engine.loader import open_checkpoint
from engine.loader.gguf_pages import release_pages
from engine.model.weights import build_model
from engine.quant.gguf_tensor import GGUFTensor
from tiny_gguf import write_tiny_gguf

MakeTinyModel = Callable[..., Path]


def test_quantized_weights_are_installed_as_their_last_shard_arrives(
        make_tiny_model: MakeTinyModel, tmp_path: Path) -> None:
    path = write_tiny_gguf(make_tiny_model("llama"), tmp_path / "q8.gguf", qtype=T.Q8_0)
    ckpt = open_checkpoint(str(path))
    alive: list[weakref.ref[torch.Tensor]] = []
    left_at_end: list[int] = []

    def watched() -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
        for name, t in ckpt.tensors(keep_quantized=True):
            if isinstance(t, GGUFTensor):
                alive.append(weakref.ref(t.raw))
            yield name, t
        del t  # the loop variable would keep the last one alive
        left_at_end.append(sum(r() is not None for r in alive))

    model = build_model(ckpt.config, watched(), torch.float32, 64)
    assert len(alive) >= 14  # 2 layers x (q, k, v, o, gate, up, down) at least
    # When the file is exhausted, every weight but those still waiting for a shard has been installed and its
    # file blocks freed (a weight's last shard is installed before the next tensor is read).
    assert left_at_end == [0]
    assert all(not p.is_meta for p in model.parameters())


def _mapped_rss_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isdigit() or line[:1] in "abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_release_pages_drops_copied_pages_from_the_resident_set(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    data = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    mapped = np.memmap(path, mode="r")
    offset, n = 3 * mmap.PAGESIZE + 100, 4 << 20  # an unaligned start, as a tensor's offset usually is
    view = mapped[offset : offset + n]
    copy = np.array(view)  # faults the pages in
    before = _mapped_rss_kib(path)
    assert before >= n // 1024
    release_pages(view, offset, n)
    assert _mapped_rss_kib(path) < before - (n // 1024) * 9 // 10
    # The map still reads the same bytes afterwards (from the page cache).
    assert np.array_equal(np.array(mapped[offset : offset + n]), copy)
    assert np.array_equal(copy, data[offset : offset + n])
    os.sync()


def test_release_pages_ignores_arrays_that_are_not_maps() -> None:
    release_pages(np.zeros(16, dtype=np.uint8), 0, 16)  # no map under it: nothing to give back, and no error
    assert np.zeros(16).sum() == 0
