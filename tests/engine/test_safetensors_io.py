"""engine.loader.safetensors_io: files that safetensors itself reads and writes, one tensor at a time."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.loader import safetensors_io

TENSORS = {
    "w": torch.randn(5, 7),
    "b16": torch.randn(3, 4).to(torch.bfloat16),
    "h": torch.randn(9).half(),
    "blocks": torch.randint(0, 256, (4, 34), dtype=torch.uint8),
    "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "empty": torch.zeros(0, 3),
    "strided": torch.randn(6, 4)[:, ::2],  # not contiguous: written as its values
}


def test_written_files_read_back_by_safetensors_and_by_us(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    safetensors_io.save(TENSORS, path, metadata={"quantized": "{}"})
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"quantized": "{}"}
        for name, t in TENSORS.items():
            assert torch.equal(f.get_tensor(name), t), name
    ours, meta = safetensors_io.load(path)
    assert meta == {"quantized": "{}"} and ours.keys() == TENSORS.keys()
    for name, t in TENSORS.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
        assert ours[name].is_contiguous()


def test_reads_files_safetensors_wrote(tmp_path: Path) -> None:
    path = tmp_path / "b.safetensors"
    plain = {k: v.contiguous() for k, v in TENSORS.items()}
    save_file(plain, path, metadata={"k": "v"})
    ours, meta = safetensors_io.load(path)
    assert meta == {"k": "v"} and all(torch.equal(ours[k], v) for k, v in plain.items())


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    safetensors_io.save({"w": torch.randn(64, 64)}, path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        safetensors_io.load(path)
