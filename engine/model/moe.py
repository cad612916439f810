"""The sparse MLP of Qwen3-MoE and Mixtral: a router, top-k routing, and the experts run grouped by expert.

Routing follows transformers (models/qwen3_moe, models/mixtral) step for step, in its dtypes: router logits in the
serving dtype, softmax in fp32, top-k, then Qwen3-MoE renormalises the k weights only with `norm_topk_prob` and
casts them back to the logits' dtype, while Mixtral always renormalises and keeps them in fp32 (its experts' bf16
outputs are weighted in fp32, then cast). Neither architecture has shared experts.

Each expert is a SwiGLU MLP whose gate and up are fused like the dense layers' (one [2 * inter, hidden] weight),
stacked over experts into one `gate_up_proj` [E, 2 * inter, hidden] and one `down_proj` [E, hidden, inter] per layer.
The loader packs every expert for ember::linear_bf16 / linear_f32 (the stack becomes [E, <packed layout>]) or keeps
a GGUF's quantized experts in the file's blocks (a QuantizedWeight of one part whose buffers carry the leading E), so
`w[e]` is always a weight the linear kernels take as it is. The router is packed too, but never quantized
(llama.cpp keeps it F32 as well): routing decisions are what a small weight error would flip. The grouped expert
computation, and why it is an opaque op under torch.compile, is engine/ops/moe.py.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from engine.loader.model_config import ModelConfig
from engine.ops.linear import linear, pack_linear_weight
from engine.ops.moe import moe_experts
from engine.quant import gguf_blocks
from engine.quant.format import PackedQuantized, QuantizedTensor, concat_rows, pack
from engine.quant.gguf_tensor import AnyQuantized, GGUFTensor, concat_gguf_rows
from engine.quant.module import GGUFPart, QuantizedPart, QuantizedWeight, dequantize_any, install
from engine.quant.quantize import quantize_weight

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # per sparse layer, stacked over experts


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _op_args(w: torch.Tensor | QuantizedWeight) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor],
                                                         int]:
    """(weights, scales, mins, ggml type) of an expert stack for ember::moe_experts; scales None and type 0 = dense,
    a type = a GGUF type's blocks."""
    if isinstance(w, QuantizedWeight):
        (part,) = w.parts
        if isinstance(part, GGUFPart):
            return part.blocks, None, None, int(part.qtype)
        return part.qweight, part.scales, part.mins, 0
    return w, None, None, 0


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.top_k, self.inter = e, cfg.num_experts_per_tok, i
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weights_in_fp32 = cfg.architecture == "mixtral"  # see the module docstring
        self.gate = _param(e, h)  # the router
        self.gate_up_proj = _param(e, 2 * i, h)
        self.down_proj = _param(e, h, i)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k expert ids [T, k], their weights [T, k]) as transformers computes them."""
        logits = linear(h, self.gate, self.num_experts)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_fp32:
            weights = weights.to(logits.dtype)
        return ids, weights

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [T, hidden], after post_attention_layernorm
        ids, weights = self.route(h)
        gu, dn = _op_args(self.gate_up_proj), _op_args(self.down_proj)
        args = (h, ids, weights, *gu[:3], *dn[:3], self.inter, gu[3], dn[3])
        if torch.compiler.is_compiling():
            return torch.ops.ember.moe_experts(*args)
        return moe_experts(*args)


def sparse_layers(model: nn.Module) -> list[SparseMoE]:
    return [layer.moe for layer in model.layers if layer.moe is not None]


# ---- loading --------------------------------------------------------------------------------------------------

_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight")
# transformers' save_pretrained (per expert; Mixtral's w1/w3/w2 = gate/up/down), and the GGUF loader's names
_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
# transformers 5.x in-memory names: the stacks as they are ([E, 2 * inter, hidden] gate|up, [E, hidden, inter] down)
_STACKED = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)")
_SHARDS: dict[str, tuple[str, str | None]] = {
    "gate_proj": ("gate_up_proj", "gate"), "w1": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"), "w3": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", None), "w2": ("down_proj", None),
}


class ExpertLoader:
    """The build_model hook for MoE tensors: `take` copies a router or expert tensor into its layer's stack (True),
    or leaves any other name to the caller (False); `finish` installs the quantized stacks once all arrived."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        self.pending: dict[tuple[SparseMoE, str], dict[tuple[int, str | None], AnyQuantized]] = {}

    def _moe(self, layer: str) -> SparseMoE | None:
        i = int(layer)
        return self.model.layers[i].moe if i < len(self.model.layers) else None

    def take(self, name: str, tensor: torch.Tensor | AnyQuantized) -> bool:
        if m := _ROUTER.fullmatch(name):
            target = (m[1], "gate", None, None)
        elif (m := _PER_EXPERT.fullmatch(name)) and m[3] in _SHARDS:
            target = (m[1], *_SHARDS[m[3]][:1], int(m[2]), _SHARDS[m[3]][1])
        elif m := _STACKED.fullmatch(name):
            target = (m[1], m[2], None, None)
        else:
            return False
        layer, attr, expert, shard = target
        moe = self._moe(layer)
        if moe is None:
            return False  # not a sparse layer: the caller reports the unexpected weight
        if isinstance(tensor, (QuantizedTensor, GGUFTensor)):
            if attr == "gate" or expert is None:
                tensor = dequantize_any(tensor)  # the router stays dense
            else:
                self.pending.setdefault((moe, attr), {})[(expert, shard)] = tensor
                return True
        self._dst(moe, attr, expert, shard, name, tuple(tensor.shape)).copy_(tensor)
        return True

    def _dst(self, moe: SparseMoE, attr: str, expert: int | None, shard: str | None, name: str,
             shape: tuple[int, ...]) -> torch.Tensor:
        param = getattr(moe, attr)
        if param.is_meta:
            param = nn.Parameter(torch.empty(param.shape, dtype=self.dtype), requires_grad=False)
            setattr(moe, attr, param)
        dst = param.data if expert is None else param.data[expert]
        if shard is not None:
            dst = dst[:moe.inter] if shard == "gate" else dst[moe.inter:]
        if tuple(dst.shape) != shape:
            raise ValueError(f"weight {name!r} has shape {shape}, expected {tuple(dst.shape)}")
        return dst

    def finish(self) -> None:
        """Quantized experts: one stacked QuantizedWeight when every expert's shards came quantized in one layout,
        else (a mix of formats, or of quantized and dense experts) dequantized into the dense stack."""
        for (moe, attr), parts in self.pending.items():
            shards = ("gate", "up") if attr == "gate_up_proj" else (None,)
            param = getattr(moe, attr)
            complete = set(parts) == {(e, s) for e in range(moe.num_experts) for s in shards}
            one_layout = len({(type(p), p.layout) for p in parts.values()}) == 1
            if isinstance(param, nn.Parameter) and param.is_meta and complete and one_layout:
                concat = concat_gguf_rows if isinstance(next(iter(parts.values())), GGUFTensor) else concat_rows
                per_expert = [concat([parts[(e, s)] for s in shards]) for e in range(moe.num_experts)]
                if per_expert[0].shape != tuple(param.shape[1:]):
                    raise ValueError(f"quantized experts {attr} have shape {per_expert[0].shape}, expected "
                                     f"{tuple(param.shape[1:])}")
                install(moe, attr, stack_quantized(per_expert))
                continue
            for (e, s), q in parts.items():
                self._dst(moe, attr, e, s, attr, q.shape).copy_(dequantize_any(q))
        self.pending.clear()


def stack_quantized(per_expert: list[AnyQuantized]) -> QuantizedWeight:
    """One QuantizedWeight for E experts of one layout: each packed (format.pack, or a GGUF type's interleaved
    blocks), buffers stacked along a new dim 0."""
    first = per_expert[0]
    if isinstance(first, GGUFTensor):
        blocks = torch.stack([gguf_blocks.interleave(t.raw, int(t.qtype)) for t in per_expert])
        return QuantizedWeight([GGUFPart(blocks, first.qtype, first.shape[0])])
    packed = [pack(t) for t in per_expert]
    mins = None if packed[0].mins is None else torch.stack([p.mins for p in packed])  # type: ignore[misc]
    stacked = PackedQuantized(torch.stack([p.qweight for p in packed]), torch.stack([p.scales for p in packed]), mins,
                              packed[0].n)
    return QuantizedWeight([QuantizedPart(stacked, "+".join(sorted({t.source for t in per_expert})))])


# ---- after loading: pack or quantize the stacks ---------------------------------------------------------------

def _per_expert(w: torch.Tensor, convert) -> torch.Tensor:
    """convert(w[e]) for every expert, stacked, built one expert at a time (peak: the stack plus one expert)."""
    first = convert(w[0])
    out = torch.empty((w.shape[0], *first.shape), dtype=first.dtype)
    out[0] = first
    for e in range(1, w.shape[0]):
        out[e] = convert(w[e])
    return out


def pack_experts(model: nn.Module) -> None:
    """Every sparse layer's router and dense expert stacks in the ember::linear_bf16 / linear_f32 layout."""
    for moe in sparse_layers(model):
        moe.gate = nn.Parameter(pack_linear_weight(moe.gate.data), requires_grad=False)
        for attr in EXPERT_WEIGHTS:
            w = getattr(moe, attr)
            if isinstance(w, torch.Tensor):  # quantized stacks run ember::linear_q as they are
                setattr(moe, attr, nn.Parameter(_per_expert(w.data, pack_linear_weight), requires_grad=False))


def quantize_experts(model: nn.Module, mode: str, group: int) -> None:
    """--quantization int8|int4: every dense expert stack quantized expert by expert (the router stays dense)."""
    for moe in sparse_layers(model):
        for attr in EXPERT_WEIGHTS:
            w = getattr(moe, attr)
            if isinstance(w, torch.Tensor):
                install(moe, attr, stack_quantized([quantize_weight(w.data[e], mode, group, head=False)
                                                    for e in range(w.shape[0])]))
