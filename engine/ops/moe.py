"""The routed experts of a mixture-of-experts layer, grouped by expert, as the opaque `ember::moe_experts` op.

Given each token's top-k expert ids and routing weights, the op sorts the (token, slot) pairs by expert and runs
each ACTIVE expert once, over all of the batch's tokens routed to it: one gate|up linear and one down linear per
active expert and step, so every active expert's weights stream from memory once per step, whatever the batch
(a per-token loop would read them tokens x top-k times), and experts no token chose are not read at all. Each
token's outputs are weighted and summed in ascending expert order, the order of transformers' eager loop, so fp32
results match it closely.

Why an op: how many tokens each expert gets is data-dependent, and a fullgraph `torch.compile` with static shapes
cannot trace that. The alternatives trace but lose the point: running every expert over every token reads all
experts' weights (E / top-k times the bytes), and a traced loop over all experts with padded token lists still
emits one weight-reading kernel per expert. So the compiled decode graph calls this op as one node (its fake
kernel in kernels_fake/moe.py gives the output's shape, that of `x`) and the grouping runs eagerly inside, on the
same packed / quantized linear kernels as the dense layers (engine/ops/linear.py).

Expert weights are stacked along a leading expert dimension: a dense stack is [E, N, K] or [E, <packed layout>]
(each `w[e]` a contiguous weight that `linear` takes as it is), a quantized stack is the three buffers of Ember's
packed quantized format with a leading E (`scales` given; engine/quant/format.py), or a GGUF type's interleaved
blocks with a leading E (its ggml type id given; engine/quant/gguf_blocks.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from engine.ops.linear import linear
from engine.ops.native import NATIVE_OPS
from engine.quant import gguf_blocks
from engine.quant.format import PackedQuantized, dequantize, unpack


def _expert_linear(x: torch.Tensor, w: torch.Tensor, scales: Optional[torch.Tensor], mins: Optional[torch.Tensor],
                   e: int, n: int, qtype: int) -> torch.Tensor:
    if qtype:  # a GGUF type's own blocks, [E, <interleaved rows>] (engine/quant/gguf_blocks.py)
        return gguf_blocks.linear(x, w[e], qtype, n)
    if scales is None:
        return linear(x, w[e], n)
    m = None if mins is None else mins[e]
    if NATIVE_OPS:
        return torch.ops.ember.linear_q(x, w[e], scales[e], m, n)
    return x @ dequantize(unpack(PackedQuantized(w[e], scales[e], m, n), ""), x.dtype).T  # the slow reference


def moe_experts(
    x: torch.Tensor,  # [T, hidden]
    topk_ids: torch.Tensor,  # [T, k] int64
    topk_weights: torch.Tensor,  # [T, k]: the routing weights, in the dtype the model multiplies them in
    gate_up: torch.Tensor,  # [E, ...]: each expert's gate|up weight, 2 * inter rows
    gate_up_scales: Optional[torch.Tensor],
    gate_up_mins: Optional[torch.Tensor],
    down: torch.Tensor,  # [E, ...]: each expert's down weight, hidden rows
    down_scales: Optional[torch.Tensor],
    down_mins: Optional[torch.Tensor],
    inter: int,
    gate_up_qtype: int = 0,  # a ggml type id: the stack holds that GGUF type's blocks (scales and mins None)
    down_qtype: int = 0,
) -> torch.Tensor:
    """sum over a token's k slots of weight * down(silu(gate(x)) * up(x)) of the slot's expert, [T, hidden]."""
    t, hidden = x.shape
    k = topk_ids.shape[1]
    if t == 0:
        return torch.zeros_like(x)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the T * k (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = x.index_select(0, order // k)  # each pair's token, in that order: every expert's rows are one slice
    outs = []
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue  # not routed to: its weights are never read
        gate, up = _expert_linear(rows[start : start + count], gate_up, gate_up_scales, gate_up_mins, e,
                                  2 * inter, gate_up_qtype).chunk(2, dim=-1)
        outs.append(_expert_linear(F.silu(gate) * up, down, down_scales, down_mins, e, hidden, down_qtype))
        start += count
    y = (torch.cat(outs) * topk_weights.reshape(-1)[order, None]).to(x.dtype)
    # Back to [T, k] with each token's slots in ascending expert order, then summed left to right: the additions
    # transformers' index_add_ loop makes (one rounding each, in x's dtype), without index_add_, whose bf16 CPU
    # kernel is a scalar scatter (~1 ms a call here), and with a fixed number of ops whatever the experts.
    per_pair = torch.empty_like(y).index_copy_(0, order, y).view(t, k, hidden)
    by_expert = topk_ids.argsort(dim=1, stable=True)
    per_pair = per_pair.gather(1, by_expert[..., None].expand(t, k, hidden))
    out = per_pair[:, 0]
    for j in range(1, k):
        out = out + per_pair[:, j]
    return out.contiguous()


# Registered for the compiled decode graphs; eager forwards call the function itself (engine/model/moe.py): a Python
# custom op's first call through the dispatcher imports dynamo, and every call pays the op's Python dispatch.
torch.library.custom_op("ember::moe_experts", mutates_args=())(moe_experts)
