"""Quantized models end to end on tiny random Llamas: a GGUF's own formats (--quantization auto) and int8/int4
quantized at load, against the same weights dequantized (the exact fp32 path, itself tested against transformers
in test_engine_parity / test_loader)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from conftest import MakeTinyModel
from engine.config import EngineConfig
from engine.loader import open_checkpoint
from engine.loader.prepared import PreparedModel
from engine.model_runner import ModelRunner
from engine.quant import gguf_blocks
from engine.quant.module import QuantizedWeight, quantized_weights
from engine_helpers import ManualBatch, assert_greedy_close, random_prompts
from tiny_gguf import write_tiny_gguf

GGUF_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]  # the types this gguf package can write
K_TYPES = [T.Q4_K, T.Q5_K, T.Q6_K]  # random blocks (tiny_gguf.random_k_blocks), on a 256-wide model


def _runner(path: Path, quantization: str, *, compile: bool = False, group: int = 32,
            cache: Path | None = None, buckets: tuple[int, ...] = (1, 2, 4)) -> ModelRunner:
    config = EngineConfig(model=str(path), dtype="float32", quantization=quantization, quant_group_size=group,
                          max_total_tokens=4096, max_running_requests=4, decode_buckets=buckets,
                          disable_compile=not compile, compile_cache_dir=str(cache) if cache else None)
    prepared = PreparedModel(cache, path) if cache else None
    return ModelRunner(config, open_checkpoint(str(path)), prepared=prepared)


def _generate(runner: ModelRunner, prompts: list[list[int]], steps: int = 16) -> tuple[list[list[int]], ManualBatch]:
    batch = ManualBatch(runner, prompts)
    seqs = batch.decode(steps)
    batch.release()
    return seqs, batch


# Activations are int8 below 16 rows (ember::linear_gguf, as llama.cpp's): each value within 2^-8 of its block's
# max, per 32 inputs for the 32-value types and per 256 for the K-quants. Through 2 layers and the head of these
# random models the logits stayed within 0.3 % of their max for the 32-value types (cosine > 0.99999); the K-quants'
# coarser blocks on random weights, whose outputs cancel (an output ~sqrt(K) x smaller than the sum the error
# scales with), drift more: Q6_K up to ~15 % of the max logit within 16 steps. On a real model the same kernels
# score SmolLM2's perplexity within 0.3 % of llama.cpp's (docs/quantization.md).
def min_cosine(qtype: T) -> float:
    return 0.99 if qtype in K_TYPES else 0.9999


@pytest.fixture(scope="module")
def tiny(make_tiny_model: MakeTinyModel) -> Path:
    return make_tiny_model("llama", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def wide(make_tiny_model: MakeTinyModel) -> Path:
    """Every weight's rows a multiple of 256 inputs, as K-quant blocks need."""
    return make_tiny_model("llama", tie_word_embeddings=True, hidden_size=256, intermediate_size=512, head_dim=64)


@pytest.mark.parametrize("qtype", GGUF_TYPES + K_TYPES, ids=lambda t: t.name)
def test_gguf_native_formats_match_their_dequantized_weights(tiny: Path, wide: Path, tmp_path: Path,
                                                             qtype: T) -> None:
    path = write_tiny_gguf(wide if qtype in K_TYPES else tiny, tmp_path / f"{qtype.name}.gguf", qtype=qtype)
    native, exact = _runner(path, "auto"), _runner(path, "none")
    formats = {s for w in quantized_weights(native.model).values() for s in w.sources()}
    assert formats == {qtype.name}, "every linear weight and the tied head stay in the file's format"
    assert not quantized_weights(exact.model)
    prompts = random_prompts([5, 37, 12], vocab=native.model_config.vocab_size, seed=1)
    _, ob = _generate(native, prompts)
    _, rb = _generate(exact, prompts)
    worst = assert_greedy_close([ob.prefill_logits, *ob.step_logits], [rb.prefill_logits, *rb.step_logits],
                                min_cosine(qtype))
    print(f"{qtype.name}: logits within {worst:.2%} of their max")
    assert native.kv_pool.available_size() == native.kv_pool.num_slots


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, *K_TYPES], ids=lambda t: t.name)
def test_gguf_weights_hold_the_files_bytes(wide: Path, tmp_path: Path, qtype: T) -> None:
    """Quantized weights keep the file's blocks: their bytes are the file's tensor bytes plus the zero rows that pad
    each weight's last group (at most 15 or 3: rows are interleaved by 16 or 4), and the whole model within 3 % of
    the file's tensors."""
    path = write_tiny_gguf(wide, tmp_path / f"{qtype.name}.gguf", qtype=qtype)
    runner = _runner(path, "auto")
    tensors = GGUFReader(path).tensors
    quantized_file = sum(int(t.n_bytes) for t in tensors if t.tensor_type == qtype)
    weights = quantized_weights(runner.model).values()
    row_bytes = {int(t.n_bytes) // int(t.shape[1]) for t in tensors if t.tensor_type == qtype}
    held = sum(w.nbytes() for w in weights)
    pad = gguf_blocks.group_rows(int(qtype)) - 1
    assert quantized_file <= held <= quantized_file + pad * max(row_bytes) * sum(len(w.parts) for w in weights)
    assert runner.weight_bytes <= 1.03 * sum(int(t.n_bytes) for t in tensors)
    assert runner.file_bytes == path.stat().st_size


def test_bf16_gguf_is_served_in_bf16(tiny: Path, tmp_path: Path) -> None:
    """A GGUF without quantized weights runs like a bf16 HF folder: --dtype auto is bfloat16 and the linears
    stay 16-bit (no float32 copy of a 16-bit file)."""
    path = write_tiny_gguf(tiny, tmp_path / "bf16.gguf", qtype=T.BF16)
    config = EngineConfig(model=str(path), max_total_tokens=1024, max_running_requests=2, decode_buckets=(1,),
                          disable_compile=True)
    runner = ModelRunner(config, open_checkpoint(str(path)))
    assert runner.config.dtype == "bfloat16" and not quantized_weights(runner.model)
    assert runner.weight_bytes <= 1.03 * sum(int(t.n_bytes) for t in GGUFReader(path).tensors
                                             if t.tensor_type == T.BF16) + sum(
        int(t.n_elements) * 2 for t in GGUFReader(path).tensors if t.tensor_type == T.F32)


def test_batch_mates_do_not_change_a_requests_logits(tiny: Path, tmp_path: Path) -> None:
    """Bit for bit while the batch stays on one kernel path (under 16 rows here; 16+ rows take the fp32 tile path,
    equal within rounding: test_linear_q)."""
    path = write_tiny_gguf(tiny, tmp_path / "q4_1.gguf", qtype=T.Q4_1)
    runner = _runner(path, "auto")
    prompts = random_prompts([5, 7, 3], vocab=runner.model_config.vocab_size, seed=2)
    _, alone = _generate(runner, prompts[:1], steps=4)
    _, together = _generate(runner, prompts, steps=4)
    assert torch.equal(alone.prefill_logits[0], together.prefill_logits[0])
    for a, b in zip(alone.step_logits, together.step_logits):
        assert torch.equal(a[0], b[0])


def test_compiled_decode_equals_eager(tiny: Path, tmp_path: Path) -> None:
    path = write_tiny_gguf(tiny, tmp_path / "q4_0.gguf", qtype=T.Q4_0)
    prompts = random_prompts([6, 20], vocab=200, seed=3)
    eager, eb = _generate(_runner(path, "auto", buckets=(2,)), prompts, steps=8)
    compiled, cb = _generate(_runner(path, "auto", compile=True, buckets=(2,)), prompts, steps=8)
    assert compiled == eager
    for a, b in zip(cb.step_logits, eb.step_logits):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()


@pytest.mark.parametrize("mode, group", [("int8", 32), ("int4", 32)])
def test_hf_checkpoint_quantized_at_load(tiny: Path, mode: str, group: int) -> None:
    quant, dense = _runner(tiny, mode, group=group), _runner(tiny, "none")
    weights = quantized_weights(quant.model)
    layer0 = quant.model.layers[0].qkv_proj
    assert isinstance(layer0, QuantizedWeight) and layer0.sources() == [f"{mode}-g{group}" if mode == "int4" else mode]
    assert weights["embed_tokens"].sources() == ["int8"], "the tied head is int8 in both modes"
    assert sum(w.nbytes() for w in weights.values()) < sum(p.numel() * 4 for p in dense.model.parameters()) / 3
    prompts = random_prompts([7, 25], vocab=quant.model_config.vocab_size, seed=4)
    ours, ob = _generate(quant, prompts)
    ref, rb = _generate(dense, prompts)
    cos = torch.nn.functional.cosine_similarity(ob.prefill_logits, rb.prefill_logits, dim=-1)
    assert cos.min() > (0.999 if mode == "int8" else 0.98)
    if mode == "int8":
        assert ours == ref


def test_int4_group_128_needs_a_multiple_of_128_inputs(tiny: Path) -> None:
    with pytest.raises(ValueError, match="multiple of it"):
        _runner(tiny, "int4", group=128)  # hidden size 64


def test_prepared_copy_keeps_the_quantized_weights(tiny: Path, tmp_path: Path) -> None:
    path = write_tiny_gguf(tiny, tmp_path / "q8_0.gguf", qtype=T.Q8_0)
    first = _runner(path, "auto", cache=tmp_path / "cache")
    second = _runner(path, "auto", cache=tmp_path / "cache")
    entry = next((tmp_path / "cache" / "models").iterdir())
    assert [p.name for p in entry.glob("weights-*")] == ["weights-float32-packed-native.safetensors"]
    w1, w2 = quantized_weights(first.model), quantized_weights(second.model)
    assert w1.keys() == w2.keys() and all(w2[k].sources() == w1[k].sources() for k in w1)
    prompts = random_prompts([11], vocab=first.model_config.vocab_size, seed=5)
    assert torch.equal(ManualBatch(first, prompts).prefill_logits, ManualBatch(second, prompts).prefill_logits)
    _runner(path, "none", cache=tmp_path / "cache")  # another form of the weights: its own file
    assert len(list(entry.glob("weights-*"))) == 2


def test_bad_quantization_settings() -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="quant_group_size must be 32 or 128"):
        EngineConfig(quantization="int4", quant_group_size=64)
