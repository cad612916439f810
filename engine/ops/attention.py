"""Attention over the token-granular KV pool, as opaque `ember::` custom ops.

Sequence lengths are data-dependent, so `torch.compile` cannot trace this part with static shapes: the
compiled decode graph calls these ops as single nodes (fake kernels in `kernels_fake/attention.py`).

Layout invariants (see engine/pools.py):
  k_cache, v_cache: [num_slots + 1, kv_heads, head_dim] for ONE layer; slot 0 is the padding slot.
  req_to_token:     [max_running + 1, max_context] int32; row 0 is the padding row and maps to slot 0.
Both ops first write this step's K/V into `out_slots`, then attend, so a token sees itself.
An int8 or fp8 cache (--kv-cache-dtype) is [num_slots + 1, kv_heads, head_dim + 4] of that dtype, each row's scale
in its last 4 bytes (engine/ops/kv_quant.py): the ops quantize this step's K/V into it, and read it back dequantized
per row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.kv_quant import attended_rows, gather_rows, write_rows
from engine.ops.native import NATIVE_OPS


def reference_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k: torch.Tensor,  # [B, KVH, D]
    v: torch.Tensor,  # [B, KVH, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,  # [B] int64: where this step's K/V go
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64, including this step's token
    scale: float,
) -> torch.Tensor:
    write_rows(k_cache, out_slots, k)
    write_rows(v_cache, out_slots, v)
    bsz, heads, dim = q.shape
    kv_heads = k.shape[1]
    max_len = int(seq_lens.max())
    slots = req_to_token.index_select(0, req_rows)[:, :max_len].to(torch.int64)  # [B, L]
    # Gather straight into [B, KVH, L, D] so both products below are plain batched matmuls.
    pad = torch.arange(max_len, device=q.device)[None, :] >= seq_lens[:, None]  # [B, L]
    # A cache of another dtype than q (int8, or --kv-cache-dtype float32 under bf16) is read in fp32, as the C++ kernels
    # widen it: a bf16 copy of int8 values would round them once more.
    work = q.dtype if k_cache.dtype == q.dtype else torch.float32
    keys = gather_rows(k_cache, slots, work).permute(0, 2, 1, 3)  # [B, KVH, L, D]
    # Entries past a row's length may never have been written (a sliding-window ring, engine/pools.py): zero their
    # values, or an uninitialised NaN would survive its zero probability.
    values = gather_rows(v_cache, slots, work).masked_fill(pad[:, :, None, None], 0).permute(0, 2, 1, 3)
    qg = q.to(work).view(bsz, kv_heads, heads // kv_heads, dim)  # GQA: query groups share one KV head
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # [B, KVH, G, L]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)  # [B, KVH, G, D]
    return out.reshape(bsz, heads, dim).to(q.dtype)


NATIVE_DECODE_ATTENTION = NATIVE_OPS
if not NATIVE_DECODE_ATTENTION:
    torch.library.custom_op("ember::decode_attention", mutates_args=("k_cache", "v_cache"))(reference_decode_attention)


def reference_prefill_attention(
    q: torch.Tensor,  # [T, H, D]: the new tokens of all requests, concatenated
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,  # [T] int64
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,  # [N] int64
    prefix_lens: torch.Tensor,  # [N] int64: tokens already in the cache before this chunk
    prefill_lens: torch.Tensor,  # [N] int64: new tokens of each request in this chunk
    scale: float,
) -> torch.Tensor:
    write_rows(k_cache, out_slots, k)
    write_rows(v_cache, out_slots, v)
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    start = 0
    # Prefill is few requests of many tokens each: one SDPA per request is the efficient shape.
    for row, prefix, ext in zip(req_rows.tolist(), prefix_lens.tolist(), prefill_lens.tolist()):
        qs = q[start : start + ext].transpose(0, 1)  # [H, ext, D]
        if prefix == 0:
            # A whole prompt (the common case): its keys are this chunk's own k/v (no gather from the pool), and
            # plain causal attention over 4-D inputs with as many K/V heads as query heads is what SDPA sends to its
            # flash kernel; GQA or a mask tensor send it to the math path (128 tokens, 9 heads: 0.46 vs 0.71 ms).
            group = heads // kv_heads
            written = out_slots[start : start + ext]
            kn = attended_rows(k_cache, written, k[start : start + ext])
            vn = attended_rows(v_cache, written, v[start : start + ext])
            keys = kn.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, ext, D]
            values = vn.transpose(0, 1).repeat_interleave(group, dim=0)
            o = F.scaled_dot_product_attention(qs[None], keys[None], values[None], is_causal=True, scale=scale)[0]
        else:
            total = prefix + ext
            slots = req_to_token[row, :total].to(torch.int64)
            # This request's rows only (dequantized here when the cache is int8), never the whole pool.
            keys = gather_rows(k_cache, slots, q.dtype).transpose(0, 1)  # [KVH, total, D]
            values = gather_rows(v_cache, slots, q.dtype).transpose(0, 1)
            # Query i sits at absolute position prefix + i and sees keys 0..prefix + i. A continued prompt (chunked
            # prefill, a prefix-cache hit): 4-D inputs keep SDPA on its flash kernel even with GQA and a mask; 3-D
            # ones sent it to the math path, 2-3x slower (1000 cached + 64 new tokens: 5.8 vs 10.5 ms per layer).
            mask = torch.ones(ext, total, dtype=torch.bool, device=q.device).tril(diagonal=prefix)
            o = F.scaled_dot_product_attention(
                qs[None], keys[None], values[None], attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads
            )[0]
        out[start : start + ext] = o.transpose(0, 1)
        start += ext
    return out


# Without the C++ ops, the reference is registered as the op for graphs that would trace prefill (the C++ library
# defines it otherwise); the eager prefill calls `prefill_attention` below, never the Python op: through the
# dispatcher, a Python custom op's first call imports dynamo (~1.3 s of a short `ember generate`).
if not NATIVE_OPS:
    torch.library.custom_op("ember::prefill_attention", mutates_args=("k_cache", "v_cache"))(reference_prefill_attention)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    prefill_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The eager prefill's attention: the C++ flash kernel (engine/ops/csrc/attention/prefill_attention.cpp) where the
    active tier has one for this head size, else the SDPA reference (the scalar tier, EMBER_NATIVE_OPS=0).

    The kernel reads a chunk's own K/V back from the cache it just wrote, as it reads the prefix: with a cache of
    another dtype than q (--kv-cache-dtype) the chunk attends the rounded values later steps read, where the
    reference attends q's own; with int8 / fp8 both attend the stored values."""
    if NATIVE_OPS and torch.ops.ember.prefill_kernel_ready(q.shape[-1]):
        return torch.ops.ember.prefill_attention(q, k, v, k_cache, v_cache, out_slots, req_to_token, req_rows,
                                                 prefix_lens, prefill_lens, scale)
    return reference_prefill_attention(q, k, v, k_cache, v_cache, out_slots, req_to_token, req_rows, prefix_lens,
                                       prefill_lens, scale)
