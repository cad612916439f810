"""ember::rms_norm, ember::rope and ember::silu_mul (the eager prefill's fused row ops) against the torch expressions
they replace, which a compiled graph keeps."""
from __future__ import annotations

import pytest
import torch

from engine.model import llama, rope
from engine.ops import fused
from engine.ops.native import NATIVE_OPS, forced_isa
from isa_tiers import LINEAR

pytestmark = pytest.mark.skipif(not NATIVE_OPS, reason="the C++ ops are not built (EMBER_NATIVE_OPS=0)")


def _torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((_torch_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (300, 2048), (5, 9, 64)])  # the last: a q/k norm's rows
def test_rms_norm_matches_torch(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    got, want = torch.ops.ember.rms_norm(x, w, 1e-5), _torch_rms_norm(x, w, 1e-5)
    # fp32 differs from torch's mean only in summation order; 16-bit results are one rounding of the same value
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if dtype == torch.bfloat16:
        assert (got != want).float().mean() < 0.01  # nearly all bit-identical: the rounding points are torch's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,dim,rot", [(9, 64, 64), (32, 128, 128), (4, 96, 32)])  # the last: partial rotary
def test_rope_of_a_qkv_view_matches_torch(dtype: torch.dtype, heads: int, dim: int, rot: int) -> None:
    g = torch.Generator().manual_seed(1)
    t = 45
    qkv = torch.randn(t, heads * dim + 2 * dim, generator=g).to(dtype)
    q = qkv[:, : heads * dim].view(t, heads, dim)  # strided, as the model's q is
    cos, sin = (torch.randn(t, rot, generator=g).to(dtype) for _ in range(2))
    got = torch.ops.ember.rope(q, cos, sin)
    assert got.is_contiguous() and got.shape == q.shape
    torch.testing.assert_close(got, _torch_rope(q, cos, sin), atol=1e-5, rtol=1e-5)
    if dtype != torch.float32:  # each product rounded where torch rounds it: the same bits
        assert torch.equal(got, _torch_rope(q, cos, sin))


@pytest.mark.parametrize("isa", [*LINEAR, "scalar"])
@pytest.mark.parametrize("shape", [(37, 576), (3, 2048), (5, 600), (4, 605)])  # 600, 605: tails past the vectors
def test_bf16_rms_norm_on_every_tier(isa: str, shape: tuple[int, int]) -> None:
    """The bf16 row kernel of every tier this CPU runs: torch's rounding points, the sum of squares in the lanes'
    order (so a value may differ from the portable loop's by one rounding, rarely)."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(*shape, generator=g) * 3).to(torch.bfloat16)
    w = torch.randn(shape[-1], generator=g).to(torch.bfloat16)
    with forced_isa(isa):
        got = torch.ops.ember.rms_norm(x, w, 1e-5)
    want = _torch_rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("isa", [*LINEAR, "scalar"])
@pytest.mark.parametrize("heads,dim,rot", [(9, 64, 64), (8, 128, 128), (4, 96, 32), (3, 64, 20)])  # 20: tails
def test_bf16_rope_equals_torch_bit_for_bit_on_every_tier(isa: str, heads: int, dim: int, rot: int) -> None:
    g = torch.Generator().manual_seed(5)
    t = 19
    qkv = torch.randn(t, heads * dim + 2 * dim, generator=g).to(torch.bfloat16)
    qkv[0, :dim] = 0.0  # a zero row: torch's -x makes -0, which must survive the rotation's sign
    q = qkv[:, : heads * dim].view(t, heads, dim)
    cos, sin = (torch.randn(t, rot, generator=g).to(torch.bfloat16) for _ in range(2))
    cos[0, :] = -1.0
    with forced_isa(isa):
        got = torch.ops.ember.rope(q, cos, sin)
    want = _torch_rope(q, cos, sin)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_model_functions_take_the_fused_ops_eagerly_and_torch_under_compile() -> None:
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(16, 64, generator=g), torch.randn(64, generator=g)
    q = torch.randn(16, 4, 64, generator=g)
    cos, sin = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)

    def f(x: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return llama.rms_norm(x, w, 1e-6), rope.apply_rope(q, cos, sin)

    eager = f(x, q)
    assert torch.equal(eager[0], torch.ops.ember.rms_norm(x, w, 1e-6))
    assert torch.equal(eager[1], torch.ops.ember.rope(q, cos, sin))
    compiled = torch.compile(f, fullgraph=True)(x, q)  # no fake kernels needed: the graph holds torch's ops
    torch.testing.assert_close(compiled[0], _torch_rms_norm(x, w, 1e-6), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled[1], _torch_rope(q, cos, sin), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", [*LINEAR, "scalar"])
@pytest.mark.parametrize("tokens,inter", [(1, 1536), (37, 1536), (5, 8200)])  # 8200: a tail past the vectors
def test_silu_mul_equals_torchs_two_bf16_ops_bit_for_bit(isa: str, tokens: int, inter: int) -> None:
    """silu(gate) * up of the fused gate|up output, on every tier this CPU runs: the same bits as torch's silu and
    mul, each rounded to bf16 (the silu values come from a table of torch's own, so inputs whose silu lies near a
    bf16 rounding boundary, as 5.9375's does, round as torch rounds them)."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(tokens, 2 * inter, generator=g) * 4).to(torch.bfloat16)
    x[0, :4] = torch.tensor([5.9375, -0.0, float("inf"), -float("inf")])
    gate, up = x.chunk(2, dim=-1)
    with forced_isa(isa):
        got = fused.silu_mul(x)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)


def test_silu_mul_keeps_the_torch_expression_for_other_dtypes_and_under_compile() -> None:
    x = torch.randn(8, 64)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(fused.silu_mul(x), torch.nn.functional.silu(gate) * up)
    compiled = torch.compile(fused.silu_mul, fullgraph=True)(x.bfloat16())  # no fake kernel: torch's ops in the graph
    torch.testing.assert_close(compiled, fused.silu_mul(x.bfloat16()), atol=1e-2, rtol=1e-2)


def test_bad_shapes_are_errors() -> None:
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.ember.rms_norm(torch.randn(4, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="even rotary_dim"):
        torch.ops.ember.rope(torch.randn(4, 2, 8), torch.randn(4, 10), torch.randn(4, 10))
    with pytest.raises(RuntimeError, match="takes bfloat16"):
        torch.ops.ember.silu_mul(torch.randn(4, 8), fused._silu_table())
