"""The real embedded model, SmolLM2-135M-Instruct from its GGUF, against transformers fp32 (the oracle)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.forward_batch import ForwardBatch, PrefillChunk
from engine.quant.module import quantized_weights
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
NEAR_TIE = 0.01  # docs/design.md §7: a divergence is accepted only where the reference's top two logits are this close
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
]


@pytest.fixture(scope="module")
def core(smollm2_hf_fp32) -> EngineCore:
    _, tok, path = smollm2_hf_fp32
    # --quantization none --dtype float32: the exact-parity path (the Q4_1 weights dequantized once at load)
    config = EngineConfig(model=str(path), dtype="float32", quantization="none", max_total_tokens=8192,
                          max_running_requests=4, decode_buckets=(1, 2, 4), disable_compile=True)
    return EngineCore(config, tokenizer=tok)


@pytest.fixture(scope="module", params=["auto", "float32"])
def native_core(smollm2_hf_fp32, request: pytest.FixtureRequest) -> EngineCore:
    """The default serving path: the GGUF's own Q4_1 (and Q8_0 head) on ember::linear_gguf, with bf16 activations
    (--dtype auto: bf16), and with fp32 ones."""
    _, tok, path = smollm2_hf_fp32
    config = EngineConfig(model=str(path), dtype=request.param, max_total_tokens=8192, max_running_requests=4,
                          decode_buckets=(1, 2, 4), disable_compile=True)
    return EngineCore(config, tokenizer=tok)


def _chat_ids(tok, question: str) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def _hf_greedy(hf, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Plain greedy decoding with transformers' KV cache and no EOS handling (generate's min_new_tokens would
    mask EOS, which Ember with ignore_eos does not)."""
    ids, logits = [], []
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(steps):
            logits.append(out.logits[0, -1])
            ids.append(int(logits[-1].argmax()))
            out = hf(torch.tensor([[ids[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return ids, logits


def test_greedy_matches_transformers_token_for_token(core: EngineCore, smollm2_hf_fp32) -> None:
    hf, tok, _ = smollm2_hf_fp32
    prompts = [_chat_ids(tok, q) for q in QUESTIONS]
    ours = core.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, ours):
        ref_ids, ref_logits = _hf_greedy(hf, prompt, 32)
        assert len(out) == 32
        if out != ref_ids:
            k = next(i for i, (a, b) in enumerate(zip(out, ref_ids)) if a != b)
            top2 = ref_logits[k].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < NEAR_TIE, f"diverged at token {k} where the reference margin is {gap:.4f}"
    assert core.scheduler.kvm.held_slots() == 0


def test_answers_capital_of_france(core: EngineCore, smollm2_hf_fp32) -> None:
    _, tok, _ = smollm2_hf_fp32
    [out] = core.generate([_chat_ids(tok, QUESTIONS[0])], SamplingParams(temperature=0.0, max_tokens=24))
    assert "Paris" in tok.decode(out)


def agreeing_prefix(ours: list[int], ref: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))


def test_native_q4_1_against_transformers_fp32(native_core: EngineCore, smollm2_hf_fp32) -> None:
    """Quality of the served default, greedy: how many of the first 32 tokens agree with transformers fp32 on the
    same (dequantized) weights, printed. Not asserted token for token: the decode linears quantize activations to
    int8 (as llama.cpp does) and near-ties tip within a few tokens (the France answer's first token is a
    0.08-logit tie: [0, 12, 9, 0] of 32 agreed in fp32 on the AMX Xeon); test_decode_path_perplexity judges
    the quality by perplexity instead."""
    hf, tok, _ = smollm2_hf_fp32
    assert quantized_weights(native_core.runner.model), "the default model is served in its own Q4_1 format"
    prompts = [_chat_ids(tok, q) for q in QUESTIONS]
    ours = native_core.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    agree = [agreeing_prefix(out, _hf_greedy(hf, p, 32)[0]) for p, out in zip(prompts, ours)]
    print(f"{native_core.runner.config.dtype}: agreeing prefix of 32 tokens per prompt: {agree}")
    assert all(len(out) == 32 for out in ours) and sum(agree) >= 8, agree


def test_logits_are_the_heads_fp32_sums(native_core: EngineCore, smollm2_hf_fp32) -> None:
    """The output head (the GGUF's Q8_0 token table) writes fp32 logits from its sums (ember::linear_gguf_f32), with
    bf16 activations too: most carry more than bf16's 8 bits, so a client's logprobs are not stepped by 2^-8 of a
    logit, and a near-tie is not made a tie by rounding."""
    _, tok, _ = smollm2_hf_fp32
    runner = native_core.runner
    prompt = _chat_ids(tok, QUESTIONS[0])
    row, slots = runner.req_pool.allocate(), runner.kv_pool.allocate(len(prompt))
    assert row is not None and slots is not None
    try:
        logits = runner.forward(ForwardBatch.prefill([PrefillChunk(row, 0, prompt, slots)]))
    finally:
        runner.kv_pool.free(slots)
        runner.req_pool.free(row)
    assert logits.dtype == torch.float32 and logits.shape == (1, runner.model_config.vocab_size)
    assert (logits != logits.bfloat16().float()).float().mean() > 0.9


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_path_perplexity(smollm2_hf_fp32, dtype: str) -> None:
    """The default model's perplexity on two 512-token chunks of scripts/data/gpl-3.txt, scored in calls of 8
    rows (the decode steps' kernel path: int8 activations in ember::linear_gguf), within 2 % of the exact path
    (--quantization none, fp32: the Q4_1 weights dequantized, no activation quantization). Measured: 17.73 exact,
    17.91 / 17.90 native fp32 / bf16 (+1.0 %; on all 14 chunks Ember's 18.32 is below llama-perplexity's 18.35 on
    this file, which quantizes activations the same way)."""
    _, _, path = smollm2_hf_fp32
    spec = importlib.util.spec_from_file_location("perplexity", REPO / "scripts" / "perplexity.py")
    ppl_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ppl_script)  # type: ignore[union-attr]
    text = ppl_script.TEXT.read_text()
    ids = ppl_script.token_ids(path, text, None)[: 2 * 512]
    exact, _, _ = ppl_script.perplexity(path, ids, "none", "float32", 512)
    native, _, weights = ppl_script.perplexity(path, ids, "auto", dtype, 512, rows_per_call=8)
    print(f"exact {exact:.4f}, native {dtype} in 8-row calls {native:.4f} ({weights})")
    assert "linear_gguf" in weights
    assert abs(native / exact - 1) < 0.02, (native, exact)
