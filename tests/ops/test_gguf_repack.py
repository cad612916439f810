"""engine.quant.gguf_repack: GGUF block types -> QuantizedTensor, checked against gguf's own numpy dequantizer.

The oracle is gguf.quants.dequantize on the same bytes; the repacked tensor's fp32 dequantization must equal it
bit for bit (up to the sign of zero), on random blocks (every bit pattern of the quants, sub-scales and qh) and
on gguf-quantized real values.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf import quants as gq

from engine.quant.format import QuantizedTensor, dequantize
from engine.quant.gguf_repack import SUPPORTED_GGUF_TYPES, repack

T = GGMLQuantizationType

# Byte offsets of each type's fp16 fields (d, and m / dmin) inside a block: random bytes there would give NaN/inf.
FP16_FIELDS = {
    T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2),
    T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}
# bits, scales dtype, mins present, group: the table in gguf_repack's docstring.
LAYOUT = {
    T.Q8_0: (8, torch.float16, False, 32),
    T.Q4_0: (4, torch.float16, True, 32),
    T.Q4_1: (4, torch.float16, True, 32),
    T.Q5_0: (8, torch.float16, False, 32),
    T.Q5_1: (8, torch.float16, True, 32),
    T.Q4_K: (4, torch.float32, True, 32),
    T.Q5_K: (8, torch.float32, True, 32),
    T.Q6_K: (8, torch.float32, False, 16),
}
TYPES = sorted(SUPPORTED_GGUF_TYPES, key=lambda t: t.name)
IDS = [t.name for t in TYPES]


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes [n, bytes_per_row] with sane fp16 fields: both signs, magnitudes 2^-20..2^8 (fp16
    subnormals included; |d| < 8192 keeps Q4_0's -8d in fp16)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8)
    blocks = raw.reshape(n, k // block, size)
    for off in FP16_FIELDS[qtype]:
        mag = np.exp2(rng.uniform(-20, 8, (n, k // block)))
        val = (mag * rng.choice([-1.0, 1.0], mag.shape)).astype(np.float16)
        blocks[:, :, off:off + 2] = val.view(np.uint8).reshape(n, k // block, 2)
    return raw


def assert_bit_exact(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype == np.float32
    assert not np.isnan(ref).any()
    # + 0.0 turns -0.0 into +0.0 (gguf's d * 0 keeps d's sign, Ember's d*q + min does not); all else bitwise.
    same = (got + np.float32(0)).view(np.uint32) == (ref + np.float32(0)).view(np.uint32)
    if not same.all():
        i = np.argwhere(~same)[0]
        raise AssertionError(f"{(~same).sum()} values differ, first at {tuple(i)}: {got[tuple(i)]!r} vs "
                             f"{ref[tuple(i)]!r} (max abs diff {np.abs(got - ref).max()})")


def check(raw: np.ndarray, qtype: GGMLQuantizationType, k: int) -> QuantizedTensor:
    q = repack(raw, qtype, k)
    q.validate()
    assert q.shape == (raw.shape[0], k) and q.source == qtype.name
    assert_bit_exact(dequantize(q).numpy(), gq.dequantize(raw, qtype))
    return q


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
@pytest.mark.parametrize("n", [1, 3, 33])
def test_random_blocks_match_gguf(qtype: GGMLQuantizationType, n: int) -> None:
    rng = np.random.default_rng([n, int(qtype)])
    block = GGML_QUANT_SIZES[qtype][0]
    for blocks_per_row in (1, 3, 4):
        check(random_blocks(qtype, n, block * blocks_per_row, rng), qtype, block * blocks_per_row)


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_layout(qtype: GGMLQuantizationType) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    q = repack(random_blocks(qtype, 5, 2 * block, np.random.default_rng(1)), qtype, 2 * block)
    assert q.layout == LAYOUT[qtype]
    assert q.qweight.dtype == (torch.uint8 if LAYOUT[qtype][0] == 4 else torch.int8)
    assert q.qweight.is_contiguous() and q.scales.is_contiguous()


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_gguf_quantized_values(qtype: GGMLQuantizationType) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((7, 4 * block)) * np.exp2(rng.uniform(-8, 2, (7, 1)))).astype(np.float32)
    try:
        raw = gq.quantize(x, qtype)
    except NotImplementedError:
        pytest.skip(f"this gguf cannot quantize to {qtype.name}")
    q = check(raw, qtype, x.shape[1])
    # The bytes really are a quantization of x (not a degenerate all-zero tensor).
    assert np.abs(dequantize(q).numpy() - x).max() <= 0.2 * np.abs(x).max()


def test_q4_0_scale_too_large_for_fp16_min() -> None:
    raw = random_blocks(T.Q4_0, 2, 64, np.random.default_rng(3))
    raw[1, 18:20] = np.array([16384.0], np.float16).view(np.uint8)  # 2nd block of row 1: -8d overflows fp16
    q = check(raw, T.Q4_0, 64)
    assert q.layout == (4, torch.float32, True, 32)


def test_read_only_input_is_copied() -> None:
    """GGUFReader hands out read-only memmaps: no torch warning, and the result never aliases the bytes."""
    for qtype in TYPES:
        block = GGML_QUANT_SIZES[qtype][0]
        raw = random_blocks(qtype, 1, block, np.random.default_rng(4))  # one block: slices are contiguous
        raw.setflags(write=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            q = repack(raw, qtype, block)
        parts = [q.qweight, q.scales] + ([] if q.mins is None else [q.mins])
        assert not any(np.shares_memory(p.numpy(), raw) for p in parts), qtype.name


def test_gguf_file_round_trip(tmp_path: Path) -> None:
    """Tensors written by GGUFWriter and read by GGUFReader: `t.data` and `t.shape[0]` are repack's inputs."""
    rng = np.random.default_rng(5)
    path = tmp_path / "q.gguf"
    writer = GGUFWriter(path, "llama")
    written = {}
    for qtype, n in [(T.Q8_0, 3), (T.Q4_K, 5), (T.Q6_K, 2)]:
        k = 2 * GGML_QUANT_SIZES[qtype][0]
        written[qtype.name] = random_blocks(qtype, n, k, rng)
        writer.add_tensor(f"{qtype.name}.weight", written[qtype.name], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = GGUFReader(path).tensors
    assert len(tensors) == len(written)
    for t in tensors:
        raw = written[t.tensor_type.name]
        assert np.array_equal(t.data, raw)
        q = check(t.data, t.tensor_type, int(t.shape[0]))
        assert q.shape == (raw.shape[0], int(t.shape[0]))


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.F16, T.F32, T.IQ4_NL])
def test_unsupported_type(qtype: GGMLQuantizationType) -> None:
    with pytest.raises(ValueError, match=rf"\b{qtype.name}\b.*supported: Q4_0"):
        repack(np.zeros((2, 64), np.uint8), qtype, 32)


def test_bad_input_shapes() -> None:
    raw = random_blocks(T.Q8_0, 2, 64, np.random.default_rng(6))  # [2, 68]
    with pytest.raises(ValueError, match="bytes per row"):
        repack(raw, T.Q8_0, 96)
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        repack(raw, T.Q8_0, 48)
    with pytest.raises(ValueError, match="multiple of the block size 256"):
        repack(np.zeros((2, 144), np.uint8), T.Q4_K, 128)
    with pytest.raises(ValueError, match=r"uint8 bytes \[rows, bytes_per_row\]"):
        repack(raw.reshape(-1), T.Q8_0, 64)
    with pytest.raises(ValueError, match=r"uint8 bytes \[rows, bytes_per_row\]"):
        repack(raw.view(np.int8), T.Q8_0, 64)
