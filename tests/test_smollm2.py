"""The real embedded model, SmolLM2-135M-Instruct from its GGUF, against transformers fp32 (the oracle)."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
NEAR_TIE = 0.01  # DESIGN.md §7: a divergence is acceptable only where the reference's top two logits are this close
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
]


@pytest.fixture(scope="module")
def core(smollm2_hf_fp32) -> EngineCore:
    _, tok, path = smollm2_hf_fp32
    config = EngineConfig(model=str(path), dtype="float32", max_total_tokens=8192, max_running_requests=4,
                          decode_buckets=(1, 2, 4), disable_compile=True)
    return EngineCore(config, tokenizer=tok)


def _chat_ids(tok, question: str) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def test_greedy_matches_transformers_token_for_token(core: EngineCore, smollm2_hf_fp32) -> None:
    hf, tok, _ = smollm2_hf_fp32
    prompts = [_chat_ids(tok, q) for q in QUESTIONS]
    ours = core.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
        ref_ids = ref.sequences[0, len(prompt):].tolist()
        assert len(out) == 32
        if out != ref_ids:
            k = next(i for i, (a, b) in enumerate(zip(out, ref_ids)) if a != b)
            top2 = ref.logits[k][0].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < NEAR_TIE, f"diverged at token {k} where the reference margin is {gap:.4f}"
    assert core.runner.kv_pool.available_size() == core.runner.kv_pool.num_slots


def test_answers_capital_of_france(core: EngineCore, smollm2_hf_fp32) -> None:
    _, tok, _ = smollm2_hf_fp32
    [out] = core.generate([_chat_ids(tok, QUESTIONS[0])], SamplingParams(temperature=0.0, max_tokens=24))
    assert "Paris" in tok.decode(out)
