"""Write and read a safetensors file one tensor at a time, so a prepared copy never costs a second copy of the model
in memory.

safetensors.torch.save_file turns every tensor into a Python bytes object before writing (the whole model twice in
memory while a GGUF is prepared), and safe_open maps the file, so the pages a load touches count in the process's
resident set next to the anonymous copy the engine keeps. Here each tensor's bytes go straight from its storage to
the file and back from the file into a fresh tensor (plain reads: the page cache is not the process's memory).
The files are ordinary safetensors (header: 8-byte little-endian length, JSON of dtype / shape / data_offsets and
`__metadata__`, then the data), readable by safe_open and written by anything else.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}
_ALIGN = 8  # the header is padded so every tensor's data starts 8-byte aligned


def _bytes_view(t: torch.Tensor) -> memoryview:
    flat = t.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def save(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    header: dict[str, object] = {"__metadata__": metadata or {}}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(len(blob) + 8) % _ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors.values():
            f.write(_bytes_view(t))


def load(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file, each tensor read into its own fresh memory."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        metadata = header.pop("__metadata__", None) or {}
        base = 8 + length
        tensors: dict[str, torch.Tensor] = {}
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            start, end = info["data_offsets"]
            t = torch.empty(info["shape"], dtype=_BY_NAME[info["dtype"]])
            if end > start:
                f.seek(base + start)
                if f.readinto(_bytes_view(t)) != end - start:
                    raise ValueError(f"{path}: tensor {name} is truncated")
            tensors[name] = t
    return tensors, metadata
