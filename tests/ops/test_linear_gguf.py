"""ember::linear_gguf (GGUF block bytes, int8 activations) and engine/quant/gguf_blocks.py: every kernel variant this
CPU runs against x @ gguf.quants.dequantize(W) in fp64, SIMD variants against the scalar reference, the layout,
the exact embedding rows, the fakes under torch.compile, and argument checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.ops.native import ACTIVE_ISA, NATIVE_OPS, SUPPORTED_ISAS, forced_isa
from engine.quant import gguf_blocks as gb

pytestmark = pytest.mark.skipif(not NATIVE_OPS, reason="the C++ ops are not built")

TYPES = sorted(gb.GGUF_TYPES)
NAMES = [gb.GGUF_TYPES[t][0] for t in TYPES]
K_QUANTS = {12, 13, 14}
# Byte offsets of each type's fp16 fields (d, and m / dmin): random bytes there would give NaN/inf.
FP16_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}
ROWS = [1, 2, 3, 5, 8, 15, 16, 33, 100]


def _variants() -> list:
    """One pytest.param per kernel variant, run through the plainest tier that selects it; a variant no tier of
    this CPU reaches is a skip naming it."""
    reach: dict[str, str] = {}
    if NATIVE_OPS:
        for tier in reversed(SUPPORTED_ISAS):
            reach.setdefault(str(torch.ops.ember.linear_gguf_variant(tier)), tier)
    return [pytest.param(reach[v], id=v) if v in reach else
            pytest.param("", id=v, marks=pytest.mark.skip(reason=f"this CPU cannot run the {v} linear_gguf kernel"))
            for v in ("avx512vnni", "avx2", "scalar")]


VARIANTS = _variants()
HAS_AMX = bool(NATIVE_OPS and torch.ops.ember.isa_has_amx())
HAS_AMX8 = bool(NATIVE_OPS and torch.ops.ember.isa_has_amx_int8())
NO_AMX8 = "this CPU cannot run the amx8 linear_gguf path (no AMX-INT8)"
X16 = [t for t in TYPES if gb.group_rows(t) == 16]
AMX8 = [t for t in X16 if gb.GGUF_TYPES[t][0] != "Q6_K"]  # the amx8 path's types: the 16-row layout's but Q6_K


def _paths() -> list:
    """(tier, path) for every forced path: int8 and tile on each SIMD variant, wide on avx2 (K-quants), amx and amx8
    on the avx512bf16 tier."""
    out = [pytest.param(v.values[0], p, id=f"{v.id}-{p}", marks=v.marks) for v in VARIANTS if v.id != "scalar"
           for p in ("int8", "tile") + (("wide",) if v.id == "avx2" else ())]
    out.append(pytest.param("avx512bf16", "amx", id="amx", marks=() if HAS_AMX else pytest.mark.skip(
        reason="this CPU cannot run the amx linear_gguf path (no AMX-BF16)")))
    out.append(pytest.param("avx512bf16", "amx8", id="amx8",
                            marks=() if HAS_AMX8 else pytest.mark.skip(reason=NO_AMX8)))
    return out


def _auto(qtype: int, rows: int, isa: str) -> str:
    return str(torch.ops.ember.linear_gguf_auto_path(qtype, rows, isa))


def random_rows(qtype: int, n: int, k: int, seed: int, fill: int | None = None) -> torch.Tensor:
    """GGUF rows [n, row_bytes]: random code bytes (or all `fill`), fp16 fields of both signs, 2^-8..2^-4."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    raw = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8) if fill is None else \
        np.full((n, k // block * size), fill, dtype=np.uint8)
    blocks = raw.reshape(n, k // block, size)
    for off in FP16_FIELDS[qtype]:
        mag = np.exp2(rng.uniform(-8, -4, (n, k // block)))
        val = (mag * rng.choice([-1.0, 1.0], mag.shape)).astype(np.float16)
        blocks[:, :, off:off + 2] = val.view(np.uint8).reshape(n, k // block, 2)
    return torch.from_numpy(raw)


def int8_error_bound(x: torch.Tensor, w: torch.Tensor, qtype: int) -> torch.Tensor:
    """Per output, the most int8 activations can move it: each x value is off by at most half a step, d / 2 =
    max|x over its block| / 254, so |err| <= sum_i |w_i| * blockmax_i / 254 (blocks of 32, K-quants 256)."""
    block = 256 if qtype in K_QUANTS else 32
    amax = x.abs().reshape(x.shape[0], -1, block).amax(-1).repeat_interleave(block, -1)
    return amax @ w.abs().T / 254


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, qtype: int, int8: bool, bf16: bool = False) -> None:
    """int8: activations quantized (error bound above); bf16: activations and dequantized weights each rounded to
    bf16 (the AMX path: each product off by at most 2 * 2^-9 of |x w|)."""
    xd, wd = x.double(), w.double()
    ref = xd @ wd.T
    scale = (xd.abs() @ wd.abs().T).max().item()  # what fp32 rounding is relative to
    tol = 1e-5 * scale + (int8_error_bound(xd, wd, qtype) if int8 else 0.0)
    if bf16:
        tol = tol + (xd.abs() @ wd.abs().T) * 2.0 ** -8 * 1.01
    if out.dtype == torch.bfloat16:
        tol = tol + ref.abs() * 2.0 ** -8
    err = (out.double() - ref).abs()
    assert (err <= tol).all(), f"max error {err.max().item():.3g}, max allowed there {(tol - err).min().item():.3g}"


def _packed(qtype: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raw = random_rows(qtype, n, k, seed)
    return raw, gb.interleave(raw, qtype), gb.dequantize(raw, qtype, k)


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
@pytest.mark.parametrize("rows", ROWS)
def test_matches_gguf_dequantize_then_matmul(isa: str, qtype: int, rows: int) -> None:
    n, k = 37, 768  # N not a multiple of 4 (a padded group) nor 32; K = 3 super-blocks
    _, packed, w = _packed(qtype, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    path = _auto(qtype, rows, isa)  # many rows: the fp32 tile path on exact weights (or amx)
    int8, bf16 = path in ("int8", "wide", "amx8"), path == "amx"
    check(torch.ops.ember.linear_gguf_isa(x, packed, qtype, n, isa), x, w, qtype, int8, bf16)
    xb = x.bfloat16()
    out = torch.ops.ember.linear_gguf_isa(xb, packed, qtype, n, isa)
    assert out.dtype == torch.bfloat16
    check(out, xb.float(), w, qtype, int8, bf16)


@pytest.mark.parametrize("isa, path", _paths())
@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 100])
def test_every_path_matches_gguf_dequantize_then_matmul(isa: str, path: str, qtype: int, rows: int) -> None:
    """Each path forced at every row count, whatever the thresholds pick; K = 1280 crosses the 512-value chunks."""
    n, k = 37, 1280
    _, packed, w = _packed(qtype, n, k, seed=rows + 50)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    if path == "wide" and (qtype not in K_QUANTS or gb.group_rows(qtype) != 4):  # the 4-row K-quants' only
        with pytest.raises(RuntimeError, match="no wide path"):
            torch.ops.ember.linear_gguf_path(x, packed, qtype, n, isa, path)
        return
    if path == "amx8" and qtype not in AMX8:
        with pytest.raises(RuntimeError, match="amx8 path needs"):
            torch.ops.ember.linear_gguf_path(x, packed, qtype, n, isa, path)
        return
    for xx in (x, x.bfloat16()):
        out = torch.ops.ember.linear_gguf_path(xx, packed, qtype, n, isa, path)
        assert out.dtype == xx.dtype and out.shape == (rows, n)
        check(out, xx.float(), w, qtype, path in ("int8", "wide", "amx8"), path == "amx")


@pytest.mark.skipif(not HAS_AMX8, reason=NO_AMX8)
@pytest.mark.parametrize("qtype", AMX8, ids=[gb.GGUF_TYPES[t][0] for t in AMX8])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32, 45])
def test_amx8_is_the_int8_path_bit_for_bit(qtype: int, rows: int) -> None:
    """The AMX-INT8 tiles make the int8 path's exact integer dots and the same float epilogue: equal outputs, so a
    decode batch's size never changes a row's result where the path switches."""
    n, k = 45, 1536  # a padded last group; 6 K-quant blocks, 48 32-value blocks (a partial batch of 4)
    _, packed, _ = _packed(qtype, n, k, seed=rows + 7)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    for xx in (x, x.bfloat16()):
        int8 = torch.ops.ember.linear_gguf_path(xx, packed, qtype, n, "avx512bf16", "int8")
        amx8 = torch.ops.ember.linear_gguf_path(xx, packed, qtype, n, "avx512bf16", "amx8")
        assert torch.equal(int8, amx8), (int8.double() - amx8.double()).abs().max().item()


@pytest.mark.skipif(not HAS_AMX, reason="this CPU cannot run the amx linear_gguf path (no AMX-BF16)")
@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_amx_weights_are_gguf_values_rounded_to_bf16(qtype: int) -> None:
    """The AMX path multiplies bf16 activations by each weight as gguf dequantizes it, rounded to nearest even bf16
    (the 16-row types convert their groups straight to AMX's layout): against that product in float64 only the fp32
    sums' rounding is left, far below one bf16 step of any weight."""
    n, k, rows = 37, 1280, 20
    _, packed, w = _packed(qtype, n, k, seed=7)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)).bfloat16().float()  # fp32 out
    out = torch.ops.ember.linear_gguf_path(x, packed, qtype, n, "avx512bf16", "amx")
    wb = w.bfloat16().double()
    ref = x.double() @ wb.T
    mag = x.double().abs() @ wb.abs().T
    err = (out.double() - ref).abs()
    assert (err <= mag * 2.0 ** -20).all(), f"max error {(err / mag).max().item():.3g} of |x| |w|"


def test_auto_paths_follow_the_thresholds() -> None:
    """Few rows take integer dots, then the wide integer path (K-quants on AVX2), then the tile path (or on
    avx512bf16 with AMX: AMX-INT8 tiles for the 16-row types, then bf16 AMX), never back."""
    order = {"int8": 0, "wide": 1, "tile": 2, "amx8": 3, "amx": 4}
    for tier in SUPPORTED_ISAS:
        for qtype in TYPES:
            seq = [order[_auto(qtype, r, tier)] for r in range(1, 200)]
            assert seq == sorted(seq) and seq[0] == 0, (tier, qtype)
            if tier == "avx512bf16" and HAS_AMX:
                assert seq[-1] == 4 or (HAS_AMX8 and qtype in AMX8 and seq[-1] == 3), (qtype, seq[-1])
                if HAS_AMX8 and qtype in AMX8:  # the tiles take the 16-row types' decode batches
                    assert _auto(qtype, 16, tier) == "amx8"
            if str(torch.ops.ember.linear_gguf_variant(tier)) == "avx2" and qtype in K_QUANTS and \
                    gb.group_rows(qtype) == 4:  # (a 16-row Q4_K has no wide path: its int8 path has the rows in lanes)
                assert _auto(qtype, 63, tier) == "int8" and _auto(qtype, 64, tier) == "wide", (tier, qtype)
            if tier == "scalar":
                assert set(seq) == {0}
    with pytest.raises(RuntimeError, match="path must be"):
        _, packed, _ = _packed(12, 10, 512, seed=9)
        torch.ops.ember.linear_gguf_path(torch.randn(2, 512), packed, 12, 10, "avx2", "fast")


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
@pytest.mark.parametrize("n, k", [(1, 256), (5, 512), (64, 2048), (6, 32 * 11)])
def test_shapes(isa: str, qtype: int, n: int, k: int) -> None:
    if qtype in K_QUANTS and k % 256:
        pytest.skip("K-quants need K to be a multiple of 256")
    _, packed, w = _packed(qtype, n, k, seed=n + k)
    x = torch.randn(3, 2, k, generator=torch.Generator().manual_seed(k))  # leading dims kept
    out = torch.ops.ember.linear_gguf_isa(x, packed, qtype, n, isa)
    assert out.shape == (3, 2, n)
    check(out.reshape(6, n), x.reshape(6, k), w, qtype, True)


@pytest.mark.parametrize("isa", [v for v in VARIANTS if v.id != "scalar"])
@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_simd_variants_match_the_scalar_reference(isa: str, qtype: int) -> None:
    """Same int8 activations, same integer dots: only fp32 summation order differs."""
    _, packed, w = _packed(qtype, 45, 1024, seed=3)
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 15):
        x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows))
        got = torch.ops.ember.linear_gguf_isa(x, packed, qtype, 45, isa).double()
        ref = torch.ops.ember.linear_gguf_isa(x, packed, qtype, 45, "scalar").double()
        scale = (x.abs().double() @ w.abs().double().T).max().item()
        assert (got - ref).abs().max().item() <= 2e-6 * scale


def _identity_q8_0(k: int) -> torch.Tensor:
    """Q8_0 rows of the k x k identity (d = 1, code 1 on the diagonal): y = the activations as the kernel quantized
    them, d_x q exactly (one nonzero product a row)."""
    raw = np.zeros((k, k // 32, 34), dtype=np.uint8)
    raw[:, :, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    i = np.arange(k)
    raw[i, i // 32, 2 + i % 32] = 1
    return gb.interleave(torch.from_numpy(raw.reshape(k, -1)), 8)


def test_every_tier_quantizes_activations_to_the_same_values() -> None:
    """The AVX-512 tiers' quantizer and the portable one give the same int8 codes and block scales, split over the
    threads or not (100 rows of 512 values are), from fp32 and from bf16 input, ties and zero blocks included;
    and those are round(x / d) with d = max|x| / 127, within one code of an fp64 reference."""
    k = 512
    packed = _identity_q8_0(k)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(100, k, generator=g) * torch.logspace(-3, 3, 100).unsqueeze(1)
    x[3] = 0.0  # a zero block: d = 0
    x[4, :32] = torch.arange(32) - 15.5  # d = 15.5 / 127: many values land on halves of a code
    got = {}
    for tier in SUPPORTED_ISAS:
        with forced_isa(tier):
            for dtype in (torch.float32, torch.bfloat16):
                got[tier, dtype] = torch.ops.ember.linear_gguf_f32(x.to(dtype), packed, 8, k)
    for (tier, dtype), y in got.items():
        want = got[SUPPORTED_ISAS[-1], dtype]
        assert torch.equal(y, want), f"{tier} {dtype}: {(y - want).abs().max().item()}"
    ref = got[SUPPORTED_ISAS[-1], torch.float32]
    blocks = x.double().reshape(100, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1)), 0)
    assert ((ref.double().reshape(100, k // 32, 32) - codes * d).abs() <= d * 1.0001).all()
    assert (ref[3] == 0).all()


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_extreme_codes_do_not_overflow(isa: str, qtype: int) -> None:
    """All code bytes 0xFF (Q8_0: -1 ... and 0x80: -128), activations at +-127: vpmaddubsw's int16 saturation
    and the int32 sums must hold (Q6_K: codes 63, scales -1 / -128)."""
    k = 512
    for fill in (0xFF, 0x80, 0x7F):
        raw = random_rows(qtype, 8, k, seed=fill, fill=fill)
        packed, w = gb.interleave(raw, qtype), gb.dequantize(raw, qtype, k)
        x = torch.ones(2, k)
        x[1, 1::2] = -1.0
        check(torch.ops.ember.linear_gguf_isa(x, packed, qtype, 8, isa), x, w, qtype, True)


@pytest.mark.parametrize("isa", VARIANTS)
def test_a_rows_result_does_not_depend_on_its_batch(isa: str) -> None:
    """Within one path (the thresholds differ per variant and type), a row computes the same at any batch size."""
    for qtype in (2, 8, 12, 14):
        _, packed, _ = _packed(qtype, 70, 512, seed=1)
        x = torch.randn(100, 512, generator=torch.Generator().manual_seed(2))
        wide = ("wide",) if str(torch.ops.ember.linear_gguf_variant(isa)) == "avx2" and qtype in K_QUANTS and \
            gb.group_rows(qtype) == 4 else ()
        for path in ("int8", "tile") + wide if isa != "scalar" else ("int8",):
            ref = torch.ops.ember.linear_gguf_path(x, packed, qtype, 70, isa, path)
            for r in (1, 2, 3, 8, 9, 15, 16, 17, 33, 64):
                assert torch.equal(torch.ops.ember.linear_gguf_path(x[:r], packed, qtype, 70, isa, path), ref[:r])


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_interleave_is_a_byte_permutation(qtype: int) -> None:
    n = 37  # 3 groups of 16 (11 zero rows) or 10 of 4 (3 zero rows)
    raw = random_rows(qtype, n, 512, seed=4)
    packed = gb.interleave(raw, qtype)
    g = gb.group_rows(qtype)
    assert g == (16 if gb.GGUF_TYPES[qtype][0] in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K") else 4)
    pad = -n % g
    assert packed.shape == (-(-n // g), g * raw.shape[1]) and packed.dtype == torch.uint8
    assert packed.numel() - raw.numel() == pad * raw.shape[1]  # the file's bytes + the zero rows
    assert torch.equal(gb.deinterleave(packed, qtype, n), raw)
    _, _, size = gb.GGUF_TYPES[qtype]
    b, r = 1, 2  # block b of row g + r (group 1)
    blk = packed[1, g * b * size:g * (b + 1) * size]
    if g == 4:  # whole, at (4 b + r) * size of the group
        assert torch.equal(blk[r * size:(r + 1) * size], raw[4 + r, b * size:(b + 1) * size])
    else:  # the 16 rows' fp16 fields first, field by field, then the rest 4 bytes a row, chunk by chunk
        src = raw[16 + r, b * size:(b + 1) * size]
        if gb.GGUF_TYPES[qtype][0] == "Q6_K":  # d last in its blocks; scales, then each half's ql and qh bytes
            src = torch.cat([src[208:], src[192:208], src[0:64], src[128:160], src[64:128], src[160:192]])
        head = 4 if gb.GGUF_TYPES[qtype][0] in ("Q4_1", "Q4_K") else 2
        for f in range(head // 2):
            assert torch.equal(blk[32 * f + 2 * r:32 * f + 2 * r + 2], src[2 * f:2 * f + 2])
        for c in range((size - head) // 4):
            at = 16 * head + 64 * c + 4 * r
            assert torch.equal(blk[at:at + 4], src[head + 4 * c:head + 4 * c + 4])
    assert torch.equal(torch.sort(packed.flatten()).values[pad * raw.shape[1]:], torch.sort(raw.flatten()).values)


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_gguf_rows_are_gguf_dequantize_exactly(qtype: int, monkeypatch: pytest.MonkeyPatch) -> None:
    raw, packed, w = _packed(qtype, 13, 512, seed=5)
    ids = torch.tensor([[0, 12], [5, 5]])
    got = gb.rows(packed, ids, qtype, 13, torch.float32)
    assert got.shape == (2, 2, 512) and torch.equal(got, w[ids])
    assert torch.equal(gb.rows(packed, ids, qtype, 13, torch.bfloat16), w[ids].bfloat16())
    monkeypatch.setattr(gb, "NATIVE_OPS", False)  # the fallbacks: same rows, and x @ W^T on the oracle
    assert torch.equal(gb.rows(packed, ids, qtype, 13, torch.float32), w[ids])
    x = torch.randn(2, 512)
    torch.testing.assert_close(gb.linear(x, packed, qtype, 13), x @ w.T)


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
@pytest.mark.parametrize("rows", [1, 5, 13, 24, 40])  # the int8, amx8 and amx paths where this CPU has them
def test_f32_output_is_the_same_sums_unrounded(qtype: int, rows: int) -> None:
    """linear_gguf_f32 (the output head's logits) writes the fp32 sums linear_gguf rounds to a bf16 input's dtype:
    rounding it to bf16 gives linear_gguf's bits, and for an fp32 input both are the same tensor."""
    n, k = 45, 512
    _, packed, w = _packed(qtype, n, k, seed=rows + 11)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    for xx in (x, x.bfloat16()):
        full = torch.ops.ember.linear_gguf_f32(xx, packed, qtype, n)
        assert full.dtype == torch.float32 and full.shape == (rows, n)
        assert torch.equal(full.to(xx.dtype), torch.ops.ember.linear_gguf(xx, packed, qtype, n))
    path = _auto(qtype, rows, ACTIVE_ISA)
    check(torch.ops.ember.linear_gguf_f32(x.bfloat16(), packed, qtype, n), x.bfloat16().float(), w, qtype,
          int8=path in ("int8", "amx8", "wide"), bf16=path == "amx")


def test_fake_kernels_match_the_real_ones() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    import kernels_fake  # noqa: F401

    _, packed, _ = _packed(12, 10, 512, seed=7)
    x, ids = torch.randn(3, 512).bfloat16(), torch.tensor([1, 9])
    real = torch.ops.ember.linear_gguf(x, packed, 12, 10)
    real_rows = torch.ops.ember.gguf_rows(packed, ids, 12, 10, torch.bfloat16)
    with FakeTensorMode() as mode:
        fx, fp, fi = mode.from_tensor(x), mode.from_tensor(packed), mode.from_tensor(ids)
        fake = torch.ops.ember.linear_gguf(fx, fp, 12, 10)
        fake_isa = torch.ops.ember.linear_gguf_isa(fx, fp, 12, 10, "scalar")
        fake_f32 = torch.ops.ember.linear_gguf_f32(fx, fp, 12, 10)
        fake_rows = torch.ops.ember.gguf_rows(fp, fi, 12, 10, torch.bfloat16)
    assert fake.shape == fake_isa.shape == real.shape == (3, 10) and fake.dtype == real.dtype
    real_f32 = torch.ops.ember.linear_gguf_f32(x, packed, 12, 10)
    assert fake_f32.shape == real_f32.shape == (3, 10) and fake_f32.dtype == real_f32.dtype == torch.float32
    assert fake_rows.shape == real_rows.shape == (2, 512) and fake_rows.dtype == real_rows.dtype


def test_torch_compile_fullgraph_equals_eager() -> None:
    import kernels_fake  # noqa: F401

    _, packed, _ = _packed(14, 40, 512, seed=8)

    def f(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = torch.ops.ember.gguf_rows(packed, ids, 14, 40, torch.float32) + x
        return torch.ops.ember.linear_gguf(torch.relu(h), packed, 14, 40)

    x, ids = torch.randn(2, 512), torch.tensor([3, 39])
    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(x, ids), f(x, ids))


@pytest.mark.parametrize("bad, match", [
    ("qtype", "unsupported ggml type 1"),
    ("k", "input has 256 features, weight expects 512"),
    ("n", "not an interleaved weight of 13 rows"),
    ("dtype", "bfloat16 or float32 input"),
    ("packed_dtype", "contiguous uint8"),
    ("bytes", "not 4 rows of whole 176-byte blocks"),
])
def test_bad_arguments_are_refused_clearly(bad: str, match: str) -> None:
    _, packed, _ = _packed(13, 10, 512, seed=9)  # Q5_K: 4-row groups, so 13 rows cannot be 3 groups' worth
    x, qtype, n = torch.randn(2, 512), 13, 10
    if bad == "qtype":
        qtype = 1
    elif bad == "k":
        x = torch.randn(2, 256)
    elif bad == "n":
        n = 13
    elif bad == "dtype":
        x = x.half()
    elif bad == "packed_dtype":
        packed = packed.view(torch.int8)
    elif bad == "bytes":
        packed = packed[:, :-4].contiguous()
    with pytest.raises(RuntimeError, match=match):
        torch.ops.ember.linear_gguf(x, packed, qtype, n)
    with pytest.raises(ValueError, match="unsupported ggml type 1"):
        gb.interleave(torch.zeros(4, 36, dtype=torch.uint8), 1)
