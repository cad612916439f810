"""ember::linear_q, every kernel variant this CPU runs, against dequantize-then-matmul (engine/quant/format.py)."""
from __future__ import annotations

import pytest
import torch

from engine.quant.format import QuantizedTensor, dequantize, pack, pack_nibbles, packed_rows, unpack
from isa_tiers import LINEAR_Q

# Activations are int16 per 32 inputs (linear_q.h): a result is within a few 2^-16 of the block maxima.
REL_TOL = 2e-4

# (bits, group, fp16 scales, mins): the layouts the GGUF types and --quantization produce
LAYOUTS = {
    "q4_1": (4, 32, True, True),          # Q4_0, Q4_1, int4 g32
    "q4_k": (4, 32, False, True),         # Q4_K
    "int4_g128": (4, 128, True, True),
    "q8_0": (8, 32, True, False),         # Q8_0, Q5_0
    "q5_k": (8, 32, False, True),         # Q5_K, Q5_1 (fp16)
    "q6_k": (8, 16, False, False),        # Q6_K
    "int8": (8, 0, False, False),         # per channel: one group of K
}
# (rows M, output rows N, inputs K): odd M and N, N not a multiple of 4 or 32, K from one block up; M >= 16 takes
# the fp32 tile path (linear_q.h kQTileMinRows), K > 512 its several chunks (and a short last one)
SHAPES = [(1, 1, 32), (1, 33, 576), (2, 5, 64), (3, 64, 128), (7, 130, 256), (9, 100, 1536), (15, 31, 384),
          (16, 9, 256), (17, 31, 384), (33, 7, 128), (40, 65, 1088), (70, 3, 1536)]


def _weight(layout: str, n: int, k: int, seed: int) -> QuantizedTensor:
    bits, group, f16, mins = LAYOUTS[layout]
    group = group or k
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float16 if f16 else torch.float32
    if bits == 4:
        q = pack_nibbles(torch.randint(0, 16, (n, k), generator=g))
    else:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(dtype)
    m = (torch.randn(n, k // group, generator=g) * 0.05).to(dtype) if mins else None
    return QuantizedTensor(q, scales, m, layout)


def _run(x: torch.Tensor, t: QuantizedTensor, isa: str) -> torch.Tensor:
    p = pack(t)
    return torch.ops.ember.linear_q_isa(x, p.qweight, p.scales, p.mins, p.n, isa)


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    err = (out.float() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item() + 1e-6, f"max error {err} against max {ref.abs().max().item()}"


@pytest.mark.parametrize("isa", LINEAR_Q)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_dequantize_then_matmul(isa: str, layout: str, shape: tuple[int, int, int]) -> None:
    m, n, k = shape
    if k % (LAYOUTS[layout][1] or k):
        pytest.skip(f"K={k} is not a multiple of the group size {LAYOUTS[layout][1]}")
    t = _weight(layout, n, k, seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    ref = x @ dequantize(t).T
    _close(_run(x, t, isa), ref, REL_TOL)
    # bf16 in, bf16 out: the input's and the output's rounding on top
    _close(_run(x.bfloat16(), t, isa), x.bfloat16().float() @ dequantize(t).T, 1e-2)


@pytest.mark.parametrize("isa", LINEAR_Q)
@pytest.mark.parametrize("layout", ["q4_1", "q8_0", "q6_k"])
def test_a_rows_result_does_not_depend_on_its_batch(isa: str, layout: str) -> None:
    """Every decode bucket (and prefill) must compute a request's logits the same: no dependence on M."""
    t = _weight(layout, 70, 256, seed=1)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(2))
    few, many = _run(x[:15], t, isa), _run(x, t, isa)  # the integer path (< 16 rows) and the tile path
    for rows in (1, 2, 3, 8, 9):
        assert torch.equal(_run(x[:rows], t, isa), few[:rows])
    if isa != "scalar":  # the scalar tier has no tile path
        for rows in (16, 17, 24, 33):
            assert torch.equal(_run(x[:rows], t, isa), many[:rows])


@pytest.mark.parametrize("isa", LINEAR_Q)
def test_variants_agree_with_the_scalar_reference(isa: str) -> None:
    for layout in LAYOUTS:
        t = _weight(layout, 45, 512, seed=3)
        x = torch.randn(5, 512, generator=torch.Generator().manual_seed(4))
        _close(_run(x, t, isa), _run(x, t, "scalar"), 1e-5)


@pytest.mark.parametrize("isa", LINEAR_Q)
def test_the_prefill_tile_path_agrees_with_the_integer_path(isa: str) -> None:
    """A prompt's tokens go through the fp32 tile path (16+ rows), small decode batches through the integer path."""
    for layout in LAYOUTS:
        t = _weight(layout, 37, 1024, seed=9)
        x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(10))
        many = _run(x, t, isa)
        few = torch.cat([_run(x[i:i + 8], t, isa) for i in range(0, 40, 8)])  # 8 rows: the integer path
        _close(many, few, REL_TOL)


def test_extreme_activations_keep_their_precision() -> None:
    """An outlier 1e4 times the rest of its block (LLMs' massive activations) leaves the others accurate: the
    per-block scale is int16, 2^-15 of the block maximum."""
    t = _weight("q8_0", 16, 64, seed=5)
    # A fixed generator: with the global one the data followed the test order, and the error (a random walk of 64
    # rounding errors of up to 2^-16 of the outlier each) sat within a few percent of the bound.
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(11)) * 0.01
    x[0, 3] = 100.0
    ref = x @ dequantize(t).T
    _close(_run(x, t, "scalar"), ref, 1e-4)


def test_pack_round_trip_and_row_gather() -> None:
    for layout in LAYOUTS:
        t = _weight(layout, 13, 128, seed=6)  # 13 rows: the last group of 4 is padded
        p = pack(t)
        assert p.qweight.shape[0] == 4 and p.n == 13
        u = unpack(p, layout)
        assert torch.equal(u.qweight, t.qweight) and torch.equal(u.scales, t.scales)
        ids = torch.tensor([0, 12, 5, 5, 3])
        assert torch.equal(packed_rows(p, ids, torch.float32), dequantize(t)[ids])


def test_fake_kernel_matches_the_real_shape() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    import kernels_fake.linear  # noqa: F401

    t = pack(_weight("q4_1", 10, 64, seed=7))
    x = torch.randn(3, 64).bfloat16()
    real = torch.ops.ember.linear_q(x, t.qweight, t.scales, t.mins, t.n)
    with FakeTensorMode() as mode:
        fake = torch.ops.ember.linear_q(mode.from_tensor(x), mode.from_tensor(t.qweight),
                                        mode.from_tensor(t.scales), mode.from_tensor(t.mins), t.n)
    assert fake.shape == real.shape == (3, 10) and fake.dtype == real.dtype


@pytest.mark.parametrize("bad, match", [
    ("k", "input has 32 features, weight expects 64"),
    ("n", "not a packed weight of 13 rows"),
    ("dtype", "bfloat16 or float32 input"),
    ("mins", "mins must have the shape and dtype of scales"),
])
def test_bad_arguments_are_refused_clearly(bad: str, match: str) -> None:
    t = pack(_weight("q4_1", 10, 64, seed=8))
    x, n, mins = torch.randn(2, 64), t.n, t.mins
    if bad == "k":
        x = torch.randn(2, 32)
    elif bad == "n":
        n = 13  # 10 rows are 3 groups of 4, which hold 9 to 12 rows
    elif bad == "dtype":
        x = x.half()
    elif bad == "mins":
        mins = t.mins.float()
    with pytest.raises(RuntimeError, match=match):
        torch.ops.ember.linear_q(x, t.qweight, t.scales, mins, n)
