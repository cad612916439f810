"""The C++ ember::decode_attention against the Python reference, and both attention ops against SDPA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.ops import attention
from isa_tiers import EVERY


def _setup(dtype: torch.dtype, lens: list[int], heads: int = 8, kv_heads: int = 2, dim: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, slots_total, ctx = len(lens), max(600, sum(lens)), max(128, max(lens))
    k_cache = torch.randn(slots_total + 1, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(slots_total + 1, kv_heads, dim, generator=g).to(dtype)
    table = torch.zeros(b + 1, ctx, dtype=torch.int32)
    perm = torch.randperm(slots_total, generator=g) + 1  # scattered slots, as after many alloc/free cycles
    used = 0
    for i, n in enumerate(lens):
        table[i + 1, :n] = perm[used : used + n].to(torch.int32)
        used += n
    rows = torch.arange(1, b + 1, dtype=torch.int64)
    seq = torch.tensor(lens, dtype=torch.int64)
    out_slots = table[rows, seq - 1].to(torch.int64)  # the newest position of each request
    q = torch.randn(b, heads, dim, generator=g).to(dtype)
    k = torch.randn(b, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(b, kv_heads, dim, generator=g).to(dtype)
    return q, k, v, k_cache, v_cache, out_slots, table, rows, seq


@pytest.mark.parametrize("isa", EVERY)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
# More query heads per KV head than one register pass holds (16, 7 and 8 at head sizes 64, 96, 256) take the
# kernels through several passes of heads and of head-size chunks.
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 32), (9, 3, 64), (4, 4, 128), (6, 2, 48), (2, 1, 80),
                                                (32, 2, 64), (28, 4, 96), (8, 1, 256)])
def test_native_decode_attention_matches_reference(dtype: torch.dtype, tol: float, heads: int, kv_heads: int,
                                                   dim: int, isa: str) -> None:
    # dim 32/64/80/128 take the vector kernels (9/3 is SmolLM2's grouping; 80 is 5 AVX-512 or 10 AVX2 vectors), 48
    # has one on AVX2 only (6 x 8 lanes) and takes the portable loop on AVX-512; the lengths cross the 8- and 16-key
    # blocks and the prefetch distance.
    assert attention.NATIVE_DECODE_ATTENTION, "this machine has a C++ compiler: the native op must be built"
    q, k, v, kc, vc, slots, table, rows, seq = _setup(dtype, [1, 17, 128, 40, 3, 9], heads, kv_heads, dim)
    kc2, vc2 = kc.clone(), vc.clone()
    got = torch.ops.ember.decode_attention_isa(q, k, v, kc, vc, slots, table, rows, seq, 0.17, isa)
    want = attention.reference_decode_attention(q, k, v, kc2, vc2, slots, table, rows, seq, 0.17)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # both wrote the new K/V into the same slots
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _verify_rows(lens_per_request: list[list[int]], q_dtype: torch.dtype, heads: int, kv_heads: int, dim: int):
    """A verify step's batch: each request's rows (its last token and its drafts) at consecutive lengths on its own
    request row, as engine/speculative.py lays them out."""
    q, k, v, kc, vc, _, table, _, _ = _setup(q_dtype, [max(ls) for ls in lens_per_request], heads, kv_heads, dim)
    rows = torch.tensor([i + 1 for i, ls in enumerate(lens_per_request) for _ in ls], dtype=torch.int64)
    seq = torch.tensor([n for ls in lens_per_request for n in ls], dtype=torch.int64)
    g = torch.Generator().manual_seed(5)
    b = len(rows)
    q = torch.randn(b, heads, dim, generator=g).to(q_dtype)
    k = torch.randn(b, kv_heads, dim, generator=g).to(q_dtype)
    v = torch.randn(b, kv_heads, dim, generator=g).to(q_dtype)
    return q, k, v, kc, vc, table[rows, seq - 1].to(torch.int64), table, rows, seq


@pytest.mark.parametrize("isa", EVERY)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (2, 1, 80)])
def test_verify_rows_of_one_request_attend_each_to_its_own_length(dtype: torch.dtype, tol: float, heads: int,
                                                                   kv_heads: int, dim: int, isa: str) -> None:
    """A request's verify rows share one request row: each sees exactly the context up to its own position, its own
    K/V and the drafts before it (all rows' K/V are written before any attends), as a lone decode row would."""
    # 8 rows of one request alone, then mixed: single rows, runs of 3 and 5, one run crossing a 16-key block; then
    # 8 rows past 100 positions beside a run of 2; 12 rows (three runs) across the 1024-position chunk boundary; a
    # run across the second boundary beside a lone row.
    for layout in ([list(range(30, 38))], [[9], [20, 21, 22], [1], [60, 61, 62, 63, 64], [15, 16, 17]],
                   [list(range(100, 108)), [40, 41]], [list(range(1018, 1030))], [list(range(2046, 2052)), [300]]):
        q, k, v, kc, vc, slots, table, rows, seq = _verify_rows(layout, dtype, heads, kv_heads, dim)
        kc2, vc2 = kc.clone(), vc.clone()
        got = torch.ops.ember.decode_attention_isa(q, k, v, kc, vc, slots, table, rows, seq, 0.17, isa)
        want = attention.reference_decode_attention(q, k, v, kc2, vc2, slots, table, rows, seq, 0.17)
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        # and each row alone (its own K/V and the earlier rows' already in the cache) gives the same output, to the
        # bit: a verify row's attention is the one decode would compute at its position
        for i in range(len(rows)):
            one = torch.ops.ember.decode_attention_isa(q[i:i + 1], k[i:i + 1], v[i:i + 1], kc, vc, slots[i:i + 1],
                                                       table, rows[i:i + 1], seq[i:i + 1], 0.17, isa)
            assert torch.equal(one, got[i:i + 1]), f"row {i} of {layout}"



@pytest.mark.parametrize("isa", EVERY)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (2, 1, 80)])
def test_contexts_of_many_chunks_match_reference(dtype: torch.dtype, tol: float, heads: int, kv_heads: int, dim: int,
                                                 isa: str) -> None:
    """Contexts past one kernel call's 1024 positions are attended in chunks whose partial softmaxes are combined:
    lengths at, just past and well past the chunk boundaries, each request alone (its chunks spread over the
    threads) and all together (a task per request and KV head)."""
    lens = [1024, 1025, 2100, 3000, 2049, 40]
    q, k, v, kc, vc, slots, table, rows, seq = _setup(dtype, lens, heads, kv_heads, dim, seed=3)
    kc2, vc2 = kc.clone(), vc.clone()
    got = torch.ops.ember.decode_attention_isa(q, k, v, kc, vc, slots, table, rows, seq, 0.17, isa)
    want = attention.reference_decode_attention(q, k, v, kc2, vc2, slots, table, rows, seq, 0.17)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    for i in range(len(lens)):  # to the bit: how the chunks were spread does not change a row's output
        one = torch.ops.ember.decode_attention_isa(q[i:i + 1], k[i:i + 1], v[i:i + 1], kc, vc, slots[i:i + 1],
                                                   table, rows[i:i + 1], seq[i:i + 1], 0.17, isa)
        assert torch.equal(one, got[i:i + 1]), f"request of {lens[i]} positions"


def test_a_long_request_alone_is_spread_over_threads_with_the_same_bits() -> None:
    """One request of a 3-KV-head model has 3 (request, head) tasks for 2 threads; its chunks become tasks of their
    own. Its output equals the one computed with a thread, and with a batch big enough not to spread."""
    q, k, v, kc, vc, slots, table, rows, seq = _setup(torch.bfloat16, [2500] + [300] * 11, 9, 3, 64, seed=4)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            outs.append(torch.ops.ember.decode_attention(q[:1], k[:1], v[:1], kc, vc, slots[:1], table, rows[:1],
                                                         seq[:1], 0.125))
        torch.set_num_threads(2)
        batch = torch.ops.ember.decode_attention(q, k, v, kc, vc, slots, table, rows, seq, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs) and torch.equal(batch[:1], outs[0])
    want = attention.reference_decode_attention(q[:1], k[:1], v[:1], kc.clone(), vc.clone(), slots[:1], table,
                                                rows[:1], seq[:1], 0.125)
    torch.testing.assert_close(outs[0].float(), want.float(), atol=2e-2, rtol=2e-2)


def test_decode_attention_equals_dense_sdpa() -> None:
    q, k, v, kc, vc, slots, table, rows, seq = _setup(torch.float32, [5, 33])
    got = torch.ops.ember.decode_attention(q, k, v, kc, vc, slots, table, rows, seq, 32**-0.5)
    for i, n in enumerate(seq.tolist()):
        keys = kc[table[i + 1, :n].long()].transpose(0, 1)  # [KVH, n, D]
        vals = vc[table[i + 1, :n].long()].transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[i][:, None], keys, vals, enable_gqa=True)[:, 0]
        torch.testing.assert_close(got[i], ref, atol=1e-5, rtol=1e-5)


def test_prefill_attention_is_causal_over_prefix() -> None:
    # A 6-token prompt prefilled as a 4-token chunk then a 2-token chunk equals one 6-token prefill.
    g = torch.Generator().manual_seed(1)
    heads, kvh, dim, n = 4, 2, 16, 6
    q, k, v = (torch.randn(n, h, dim, generator=g) for h in (heads, kvh, kvh))
    table = torch.zeros(2, 16, dtype=torch.int32)
    table[1, :n] = torch.arange(1, n + 1, dtype=torch.int32)
    rows = torch.tensor([1])

    def run(spans: list[tuple[int, int]]) -> torch.Tensor:
        kc, vc = torch.zeros(n + 1, kvh, dim), torch.zeros(n + 1, kvh, dim)
        outs = []
        for start, end in spans:
            outs.append(attention.prefill_attention(
                q[start:end], k[start:end], v[start:end], kc, vc, torch.arange(start + 1, end + 1), table, rows,
                torch.tensor([start]), torch.tensor([end - start]), 0.25))
        return torch.cat(outs)

    torch.testing.assert_close(run([(0, 4), (4, 6)]), run([(0, 6)]), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_prefill_attention_of_whole_prompts_equals_causal_sdpa(dtype: torch.dtype, tol: float) -> None:
    # Two whole prompts in one chunk (the path that reads k/v directly, not through the pool), GQA 9 -> 3 heads.
    g = torch.Generator().manual_seed(2)
    heads, kvh, dim, lens = 9, 3, 64, [5, 7]
    n = sum(lens)
    q, k, v = (torch.randn(n, h, dim, generator=g).to(dtype) for h in (heads, kvh, kvh))
    kc, vc = torch.zeros(n + 1, kvh, dim, dtype=dtype), torch.zeros(n + 1, kvh, dim, dtype=dtype)
    table = torch.zeros(3, 16, dtype=torch.int32)
    table[1, :5], table[2, :7] = torch.arange(1, 6), torch.arange(6, 13)
    out = torch.ops.ember.prefill_attention(q, k, v, kc, vc, torch.arange(1, n + 1), table, torch.tensor([1, 2]),
                                           torch.tensor([0, 0]), torch.tensor(lens), 0.125)
    assert torch.equal(kc[1:], k) and torch.equal(vc[1:], v)  # the pool got this chunk's K/V
    start = 0
    for length in lens:
        sl = slice(start, start + length)
        qs, ks, vs = (t[sl].float().transpose(0, 1) for t in (q, k, v))
        want = F.scaled_dot_product_attention(qs, ks.repeat_interleave(3, 0), vs.repeat_interleave(3, 0),
                                              is_causal=True, scale=0.125).transpose(0, 1)
        torch.testing.assert_close(out[sl].float(), want, atol=tol, rtol=tol)
        start += length


HAS_AMX = bool(attention.NATIVE_DECODE_ATTENTION and torch.ops.ember.isa_has_amx())


def _bf16_kernel_near_vector_kernel(tier: str, layout: list[list[int]], heads: int, kv_heads: int,
                                    dim: int) -> tuple[tuple, torch.Tensor]:
    """A bf16 verify batch of `layout` through `tier`'s kernel: within bf16's error of the reference and of the
    AVX-512 vector kernel, but not its bits (another kernel ran). Returns the op's arguments and the output."""
    args = _verify_rows(layout, torch.bfloat16, heads, kv_heads, dim) + (0.17,)
    q, k, v, kc, vc, slots, table, rows, seq, _ = args
    got = torch.ops.ember.decode_attention_isa(*args, tier)
    vec = torch.ops.ember.decode_attention_isa(*args, "avx512")
    want = attention.reference_decode_attention(q, k, v, kc.clone(), vc.clone(), slots, table, rows, seq, 0.17)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), vec.float(), atol=2e-2, rtol=2e-2)
    assert not torch.equal(got, vec)  # another kernel ran: the tier is not silently the vector one
    return args, got


HAS_BF16_TIER = bool(attention.NATIVE_DECODE_ATTENTION and "avx512bf16" in torch.ops.ember.isa_supported())


@pytest.mark.skipif(not HAS_BF16_TIER, reason="this CPU has no AVX512-BF16: the vdpbf16ps decode attention kernel "
                                              "(avx512bf16:dot) cannot run")
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 64), (32, 2, 64), (11, 1, 64)])
def test_dpbf16_kernel_runs_bf16_verify_rows_within_bf16_of_the_vector_kernel(heads: int, kv_heads: int,
                                                                              dim: int) -> None:
    """On the avx512bf16 tier of a CPU without AMX (and forced as "avx512bf16:dot" on one with it), bf16 queries over a
    bf16 cache of head size 64 get their scores from vdpbf16ps over K transposed 16 keys at a time: runs
    of up to 16 query rows (4 rows of SmolLM2's and Llama's groupings; 1 row of 16 heads a KV head; 11 heads, a
    scores pass of 8 and one of the rest), lengths across 16-key blocks and the 1024-position chunks. The queries
    enter unscaled in bf16, so the bits differ from the AVX-512 kernel's within bf16's error; each row still equals
    itself decoded alone. Other head sizes keep the AVX-512 kernel, to the bit."""
    layout = [list(range(30, 38)), [9], list(range(1018, 1030)), [40, 41, 42], [1], [16, 17]]
    args, dot = _bf16_kernel_near_vector_kernel("avx512bf16:dot", layout, heads, kv_heads, dim)
    q, k, v, kc, vc, slots, table, rows, seq, _ = args
    for i in range(len(rows)):
        one = torch.ops.ember.decode_attention_isa(q[i:i + 1], k[i:i + 1], v[i:i + 1], kc, vc, slots[i:i + 1],
                                                   table, rows[i:i + 1], seq[i:i + 1], 0.17, "avx512bf16:dot")
        assert torch.equal(one, dot[i:i + 1]), f"row {i} of {layout}"
    other = _verify_rows(layout, torch.bfloat16, 32, 8, 128) + (0.17,)
    assert torch.equal(torch.ops.ember.decode_attention_isa(*other, "avx512bf16:dot"),
                       torch.ops.ember.decode_attention_isa(*other, "avx512"))


@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX-BF16: the AMX decode attention kernel cannot run")
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 64), (32, 8, 128), (32, 2, 64)])
def test_amx_kernel_runs_bf16_verify_rows_within_bf16_of_the_vector_kernel(heads: int, kv_heads: int,
                                                                           dim: int) -> None:
    """On the avx512bf16 tier of an AMX CPU, bf16 queries over a bf16 cache take tile products (head sizes 64 and
    128, up to 16 query rows a task: 4 rows of SmolLM2's and Llama's groupings, 1 row of 16 heads a KV head). They
    round the softmax numerators to bf16, so their bits differ from the AVX-512 kernel's, within bf16's error; each
    row still equals itself decoded alone (the verify-row test above runs this tier too)."""
    layout = [list(range(30, 38)), [9], list(range(1018, 1030)), [40, 41, 42]]
    _bf16_kernel_near_vector_kernel("avx512bf16", layout, heads, kv_heads, dim)


@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX-BF16: the AMX decode attention kernel cannot run")
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 128)])
def test_amx_kernel_reads_runs_of_consecutive_slots_straight_from_the_cache(heads: int, kv_heads: int,
                                                                            dim: int) -> None:
    """Where 16 keys sit in consecutive slots (a prompt's, as the pool hands them out) the kernel loads them as one
    tile from the cache; elsewhere it gathers them. A context of runs and scattered slots gives the reference's
    output either way."""
    g = torch.Generator().manual_seed(3)
    lens = [200, 37, 64]
    total = sum(lens) + 64
    kc = torch.randn(total + 1, kv_heads, dim, generator=g).to(torch.bfloat16)
    vc = torch.randn(total + 1, kv_heads, dim, generator=g).to(torch.bfloat16)
    table = torch.zeros(len(lens) + 1, 256, dtype=torch.int32)
    nxt = 1
    for i, n in enumerate(lens):
        slots = list(range(nxt, nxt + n))
        if i == 0:  # the first request's keys 100..119 scattered: a block of 16 that must be gathered
            slots[100:120] = slots[100:120][::-1]
        table[i + 1, :n] = torch.tensor(slots, dtype=torch.int32)
        nxt += n
    rows = torch.arange(1, len(lens) + 1)
    seq = torch.tensor(lens)
    q = torch.randn(len(lens), heads, dim, generator=g).to(torch.bfloat16)
    k = torch.randn(len(lens), kv_heads, dim, generator=g).to(torch.bfloat16)
    v = torch.randn(len(lens), kv_heads, dim, generator=g).to(torch.bfloat16)
    out_slots = table[rows, seq - 1].long()
    got = torch.ops.ember.decode_attention_isa(q, k, v, kc, vc, out_slots, table, rows, seq, 0.17, "avx512bf16")
    want = attention.reference_decode_attention(q, k, v, kc.clone(), vc.clone(), out_slots, table, rows, seq, 0.17)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
