"""KV caches of another dtype than the activations (--kv-cache-dtype): ember::decode_attention on an int8 cache
(engine/ops/kv_quant.py), on every ISA tier, against the Python reference and against full-precision attention over the
dequantized cache; prefill over an int8 cache; float caches of the other float dtype."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.ops import attention
from engine.ops.kv_quant import dequantize_rows, quantize_rows
from isa_tiers import EVERY


SCALED = [pytest.param(torch.int8, id="int8"), pytest.param(torch.float8_e4m3fn, id="fp8")]


def _setup_q8(dtype: torch.dtype, lens: list[int], heads: int, kv_heads: int, dim: int, seed: int = 0,
              kv: torch.dtype = torch.int8):
    g = torch.Generator().manual_seed(seed)
    b, slots_total, ctx = len(lens), 600, 160
    # Rows of very different magnitudes: each (slot, head) row gets its own scale, so a shared one would show.
    mag = torch.rand(slots_total + 1, kv_heads, 1, generator=g) * 4 + 0.05
    k_cache = quantize_rows(torch.randn(slots_total + 1, kv_heads, dim, generator=g) * mag, kv)
    v_cache = quantize_rows(torch.randn(slots_total + 1, kv_heads, dim, generator=g) * mag, kv)
    k_cache[0].zero_(), v_cache[0].zero_()  # the padding slot, zeroed as KVPool does
    table = torch.zeros(b + 1, ctx, dtype=torch.int32)
    perm = torch.randperm(slots_total, generator=g) + 1  # scattered slots
    used = 0
    for i, n in enumerate(lens):
        table[i + 1, :n] = perm[used : used + n].to(torch.int32)
        used += n
    rows = torch.arange(1, b + 1, dtype=torch.int64)
    seq = torch.tensor(lens, dtype=torch.int64)
    out_slots = table[rows, seq - 1].to(torch.int64)
    q = torch.randn(b, heads, dim, generator=g).to(dtype)
    k = (torch.randn(b, kv_heads, dim, generator=g) * 2).to(dtype)
    v = (torch.randn(b, kv_heads, dim, generator=g) * 2).to(dtype)
    return q, k, v, k_cache, v_cache, out_slots, table, rows, seq


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)  # (torch.equal has no fp8 kernel; bytes are what must match)


def test_quantize_rows_round_trip_is_within_half_a_step() -> None:
    # int8: an absolute step of absmax / 127 everywhere in the row.
    x = torch.randn(50, 3, 64) * torch.rand(50, 3, 1) * 10
    x[7, 1] = 0  # an all-zero row: scale 0, values 0, no NaN
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 68)
    back = dequantize_rows(rows, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert bool(((back - x).abs() <= step / 2 + 1e-6).all())
    assert bool((back[7, 1] == 0).all())
    assert bool((rows[..., :64] != 0).any(-1).sum() > 140)  # values are spread over the int8 range, not all 0


def test_fp8_rows_keep_three_mantissa_bits() -> None:
    # fp8 e4m3: a relative step of 2^-3 (half of it lost at most) down to e4m3's subnormals, absmax mapped to 448.
    x = torch.randn(50, 3, 64) * torch.rand(50, 3, 1) * 10
    rows = quantize_rows(x, torch.float8_e4m3fn)
    assert rows.dtype == torch.float8_e4m3fn and rows.shape == (50, 3, 68)
    back = dequantize_rows(rows, torch.float32)
    scale = x.abs().amax(-1, keepdim=True) / 448
    assert bool(((back - x).abs() <= x.abs() / 16 + scale * 2**-9 + 1e-6).all())
    torch.testing.assert_close(back.abs().amax(-1), x.abs().amax(-1))  # the largest value is exact (448 is e4m3)


@pytest.mark.parametrize("kv", SCALED)
@pytest.mark.parametrize("isa", EVERY)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 32), (9, 3, 64), (4, 4, 128), (6, 2, 48), (2, 1, 80),
                                                (32, 2, 64), (8, 1, 128)])
def test_native_q8_decode_matches_reference(dtype: torch.dtype, tol: float, heads: int, kv_heads: int, dim: int,
                                            isa: str, kv: torch.dtype) -> None:
    # The same head sizes as the unquantized test: vector kernels for 32/64/80/128, 48 portable on AVX-512.
    assert attention.NATIVE_DECODE_ATTENTION, "this machine has a C++ compiler: the native op must be built"
    q, k, v, kc, vc, slots, table, rows, seq = _setup_q8(dtype, [1, 17, 150, 40, 3, 9], heads, kv_heads, dim, kv=kv)
    kc2, vc2 = kc.clone(), vc.clone()
    got = torch.ops.ember.decode_attention_isa(q, k, v, kc, vc, slots, table, rows, seq, 0.17, isa)
    want = attention.reference_decode_attention(q, k, v, kc2, vc2, slots, table, rows, seq, 0.17)
    # Both quantized this step's K/V into the same bytes (values and scales), and nothing else changed.
    assert _bytes(kc).equal(_bytes(kc2)) and _bytes(vc).equal(_bytes(vc2))
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kv,bound", [pytest.param(torch.int8, 0.05, id="int8"),
                                      pytest.param(torch.float8_e4m3fn, 0.3, id="fp8")])
@pytest.mark.parametrize("isa", EVERY)
def test_q8_decode_equals_full_precision_attention_over_the_dequantized_cache(isa: str, kv: torch.dtype,
                                                                              bound: float) -> None:
    q, k, v, kc, vc, slots, table, rows, seq = _setup_q8(torch.float32, [5, 33, 130], 9, 3, 64, seed=3, kv=kv)
    got = torch.ops.ember.decode_attention_isa(q, k, v, kc, vc, slots, table, rows, seq, 0.125, isa)
    # After the op wrote the new rows, the dequantized cache is exactly what it attended over.
    kd, vd = dequantize_rows(kc, torch.float32), dequantize_rows(vc, torch.float32)
    exact = attention.reference_decode_attention(q, dequantize_rows(kc[slots], torch.float32),
                                                 dequantize_rows(vc[slots], torch.float32), kd.clone(), vd.clone(),
                                                 slots, table, rows, seq, 0.125)
    torch.testing.assert_close(got, exact, atol=2e-5, rtol=2e-5)
    # And against the new K/V unquantized the difference is int8 rounding's: small, yet not zero.
    kf, vf = kd.clone(), vd.clone()
    full = attention.reference_decode_attention(q, k, v, kf, vf, slots, table, rows, seq, 0.125)
    err = (got - full).abs().max().item()
    assert 0 < err < bound, err


def test_q8_prefill_over_a_cached_prefix_reads_the_quantized_rows() -> None:
    # A 6-token prompt as a 4-token chunk then a 2-token one: the second chunk attends over the int8 rows of all six.
    g = torch.Generator().manual_seed(4)
    heads, kvh, dim, n = 4, 2, 16, 6
    q, k, v = (torch.randn(n, h, dim, generator=g) for h in (heads, kvh, kvh))
    table = torch.zeros(2, 16, dtype=torch.int32)
    table[1, :n] = torch.arange(1, n + 1, dtype=torch.int32)
    kc, vc = torch.zeros(n + 1, kvh, dim + 4, dtype=torch.int8), torch.zeros(n + 1, kvh, dim + 4, dtype=torch.int8)
    for start, end in [(0, 4), (4, 6)]:
        out = attention.prefill_attention(q[start:end], k[start:end], v[start:end], kc, vc,
                                          torch.arange(start + 1, end + 1), table, torch.tensor([1]),
                                          torch.tensor([start]), torch.tensor([end - start]), 0.25)
    assert torch.equal(kc[1:], quantize_rows(k)) and torch.equal(vc[1:], quantize_rows(v))
    kq, vq = dequantize_rows(kc[1:], torch.float32), dequantize_rows(vc[1:], torch.float32)
    mask = torch.ones(2, n, dtype=torch.bool).tril(diagonal=4)
    want = F.scaled_dot_product_attention(q[4:].transpose(0, 1), kq.transpose(0, 1).repeat_interleave(2, 0),
                                          vq.transpose(0, 1).repeat_interleave(2, 0), attn_mask=mask, scale=0.25)
    torch.testing.assert_close(out, want.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_q8_decode_traces_under_compile() -> None:
    # The fake kernel: a compiled caller of the op on an int8 cache returns what the eager op does.
    import kernels_fake  # noqa: F401

    q, k, v, kc, vc, slots, table, rows, seq = _setup_q8(torch.float32, [7, 20], 4, 2, 32, seed=5)
    kc2, vc2 = kc.clone(), vc.clone()

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        return torch.ops.ember.decode_attention(q * 2, k, v, kc, vc, slots, table, rows, seq, 0.3) + 1

    got = torch.compile(step, fullgraph=True)(q, k, v, kc, vc)
    want = step(q, k, v, kc2, vc2)
    assert torch.equal(kc, kc2)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("isa", EVERY)
@pytest.mark.parametrize("act,cache", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_decode_with_a_float_cache_of_the_other_dtype(act: torch.dtype, cache: torch.dtype, isa: str) -> None:
    # --kv-cache-dtype float32 under --dtype bfloat16 and the reverse: the op converts the new K/V into the cache.
    q, k, v, kc, vc, slots, table, rows, seq = _setup_q8(act, [9, 70], 9, 3, 64, seed=6)
    kc, vc = dequantize_rows(kc, cache), dequantize_rows(vc, cache)
    kc2, vc2 = kc.clone(), vc.clone()
    got = torch.ops.ember.decode_attention_isa(q, k, v, kc, vc, slots, table, rows, seq, 0.125, isa)
    want = attention.reference_decode_attention(q, k, v, kc2, vc2, slots, table, rows, seq, 0.125)
    assert got.dtype == act and torch.equal(kc, kc2) and torch.equal(kc[slots], k.to(cache))
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("isa", EVERY)
def test_every_fp8_code_is_read_exactly(isa: str) -> None:
    # A request whose one visible key is a crafted row attends to it alone (probability 1), so the output is that
    # value row as the kernel widened it: 4 rows of 64 hold all 256 e4m3 codes (the two NaN codes as zeros), scale 1.
    codes = torch.arange(256, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0
    vals = codes.to(torch.uint8).view(4, 1, 64)
    one = torch.tensor([1.0]).view(torch.uint8).expand(4, 1, 4)
    vc = torch.cat([vals, one], dim=-1).view(torch.float8_e4m3fn)
    vc = torch.cat([torch.zeros(1, 1, 68, dtype=torch.uint8).view(torch.float8_e4m3fn), vc])  # slot 0: the scratch
    kc = vc.view(torch.uint8).clone().view(torch.float8_e4m3fn)
    table = torch.zeros(5, 4, dtype=torch.int32)
    table[1:, 0] = torch.arange(1, 5, dtype=torch.int32)
    rows, seq = torch.arange(1, 5), torch.ones(4, dtype=torch.int64)
    q, k = torch.randn(4, 1, 64), torch.zeros(4, 1, 64)
    # The step's own K/V go to slot 0, which no request reads here (its table row points past it).
    out = torch.ops.ember.decode_attention_isa(q, k, k, kc, vc, torch.zeros(4, dtype=torch.int64), table, rows, seq,
                                               0.1, isa)
    want = vals.view(torch.float8_e4m3fn).float()
    assert torch.equal(out, want), (out - want).abs().max()
