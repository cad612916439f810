"""The C++ ember::prefill_attention (flash kernels per vector tier) against the SDPA reference, over the pool layouts
a server makes: scattered slots, cached prefixes, several requests in one chunk, every KV cache dtype."""
from __future__ import annotations

import pytest
import torch

from engine.ops import attention
from engine.ops.kv_quant import quantize_rows
from engine.ops.native import NATIVE_OPS, forced_isa
from isa_tiers import LINEAR

VECTOR_TIERS = LINEAR  # the tiers with prefill kernels: avx512bf16, avx512, avx2 (scalar runs the reference)

# (prefix, new tokens) per request: a long whole prompt crossing several key blocks and query blocks, a prompt
# continued after a cached prefix, a one-token chunk, a short whole prompt.
REQUESTS = [(0, 150), (70, 33), (5, 1), (0, 9)]


def _setup(q_dtype: torch.dtype, kv_dtype: torch.dtype, heads: int, kv_heads: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n_req, ctx = len(REQUESTS), 256
    total = sum(p + e for p, e in REQUESTS)
    slots_total = total + 40
    width = dim + 4 if kv_dtype in (torch.int8, torch.float8_e4m3fn) else dim
    kc = torch.zeros(slots_total + 1, kv_heads, width, dtype=kv_dtype)
    vc = torch.zeros(slots_total + 1, kv_heads, width, dtype=kv_dtype)
    table = torch.zeros(n_req + 1, ctx, dtype=torch.int32)
    perm = torch.randperm(slots_total, generator=g) + 1  # scattered slots, as after many alloc/free cycles
    used, out_slots = 0, []
    for i, (prefix, ext) in enumerate(REQUESTS):
        table[i + 1, : prefix + ext] = perm[used : used + prefix + ext].to(torch.int32)
        used += prefix + ext
        out_slots.append(table[i + 1, prefix : prefix + ext].long())
        if prefix:  # the cached prefix, written as an earlier chunk would have
            pk, pv = (torch.randn(prefix, kv_heads, dim, generator=g).to(q_dtype) for _ in range(2))
            slots = table[i + 1, :prefix].long()
            for cache, x in ((kc, pk), (vc, pv)):
                if kv_dtype in (torch.int8, torch.float8_e4m3fn):
                    cache.view(torch.uint8)[slots] = quantize_rows(x, kv_dtype).view(torch.uint8)
                else:
                    cache[slots] = x.to(kv_dtype)
    t = sum(e for _, e in REQUESTS)
    q = torch.randn(t, heads, dim, generator=g).to(q_dtype)
    k = torch.randn(t, kv_heads, dim, generator=g).to(q_dtype)
    v = torch.randn(t, kv_heads, dim, generator=g).to(q_dtype)
    meta = (torch.cat(out_slots), table, torch.arange(1, n_req + 1), torch.tensor([p for p, _ in REQUESTS]),
            torch.tensor([e for _, e in REQUESTS]))
    return q, k, v, kc, vc, meta


@pytest.mark.parametrize("isa", VECTOR_TIERS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
# SmolLM2's 9/3 heads (3 per KV head: 21 queries a task, one padding row), Llama-3.2-1B/3B/8B's, Gemma's 256,
# Phi-3's 96, 80 (5 or 10 vectors), MHA, and more query heads per KV head (40) than one pass of rows holds on AVX2.
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 64), (24, 8, 128), (8, 1, 256), (32, 8, 96),
                                                (4, 4, 80), (2, 1, 32), (40, 1, 64)])
def test_native_prefill_attention_matches_reference(isa: str, dtype: torch.dtype, tol: float, heads: int,
                                                    kv_heads: int, dim: int) -> None:
    q, k, v, kc, vc, meta = _setup(dtype, dtype, heads, kv_heads, dim)
    kc2, vc2 = kc.clone(), vc.clone()
    got = torch.ops.ember.prefill_attention_isa(q, k, v, kc, vc, *meta, 0.11, isa)
    want = attention.reference_prefill_attention(q, k, v, kc2, vc2, *meta, 0.11)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # both wrote the chunk's K/V into the same slots
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("isa", VECTOR_TIERS)
@pytest.mark.parametrize("kv", [torch.int8, torch.float8_e4m3fn])
def test_native_prefill_attention_reads_the_quantized_rows(isa: str, kv: torch.dtype) -> None:
    # Both attend the stored (dequantized) rows, the chunk's own included: the same values later steps read.
    q, k, v, kc, vc, meta = _setup(torch.float32, kv, 9, 3, 64, seed=1)
    kc2, vc2 = kc.clone(), vc.clone()
    got = torch.ops.ember.prefill_attention_isa(q, k, v, kc, vc, *meta, 0.125, isa)
    want = attention.reference_prefill_attention(q, k, v, kc2, vc2, *meta, 0.125)
    assert torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("isa", VECTOR_TIERS)
def test_native_prefill_attention_over_a_cache_of_another_dtype(isa: str) -> None:
    # fp32 activations over a bf16 cache: the kernel attends the rounded rows it stored (the reference attends the
    # chunk's own K/V unrounded), so it equals the reference run on the rounded K/V.
    q, k, v, kc, vc, meta = _setup(torch.float32, torch.bfloat16, 32, 8, 64, seed=2)
    got = torch.ops.ember.prefill_attention_isa(q, k, v, kc, vc, *meta, 0.125, isa)
    kr, vr = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
    kc2, vc2 = kc.clone(), vc.clone()
    want = attention.reference_prefill_attention(q, kr, vr, kc2, vc2, *meta, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("isa", VECTOR_TIERS)
def test_chunked_prefill_equals_one_prefill(isa: str) -> None:
    # A 150-token prompt prefilled in chunks of 64, 64 and 22 (each over the cached rows before it) gives the rows
    # one prefill gives, to fp32 rounding: the kernel reads prefix and chunk alike, from the pool.
    g = torch.Generator().manual_seed(3)
    heads, kvh, dim, n = 32, 8, 64, 150
    q, k, v = (torch.randn(n, h, dim, generator=g) for h in (heads, kvh, kvh))
    table = torch.zeros(2, 256, dtype=torch.int32)
    table[1, :n] = torch.randperm(n, generator=g).to(torch.int32) + 1

    def run(spans: list[tuple[int, int]]) -> torch.Tensor:
        kc, vc = torch.zeros(n + 1, kvh, dim), torch.zeros(n + 1, kvh, dim)
        outs = [torch.ops.ember.prefill_attention_isa(
            q[a:b], k[a:b], v[a:b], kc, vc, table[1, a:b].long(), table, torch.tensor([1]), torch.tensor([a]),
            torch.tensor([b - a]), 0.125, isa) for a, b in spans]
        return torch.cat(outs)

    torch.testing.assert_close(run([(0, 64), (64, 128), (128, 150)]), run([(0, 150)]), atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not NATIVE_OPS, reason="the C++ ops are not built (EMBER_NATIVE_OPS=0)")
def test_scalar_tier_and_odd_head_sizes_run_the_reference() -> None:
    # No kernel for the scalar tier or a head size of 16: prefill_attention runs SDPA, bit for bit the reference.
    with forced_isa("scalar"):
        assert not torch.ops.ember.prefill_kernel_ready(64)
        q, k, v, kc, vc, meta = _setup(torch.float32, torch.float32, 9, 3, 64, seed=4)
        got = attention.prefill_attention(q, k, v, kc, vc, *meta, 0.125)
        want = attention.reference_prefill_attention(q, k, v, kc.clone(), vc.clone(), *meta, 0.125)
        assert torch.equal(got, want)
    assert not torch.ops.ember.prefill_kernel_ready(16)
    with pytest.raises(RuntimeError, match="no scalar kernel"):
        torch.ops.ember.prefill_attention_isa(q, k, v, kc, vc, *meta, 0.125, "scalar")



HAS_AMX = bool(NATIVE_OPS and torch.ops.ember.isa_has_amx())


@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX-BF16: the AMX prefill attention kernel cannot run")
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 64), (24, 8, 128), (40, 1, 64), (8, 1, 256)])
def test_amx_kernel_runs_bf16_prompts_within_bf16_of_the_vector_kernel(heads: int, kv_heads: int, dim: int) -> None:
    """On the avx512bf16 tier of an AMX CPU, a bf16 prompt over a bf16 cache takes tile products (head sizes 64,
    128 and Gemma's 256): keys in blocks of 128 (the 150-token prompt spans two, the last one partial), query rows
    in blocks of 16 (SmolLM2's 21 tokens x 3 heads a task leave a padding row). They round the softmax numerators to
    bf16, so their bits differ from the AVX-512 kernel's; their error against fp32 attention on the same bf16 inputs
    stays that kernel's (the output's own bf16 rounding dominates both)."""
    q, k, v, kc, vc, meta = _setup(torch.bfloat16, torch.bfloat16, heads, kv_heads, dim, seed=5)
    amx = torch.ops.ember.prefill_attention_isa(q, k, v, kc.clone(), vc.clone(), *meta, 0.11, "avx512bf16").float()
    vec = torch.ops.ember.prefill_attention_isa(q, k, v, kc.clone(), vc.clone(), *meta, 0.11, "avx512").float()
    want = attention.reference_prefill_attention(q.float(), k.float(), v.float(), kc.float(), vc.float(), *meta, 0.11)
    assert not torch.equal(amx, vec)  # another kernel ran: the tier is not silently the vector one
    torch.testing.assert_close(amx, want, atol=2e-2, rtol=2e-2)
    assert (amx - want).abs().mean() < 1.5 * (vec - want).abs().mean()
