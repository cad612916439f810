"""Prefill attention of a sliding-window layer, over its per-request ring (engine/pools.py WindowKVPool) or, with the
prefix cache on, over the token pool (`window_pool_prefill_attention`).

A query at position p sees keys at (p - window, p]. A chunk of new tokens at [P, P + n) therefore needs the ring's
last min(P, window - 1) cached positions plus the chunk itself; those are gathered first, because writing the chunk
into the ring overwrites positions its own early queries still see. Long chunks run in query blocks of `window`, each
against at most 2 * window - 1 keys, so a prompt costs O(n * window), not O(n^2): the window saves time as well as
memory. Eager only, like prefill_attention (engine/ops/attention.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.kv_quant import attended_rows, dequantize_rows, gather_rows, is_quantized, quantize_rows, write_rows


def window_prefill_attention(
    q: torch.Tensor,  # [T, H, D]: the new tokens of all requests, concatenated
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    k_ring: torch.Tensor,  # [rows * ring + 1, KVH, D] for ONE layer (ring >= window: engine/pools.py WindowKVPool)
    v_ring: torch.Tensor,
    ring_table: torch.Tensor,  # [rows + 1, ring] int32: (request row, position % ring) -> ring slot
    req_rows: torch.Tensor,  # [N] int64
    prefix_lens: torch.Tensor,  # [N] int64: tokens already computed before this chunk
    prefill_lens: torch.Tensor,  # [N] int64
    window: int,
    scale: float,
) -> torch.Tensor:
    heads, kv_heads = q.shape[1], k.shape[1]
    ring = ring_table.shape[1]
    out = torch.empty_like(q)
    start = 0
    for row, prefix, ext in zip(req_rows.tolist(), prefix_lens.tolist(), prefill_lens.tolist()):
        kn, vn = k[start : start + ext], v[start : start + ext]
        ka, va = kn, vn  # what the chunk's queries attend of the chunk itself
        if is_quantized(k_ring):  # the int8 values later steps read (see prefill_attention)
            ka, va = dequantize_rows(quantize_rows(kn), q.dtype), dequantize_rows(quantize_rows(vn), q.dtype)
        old = min(prefix, window - 1)  # cached positions the chunk's first query still sees
        keys, values = ka, va
        if old:
            cached = ring_table[row, torch.arange(prefix - old, prefix) % ring].to(torch.int64)
            # (dequantized here when the ring is int8, --kv-cache-dtype: only these rows)
            keys = torch.cat([gather_rows(k_ring, cached, q.dtype), ka])
            values = torch.cat([gather_rows(v_ring, cached, q.dtype), va])
        qs = q[start : start + ext].transpose(0, 1)  # [H, ext, D]
        if not old and ext <= window:
            # The whole window is visible: plain causal attention, SDPA's flash path (see prefill_attention).
            group = heads // kv_heads
            kh = keys.transpose(0, 1).repeat_interleave(group, dim=0)
            vh = values.transpose(0, 1).repeat_interleave(group, dim=0)
            o = F.scaled_dot_product_attention(qs[None], kh[None], vh[None], is_causal=True, scale=scale)[0]
        else:
            o = _banded(qs, keys.transpose(0, 1), values.transpose(0, 1), old, window, scale, heads != kv_heads)
        out[start : start + ext] = o.transpose(0, 1)
        keep = min(ext, window)  # the ring keeps the chunk's last `window` positions
        slots = ring_table[row, torch.arange(prefix + ext - keep, prefix + ext) % ring].to(torch.int64)
        write_rows(k_ring, slots, kn[ext - keep :])
        write_rows(v_ring, slots, vn[ext - keep :])
        start += ext
    return out


def window_pool_prefill_attention(
    q: torch.Tensor,  # [T, H, D]: the new tokens of all requests, concatenated
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [slots + 1, KVH, D]: a window layer's buffer
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,  # [T] int64
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,  # [N] int64
    prefix_lens: torch.Tensor,  # [N] int64
    prefill_lens: torch.Tensor,  # [N] int64
    window: int,
    scale: float,
    slot_map: torch.Tensor | None = None,  # token-pool slot -> slot of these buffers (engine/window_slots.py)
) -> torch.Tensor:
    """A window layer's prefill when every position has its own slot (the prefix cache on): the chunk is written
    first and each request's queries attend their band over the last min(P, window - 1) cached positions plus the
    chunk. With an int8 / fp8 cache the chunk attends the values later steps read (as prefill_attention does), and
    only the gathered rows are dequantized."""
    if slot_map is not None:
        out_slots = slot_map[out_slots].to(torch.int64)
    write_rows(k_cache, out_slots, k)
    write_rows(v_cache, out_slots, v)
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    start = 0
    for row, prefix, ext in zip(req_rows.tolist(), prefix_lens.tolist(), prefill_lens.tolist()):
        old = min(prefix, window - 1)
        qs = q[start : start + ext].transpose(0, 1)  # [H, ext, D]
        if not old and ext <= window:  # the whole window is visible: plain causal attention (SDPA's flash path)
            group = heads // kv_heads
            written = out_slots[start : start + ext]
            kn = attended_rows(k_cache, written, k[start : start + ext])
            vn = attended_rows(v_cache, written, v[start : start + ext])
            kh = kn.transpose(0, 1).repeat_interleave(group, dim=0)
            vh = vn.transpose(0, 1).repeat_interleave(group, dim=0)
            o = F.scaled_dot_product_attention(qs[None], kh[None], vh[None], is_causal=True, scale=scale)[0]
        else:
            slots = req_to_token[row, prefix - old : prefix + ext].to(torch.int64)
            if slot_map is not None:
                slots = slot_map[slots].to(torch.int64)
            o = _banded(qs, gather_rows(k_cache, slots, q.dtype).transpose(0, 1),
                        gather_rows(v_cache, slots, q.dtype).transpose(0, 1), old, window, scale, heads != kv_heads)
        out[start : start + ext] = o.transpose(0, 1)
        start += ext
    return out


def _banded(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, old: int, window: int, scale: float,
            gqa: bool) -> torch.Tensor:
    """q [H, n, D] at positions P..P+n-1; keys/values [KVH, old + n, D] at P-old..P+n-1. Query i sees key j iff
    i + old - window < j <= i + old."""
    n = q.shape[1]
    out = torch.empty_like(q)
    for b0 in range(0, n, window):
        b1 = min(n, b0 + window)
        k0, k1 = max(0, b0 + old - window + 1), b1 + old
        qi = torch.arange(b0, b1)[:, None] + old
        kj = torch.arange(k0, k1)[None, :]
        mask = (kj <= qi) & (kj > qi - window)
        out[:, b0:b1] = F.scaled_dot_product_attention(
            q[None, :, b0:b1], keys[None, :, k0:k1], values[None, :, k0:k1], attn_mask=mask, scale=scale, enable_gqa=gqa
        )[0]
    return out
