"""ember::linear_bf16 and ember::linear_f32 (engine/ops/csrc/linear/) against a matmul on every ISA tier this CPU
runs, and the model over packed weights (compiled == eager on each tier)."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from engine.loader import open_checkpoint
from engine.model.weights import build_model
from engine.ops import linear as lin
from engine.ops.native import NATIVE_LINEAR, SUPPORTED_ISAS, forced_isa
from engine_helpers import ManualBatch, make_runner, random_prompts
from isa_tiers import LINEAR

needs_kernel = pytest.mark.skipif(not NATIVE_LINEAR, reason="no ember::linear_bf16 kernel on this CPU's active tier")


def _bf16(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def _check(x: torch.Tensor, w: torch.Tensor, isa: str) -> None:
    got = torch.ops.ember.linear_bf16_isa(x, lin.pack_linear_weight(w), w.shape[0], isa)
    want = x.float() @ w.float().T  # exact products of the bf16 values, fp32 sums
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # One bf16 rounding of the output plus fp32 summation-order noise relative to the terms' magnitude.
    scale = (x.float().abs() @ w.float().abs().T).max()
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=float(scale) * 1e-5)


@pytest.mark.parametrize("isa", LINEAR)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 25, 40])
@pytest.mark.parametrize("n,k", [(1, 2), (31, 64), (32, 64), (33, 66), (100, 576), (960, 1538), (40, 1100)])
def test_linear_matches_fp32_matmul(m: int, n: int, k: int, isa: str) -> None:
    # m crosses every tier's row tiles (3 rows on AVX2, 12 on AVX-512) and the switch from streaming the weights to
    # widening them into a tile (more than 3 / 12 rows); n crosses the 32-column block and the vector width; k = 1538
    # has an odd number of input pairs, k = 1100 crosses the 512-input tile chunks with a partial last chunk.
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    _check(_bf16(m, k, g=g), _bf16(n, k, g=g), isa)


HAS_AMX = bool(NATIVE_LINEAR and torch.ops.ember.isa_has_amx())
BF16_PATHS = [pytest.param("kernel", id="kernel"),
              pytest.param("amx", id="amx", marks=pytest.mark.skipif(
                  not HAS_AMX, reason="this CPU cannot run the amx linear_bf16 path (no AMX-BF16)"))]


@pytest.mark.skipif(not NATIVE_LINEAR or "avx512bf16" not in SUPPORTED_ISAS,
                    reason="this CPU cannot run the avx512bf16 tier (linear_bf16's kernel and amx paths)")
@pytest.mark.parametrize("path", BF16_PATHS)
@pytest.mark.parametrize("m", [1, 5, 16, 17, 40, 100])
@pytest.mark.parametrize("n,k", [(31, 64), (33, 96), (100, 576), (40, 1088)])
def test_linear_bf16_every_path_matches_fp32_matmul(path: str, m: int, n: int, k: int) -> None:
    # Each path forced on the avx512bf16 tier, whatever the row count picks (AMX: K a multiple of 32, 1088 crosses
    # the 512-input chunks; rows not a multiple of 16 are zero-padded tiles).
    g = torch.Generator().manual_seed(m * 31 + n + k)
    x, w = _bf16(m, k, g=g), _bf16(n, k, g=g)
    got = torch.ops.ember.linear_bf16_path(x, lin.pack_linear_weight(w), n, "avx512bf16", path)
    want = x.float() @ w.float().T
    scale = (x.float().abs() @ w.float().abs().T).max()
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=float(scale) * 1e-5)


@pytest.mark.parametrize("isa", LINEAR)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 13, 40])
@pytest.mark.parametrize("n,k", [(1, 2), (31, 64), (33, 67), (100, 576), (960, 1538), (40, 1100)])
def test_linear_f32_matches_float64_matmul(m: int, n: int, k: int, isa: str) -> None:
    # fp32 weights packed [N/32, K, 32] (odd K allowed); rows cross the 3- (AVX2) and 12-row (AVX-512) tiles, k the
    # 512-input chunks.
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    got = torch.ops.ember.linear_f32_isa(x, lin.pack_linear_weight(w), n, isa)
    torch.testing.assert_close(got, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("isa", [p for p in LINEAR if p.id != "avx512bf16"])
def test_linear_row_results_do_not_depend_on_the_batch(isa: str) -> None:
    # The fp32-FMA tiers sum each row in input order whichever path and row tile ran it, so a request decodes to
    # the same values in every batch-size bucket (and in prefill). (The AVX512-BF16 tile splits few-row sums.)
    g = torch.Generator().manual_seed(5)
    w, x = lin.pack_linear_weight(_bf16(96, 640, g=g)), _bf16(40, 640, g=g)
    alone = torch.cat([torch.ops.ember.linear_bf16_isa(x[i : i + 1], w, 96, isa) for i in range(40)])
    for m in (2, 3, 5, 13, 40):
        assert torch.equal(torch.ops.ember.linear_bf16_isa(x[:m], w, 96, isa), alone[:m])
    w32, x32 = lin.pack_linear_weight(torch.randn(96, 640, generator=g)), torch.randn(40, 640, generator=g)
    alone32 = torch.cat([torch.ops.ember.linear_f32_isa(x32[i : i + 1], w32, 96, isa) for i in range(40)])
    for m in (2, 3, 5, 13, 40):
        assert torch.equal(torch.ops.ember.linear_f32_isa(x32[:m], w32, 96, isa), alone32[:m])


@pytest.mark.parametrize("isa", LINEAR)
@pytest.mark.parametrize("threads", [1, 3, 7])
def test_linear_computes_every_block_under_any_thread_count(threads: int, isa: str) -> None:
    # More threads than cores: owners get preempted mid-range and others take blocks from the back of their
    # ranges. A block that no thread computed would leave its columns as uninitialised memory.
    g = torch.Generator().manual_seed(threads)
    w, x = _bf16(32 * 37 + 5, 128, g=g), _bf16(2, 128, g=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (2, 20):  # both the streamed and the tiled path
            for _ in range(10):
                _check(x.repeat(rows // 2, 1), w, isa)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", LINEAR)
def test_linear_takes_batched_and_strided_input(isa: str) -> None:
    g = torch.Generator().manual_seed(7)
    w = _bf16(70, 96, g=g)
    x = _bf16(3, 5, 192, g=g)[..., ::2]  # [3, 5, 96], not contiguous
    got = torch.ops.ember.linear_bf16_isa(x, lin.pack_linear_weight(w), 70, isa)
    assert got.shape == (3, 5, 70)
    torch.testing.assert_close(got, F.linear(x, w), rtol=2**-7, atol=1e-2)
    assert torch.ops.ember.linear_bf16_isa(x[:0], lin.pack_linear_weight(w), 70, isa).shape == (0, 5, 70)


@needs_kernel
def test_linear_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="not a tier"):
        torch.ops.ember.linear_bf16_isa(torch.zeros(1, 2, dtype=torch.bfloat16),
                                        lin.pack_linear_weight(torch.zeros(1, 2, dtype=torch.bfloat16)), 1, "sse9")
    with pytest.raises(RuntimeError, match="no scalar kernel"):
        torch.ops.ember.linear_bf16_isa(torch.zeros(1, 2, dtype=torch.bfloat16),
                                        lin.pack_linear_weight(torch.zeros(1, 2, dtype=torch.bfloat16)), 1, "scalar")
    w = lin.pack_linear_weight(torch.zeros(64, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.ember.linear_bf16(torch.zeros(2, 32), w, 64)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.ember.linear_bf16(torch.zeros(2, 30, dtype=torch.bfloat16), w, 64)
    with pytest.raises(RuntimeError, match="blocks"):
        torch.ops.ember.linear_bf16(torch.zeros(2, 32, dtype=torch.bfloat16), w, 65)
    w32 = lin.pack_linear_weight(torch.zeros(64, 32))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.ember.linear_f32(torch.zeros(2, 32, dtype=torch.bfloat16), w32, 64)
    with pytest.raises(RuntimeError, match=r"packed \[N_pad/32, K, 32\]"):
        torch.ops.ember.linear_f32(torch.zeros(2, 32), w.float(), 64)  # a bf16-layout weight


def test_pack_roundtrip_and_packed_embedding() -> None:
    g = torch.Generator().manual_seed(3)
    w = _bf16(77, 48, g=g)
    packed = lin.pack_linear_weight(w)
    assert packed.shape == (3, 24, 32, 2) and not packed[2, :, 13:].any()  # 77 = 2 * 32 + 13: zero padding
    assert torch.equal(lin.unpack_linear_weight(packed, 77), w)
    ids = torch.tensor([0, 76, 31, 32, 5, 5])
    assert torch.equal(lin.embedding(ids, packed), F.embedding(ids, w))
    with pytest.raises(ValueError, match="even"):
        lin.pack_linear_weight(torch.zeros(4, 5, dtype=torch.bfloat16))
    w32 = torch.randn(77, 45, generator=g)  # fp32: [3, 45, 32], odd K is fine
    packed32 = lin.pack_linear_weight(w32)
    assert packed32.shape == (3, 45, 32) and not packed32[2, :, 13:].any()
    assert torch.equal(lin.unpack_linear_weight(packed32, 77), w32)
    assert torch.equal(lin.embedding(ids, packed32), F.embedding(ids, w32))


@needs_kernel
@pytest.mark.parametrize("tied", [False, True])
def test_bf16_model_packed_equals_plain_weights(make_tiny_model, tied: bool) -> None:
    folder = make_tiny_model("qwen2", tie_word_embeddings=tied)  # qkv bias rides on the packed projection
    ckpt = open_checkpoint(str(folder))
    plain = build_model(ckpt.config, ckpt.tensors(), torch.bfloat16, 256, pack=False)
    packed = build_model(ckpt.config, ckpt.tensors(), torch.bfloat16, 256)
    assert packed.packed and not plain.packed
    head = packed.embed_tokens if tied else packed.lm_head
    assert head is not None and head.dim() == 4
    x = torch.randn(9, ckpt.config.hidden_size).to(torch.bfloat16)
    for a, b in zip(plain.layers[0].parameters(), packed.layers[0].parameters()):
        if b.dim() == 4:
            assert torch.equal(lin.unpack_linear_weight(b, a.shape[0]), a)
    layer_p, layer_q = plain.layers[0], packed.layers[0]
    torch.testing.assert_close(lin.linear(x, layer_q.gate_up_proj, layer_q.inter2), F.linear(x, layer_p.gate_up_proj),
                               rtol=2**-7, atol=2e-2)


@pytest.mark.parametrize("isa", LINEAR)
def test_bf16_compiled_decode_over_packed_weights_equals_eager(make_tiny_model, isa: str) -> None:
    folder = make_tiny_model("llama", tie_word_embeddings=True)
    prompts = random_prompts([9, 2, 14], 320, seed=1)
    with forced_isa(isa):
        eager_runner = make_runner(folder, compile=False, dtype="bfloat16")
        assert eager_runner.model.packed
        eager = ManualBatch(eager_runner, prompts)
        eager_seqs = eager.decode(8)
        torch._dynamo.reset()  # a graph compiled under another tier's test must not be reused
        runner = make_runner(folder, compile=True, dtype="bfloat16", buckets=(4,))
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled = ManualBatch(runner, prompts)
            assert compiled.decode(8) == eager_seqs
    for e, c in zip(eager.step_logits, compiled.step_logits):
        torch.testing.assert_close(c, e, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("isa", LINEAR)
def test_fake_kernel_matches_the_real_one(isa: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.Generator().manual_seed(2)
    for dtype, op in ((torch.bfloat16, torch.ops.ember.linear_bf16), (torch.float32, torch.ops.ember.linear_f32)):
        x = torch.randn(3, 4, 64, generator=g).to(dtype)
        w = lin.pack_linear_weight(torch.randn(45, 64, generator=g).to(dtype))
        with forced_isa(isa):
            real = op(x, w, 45)
        with FakeTensorMode() as mode:
            fake = op(mode.from_tensor(x), mode.from_tensor(w), 45)
        assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())
