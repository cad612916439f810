"""Quantize dense weights at load (`--quantization int8|int4`) into Ember's format (format.py), for the same
`ember::linear_q` kernels that serve GGUF files.

- int8: per output channel, symmetric: one fp32 scale per row, q = round(w / s) in -127..127 (the W8 half of the
  W8A8 scheme vLLM and SGLang serve on CPU; activations are quantized per 32 inside the kernel).
- int4: per group of `group` inputs (32 or 128), asymmetric like GGUF's Q4_1: s = (max - min) / 15, q =
  round((w - min) / s) in 0..15, fp16 scale and min (what the kernel reads, so q is computed against the rounded
  values).
The embedding / output head is quantized to int8 in both modes (per row), as llama.cpp's Q4 files keep it at
Q8_0 or Q6_K: the head's logits are the most sensitive to weight error, and int8 already quarters its bf16 bytes.
"""
from __future__ import annotations

import torch

from engine.quant.format import QuantizedTensor, pack_nibbles

INT4_GROUPS = (32, 128)


def quantize_int8(w: torch.Tensor) -> QuantizedTensor:
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return QuantizedTensor(q, scale.contiguous(), None, "int8")


def quantize_int4(w: torch.Tensor, group: int) -> QuantizedTensor:
    if group not in INT4_GROUPS:
        raise ValueError(f"int4 group size must be one of {INT4_GROUPS}, got {group}")
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 with group {group} needs the input size ({k}) to be a multiple of it")
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).half()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    lo = lo.half()
    q = torch.round((g - lo.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp(0, 15)
    return QuantizedTensor(pack_nibbles(q.reshape(n, k)), scale.contiguous(), lo.contiguous(), f"int4-g{group}")


def quantize_weight(w: torch.Tensor, mode: str, group: int, head: bool) -> QuantizedTensor:
    if mode == "int8" or head:
        return quantize_int8(w)
    if mode == "int4":
        return quantize_int4(w, group)
    raise ValueError(f"unknown quantization {mode!r}")
