"""ember::linear_bf16 (engine/ops/csrc/linear_bf16.cpp) against fp32 matmul, and the bf16 model over packed weights."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from engine.loader import open_checkpoint
from engine.model.weights import build_model
from engine.ops import linear as lin
from engine.ops.native import NATIVE_LINEAR
from engine_helpers import ManualBatch, make_runner, random_prompts

needs_kernel = pytest.mark.skipif(not NATIVE_LINEAR, reason="CPU or compiler without AVX512-BF16")


def _bf16(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    got = torch.ops.ember.linear_bf16(x, lin.pack_linear_weight(w), w.shape[0])
    want = x.float() @ w.float().T  # exact products of the bf16 values, fp32 sums
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # One bf16 rounding of the output plus fp32 summation-order noise relative to the terms' magnitude.
    scale = (x.float().abs() @ w.float().abs().T).max()
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=float(scale) * 1e-5)


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 11, 12, 13, 25, 40])
@pytest.mark.parametrize("n,k", [(1, 2), (31, 64), (32, 64), (33, 66), (100, 576), (960, 1538)])
def test_linear_matches_fp32_matmul(m: int, n: int, k: int) -> None:
    # m crosses the 12-row tile and the split-accumulator tiles (<= 3 rows); n crosses the 32-column block;
    # k = 1538 has an odd number of input pairs (the split loop's remainder).
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    _check(_bf16(m, k, g=g), _bf16(n, k, g=g))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 3, 7])
def test_linear_computes_every_block_under_any_thread_count(threads: int) -> None:
    # More threads than cores: owners get preempted mid-range and others take blocks from the back of their
    # ranges. A block that no thread computed would leave its columns as uninitialised memory.
    g = torch.Generator().manual_seed(threads)
    w, x = _bf16(32 * 37 + 5, 128, g=g), _bf16(2, 128, g=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(20):
            _check(x, w)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_linear_takes_batched_and_strided_input() -> None:
    g = torch.Generator().manual_seed(7)
    w = _bf16(70, 96, g=g)
    x = _bf16(3, 5, 192, g=g)[..., ::2]  # [3, 5, 96], not contiguous
    got = torch.ops.ember.linear_bf16(x, lin.pack_linear_weight(w), 70)
    assert got.shape == (3, 5, 70)
    torch.testing.assert_close(got, F.linear(x, w), rtol=2**-7, atol=1e-2)
    assert torch.ops.ember.linear_bf16(x[:0], lin.pack_linear_weight(w), 70).shape == (0, 5, 70)


@needs_kernel
def test_linear_rejects_bad_input() -> None:
    w = lin.pack_linear_weight(torch.zeros(64, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.ember.linear_bf16(torch.zeros(2, 32), w, 64)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.ember.linear_bf16(torch.zeros(2, 30, dtype=torch.bfloat16), w, 64)
    with pytest.raises(RuntimeError, match="blocks"):
        torch.ops.ember.linear_bf16(torch.zeros(2, 32, dtype=torch.bfloat16), w, 65)


def test_pack_roundtrip_and_packed_embedding() -> None:
    g = torch.Generator().manual_seed(3)
    w = _bf16(77, 48, g=g)
    packed = lin.pack_linear_weight(w)
    assert packed.shape == (3, 24, 32, 2) and not packed[2, :, 13:].any()  # 77 = 2 * 32 + 13: zero padding
    assert torch.equal(lin.unpack_linear_weight(packed, 77), w)
    ids = torch.tensor([0, 76, 31, 32, 5, 5])
    assert torch.equal(lin.embedding(ids, packed), F.embedding(ids, w))
    with pytest.raises(ValueError, match="even"):
        lin.pack_linear_weight(torch.zeros(4, 5))


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


@needs_kernel
def test_bf16_compiled_decode_over_packed_weights_equals_eager(make_tiny_model) -> None:
    folder = make_tiny_model("llama", tie_word_embeddings=True)
    prompts = random_prompts([9, 2, 14], 320, seed=1)
    eager_runner = make_runner(folder, compile=False, dtype="bfloat16")
    assert eager_runner.model.packed
    eager = ManualBatch(eager_runner, prompts)
    eager_seqs = eager.decode(8)
    runner = make_runner(folder, compile=True, dtype="bfloat16", buckets=(4,))
    assert not runner.graphs.freeze  # packed weights are shared by the buckets, not folded into each
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = ManualBatch(runner, prompts)
        assert compiled.decode(8) == eager_seqs
    for e, c in zip(eager.step_logits, compiled.step_logits):
        torch.testing.assert_close(c, e, atol=5e-2, rtol=2e-2)
