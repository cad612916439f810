"""The quantized weight a model holds in place of a dense linear weight: one or more row-stacked parts, each one
kernel call: a GGUF file's own blocks on `ember::linear_gguf` (GGUFPart, engine/quant/gguf_blocks.py), or Ember's
format for weights quantized at load on `ember::linear_q` (QuantizedPart, engine/ops/csrc/linear_q/).

Parts exist because a fused projection's shards need not share a format: a Q4_K_M file stores attn_q and attn_k
as Q4_K but attn_v as Q6_K, so q|k|v is two parts, [q|k] and [v], whose outputs are concatenated. Shards of one
layout are stacked into one part at load (one kernel call, one weight stream).
"""
from __future__ import annotations

import re

import torch
from gguf import GGMLQuantizationType
from torch import nn

from engine.quant import gguf_blocks
from engine.quant.format import PackedQuantized, QuantizedTensor, concat_rows, dequantize, pack, packed_rows, unpack
from engine.quant.gguf_tensor import AnyQuantized, GGUFTensor, concat_gguf_rows
from engine.ops.native import NATIVE_OPS

_PART_KEY = re.compile(r"(.+)\.parts\.(\d+)\.(qweight|scales|mins|blocks)")


class QuantizedPart(nn.Module):
    """One weight in the kernels' packed layout (format.py `pack`); the buffers are what the state dict saves."""

    def __init__(self, p: PackedQuantized, source: str) -> None:
        super().__init__()
        self.source = source
        self.out_features = p.n
        self.register_buffer("qweight", p.qweight)
        self.register_buffer("scales", p.scales)
        self.register_buffer("mins", p.mins)  # None is kept out of the state dict

    def packed(self) -> PackedQuantized:
        return PackedQuantized(self.qweight, self.scales, self.mins, self.out_features)

    def tensor(self) -> QuantizedTensor:
        return unpack(self.packed(), self.source)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if NATIVE_OPS:
            return torch.ops.ember.linear_q(x, self.qweight, self.scales, self.mins, self.out_features)
        return x @ dequantize(self.tensor(), x.dtype).T  # no C++ compiler: the slow reference


class GGUFPart(nn.Module):
    """One weight in a GGUF type's own blocks, rows interleaved in groups (gguf_blocks.interleave: the file's bytes,
    reordered so a group of rows streams as one)."""

    def __init__(self, blocks: torch.Tensor, qtype: GGMLQuantizationType, n: int) -> None:
        super().__init__()
        self.qtype, self.out_features = qtype, n
        self.source = qtype.name
        self.register_buffer("blocks", blocks)

    @classmethod
    def from_tensor(cls, t: GGUFTensor) -> GGUFPart:
        return cls(gguf_blocks.interleave(t.raw, int(t.qtype)), t.qtype, t.shape[0])

    def tensor(self) -> GGUFTensor:
        raw = gguf_blocks.deinterleave(self.blocks, int(self.qtype), self.out_features)
        return GGUFTensor(raw, self.qtype, self.in_features)

    @property
    def in_features(self) -> int:
        block, type_size = gguf_blocks.GGUF_TYPES[int(self.qtype)][1:]
        return self.blocks.shape[1] // gguf_blocks.group_rows(int(self.qtype)) // type_size * block

    def forward(self, x: torch.Tensor, f32_out: bool = False) -> torch.Tensor:
        return gguf_blocks.linear(x, self.blocks, int(self.qtype), self.out_features, f32_out)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return gguf_blocks.rows(self.blocks, ids, int(self.qtype), self.out_features, dtype)


def _part(t: AnyQuantized) -> nn.Module:
    return GGUFPart.from_tensor(t) if isinstance(t, GGUFTensor) else QuantizedPart(pack(t), t.source)


def dequantize_any(t: AnyQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] in `dtype`, whichever the quantized form."""
    return t.dequantize(dtype) if isinstance(t, GGUFTensor) else dequantize(t, dtype)


class QuantizedWeight(nn.Module):
    """A quantized [N, K] weight: `linear` (engine/ops/linear.py) calls it, `embedding` gathers rows from it."""

    def __init__(self, parts: list[QuantizedPart]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)

    @classmethod
    def from_tensors(cls, tensors: list[AnyQuantized]) -> QuantizedWeight:
        merged: list[AnyQuantized] = []
        for t in tensors:  # stack neighbours of one layout: fewer, longer weight streams
            last = merged[-1] if merged else None
            if last is not None and type(last) is type(t) and last.layout == t.layout and last.shape[1] == t.shape[1]:
                merged[-1] = concat_gguf_rows([last, t]) if isinstance(t, GGUFTensor) else concat_rows([last, t])
            else:
                merged.append(t)
        return cls([_part(t) for t in merged])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [part(x) for part in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T in float32, as an output head's logits: GGUF parts write them from their fp32 sums; the int8 / int4
        parts' kernel returns x's dtype, widened here."""
        outs = [part(x, f32_out=True) if isinstance(part, GGUFPart) else part(x).float() for part in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of W in `dtype` (embedding lookups; a table is always a single part)."""
        (part,) = self.parts
        if isinstance(part, GGUFPart):
            return part.rows(ids, dtype)
        return packed_rows(part.packed(), ids, dtype)

    def sources(self) -> list[str]:
        return [p.source for p in self.parts]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


def quantized_weights(model: nn.Module) -> dict[str, QuantizedWeight]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedWeight)}


def install(module: nn.Module, attr: str, weight: QuantizedWeight) -> None:
    """Replace the dense parameter `module.attr` (possibly still on the meta device) by a quantized weight."""
    if attr in module._parameters:
        del module._parameters[attr]
    setattr(module, attr, weight)


def install_from_state(model: nn.Module, tensors: dict[str, torch.Tensor],
                       parts_info: dict[str, list[tuple[str, int]]]) -> dict[str, torch.Tensor]:
    """Rebuild the quantized weights a state dict names (`<attr>.parts.<i>.<buffer>`) on `model`; `parts_info`:
    each one's (source, rows) per part (`state_info`). Returns the remaining (dense) tensors."""
    parts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = _PART_KEY.fullmatch(name)
        if m is None:
            dense[name] = t
        else:
            parts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t
    for path, by_index in parts.items():
        owner, _, attr = path.rpartition(".")
        info = parts_info.get(path)
        if info is None or len(info) != len(by_index):
            raise ValueError(f"saved weights have no part list for {path}")
        weight = QuantizedWeight([_saved_part(b, *info[i]) for i, b in sorted(by_index.items())])
        install(model.get_submodule(owner), attr, weight)
    return dense


def _saved_part(buffers: dict[str, torch.Tensor], source: str, rows: int) -> nn.Module:
    if "blocks" in buffers:  # a GGUF part: its source is the type's name
        return GGUFPart(buffers["blocks"], GGMLQuantizationType[source], rows)
    return QuantizedPart(PackedQuantized(buffers["qweight"], buffers["scales"], buffers.get("mins"), rows), source)


def state_info(model: nn.Module) -> dict[str, list[tuple[str, int]]]:
    """What install_from_state needs beside the buffers: each quantized weight's parts' (source, rows)."""
    return {name: [(p.source, p.out_features) for p in w.parts] for name, w in quantized_weights(model).items()}


def quantized_formats(model: nn.Module) -> dict[str, int]:
    """How many kernel calls' worth of weights each source format has ({"Q4_1": 120, "Q8_0": 1}; {} if dense)."""
    counts: dict[str, int] = {}
    for w in quantized_weights(model).values():
        for s in w.sources():
            counts[s] = counts.get(s, 0) + 1
    return dict(sorted(counts.items()))


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights hold in memory: dense parameters plus quantized buffers (padding included)."""
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    return dense + sum(w.nbytes() for w in quantized_weights(model).values())


def describe_weights(model: nn.Module, dtype: str) -> str:
    """One phrase for the load log: sizes, and which formats the linear weights run in."""
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    quant = quantized_weights(model)
    if not quant:
        return f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {dense / 2**20:.0f} MiB {dtype}"
    formats = ", ".join(f"{k} x{v}" for k, v in quantized_formats(model).items())
    qbytes = sum(w.nbytes() for w in quant.values())
    ops = sorted({"ember::linear_gguf" if isinstance(p, GGUFPart) else "ember::linear_q"
                  for w in quant.values() for p in w.parts})
    return (f"{(dense + qbytes) / 2**20:.0f} MiB of weights: linears quantized ({formats}: {qbytes / 2**20:.0f} MiB) "
            f"on {' and '.join(ops)}, the rest {dtype}")
