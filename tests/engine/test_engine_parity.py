"""Engine core against transformers eager fp32 on tiny random models of every supported architecture."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

from engine_helpers import ManualBatch, hf_model, make_runner, random_prompts

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]
LENGTHS = [7, 19, 3, 12]  # 4 requests of different prompt lengths
DECODE_STEPS = 16


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_match_transformers(make_tiny_model, arch: str) -> None:
    folder = make_tiny_model(arch)
    hf = hf_model(folder)
    runner = make_runner(folder, compile=False)
    batch = ManualBatch(runner, random_prompts(LENGTHS, hf.config.vocab_size))
    seqs = batch.decode(DECODE_STEPS)
    with torch.no_grad():
        for i, seq in enumerate(seqs):
            ref = hf(torch.tensor([seq])).logits[0]  # [len, V]: logits after every prefix
            n = LENGTHS[i]
            torch.testing.assert_close(batch.prefill_logits[i], ref[n - 1], atol=2e-5, rtol=1e-5)
            for step, logits in enumerate(batch.step_logits):
                torch.testing.assert_close(logits[i], ref[n + step], atol=2e-5, rtol=1e-5)
            # greedy continuation equals transformers' greedy continuation
            assert seq[n:] == [int(ref[n - 1 + k].argmax()) for k in range(DECODE_STEPS + 1)]


def test_tied_embeddings_and_sharded_checkpoint(make_tiny_model) -> None:
    folder = make_tiny_model("llama", tie_word_embeddings=True, max_shard_size="100KB")
    hf = hf_model(folder)
    runner = make_runner(folder, compile=False)
    batch = ManualBatch(runner, random_prompts([5, 9], hf.config.vocab_size))
    seqs = batch.decode(4)
    with torch.no_grad():
        for seq in seqs:
            ref = hf(torch.tensor([seq[:-1]])).logits[0, -1]
            assert int(ref.argmax()) == seq[-1]


def test_output_independent_of_batch_mates_and_padding(make_tiny_model) -> None:
    folder = make_tiny_model("qwen3")
    runner = make_runner(folder, compile=False)
    prompts = random_prompts([6, 15, 4], 320, seed=3)
    together = ManualBatch(runner, prompts)  # 3 rows padded to the 4-bucket
    joint = together.decode(DECODE_STEPS)
    together.release()
    for i, p in enumerate(prompts):
        alone = ManualBatch(runner, [p])
        assert alone.decode(DECODE_STEPS)[0] == joint[i]
        alone.release()
    assert runner.kv_pool.available_size() == runner.kv_pool.num_slots


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_decode_equals_eager_without_recompiles(make_tiny_model, arch: str) -> None:
    folder = make_tiny_model(arch)
    prompts = random_prompts([9, 2, 14], 320, seed=1)
    eager = ManualBatch(make_runner(folder, compile=False), prompts)
    eager_seqs = eager.decode(DECODE_STEPS)
    runner = make_runner(folder, compile=True)  # compiles buckets 1, 2, 4 with fullgraph=True
    assert runner.graphs.compiled and set(runner.graphs.compile_seconds) == {1, 2, 4}
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = ManualBatch(runner, prompts)
        assert compiled.decode(DECODE_STEPS) == eager_seqs  # batch of 3 runs in the 4-bucket
        for e, c in zip(eager.step_logits, compiled.step_logits):
            torch.testing.assert_close(c, e, atol=1e-4, rtol=1e-4)
        compiled.release()
        for n in (1, 2):  # buckets 1 and 2 replay too, still no recompile
            part = ManualBatch(runner, prompts[:n])
            assert part.decode(3) == [s[: len(p) + 4] for s, p in zip(eager_seqs, prompts[:n])]
            part.release()
    assert runner.graphs.steps_per_bucket[4] == DECODE_STEPS
    assert runner.graphs.steps_per_bucket[1] == 3 and runner.graphs.steps_per_bucket[2] == 3
