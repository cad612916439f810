"""Embedding requests in the engine (prefill-only, pooled final hidden states) against transformers fp32, alone,
chunked, retracted and mixed with decoding requests."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.core import EngineCore
from engine.loader.pooling import model_pooling
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine_helpers import hf_model, random_prompts
from scheduler_helpers import Arrival, Driver, assert_idle_and_empty, run_solo, tiny_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def _reference(folder: Path, prompt: list[int], pooling: str) -> torch.Tensor:
    """transformers' final hidden states (after the last norm), pooled and normalised."""
    with torch.no_grad():
        hidden = hf_model(folder).model(torch.tensor([prompt])).last_hidden_state[0].float()
    vec = hidden.mean(0) if pooling == "mean" else hidden[-1]
    return torch.nn.functional.normalize(vec, dim=0)


def _embed(core: EngineCore, reqs: list[Request]) -> dict[str, torch.Tensor]:
    core.add(reqs)
    got: dict[str, torch.Tensor] = {}
    while core.has_work():
        for out in core.step():
            if out.embedding is not None:
                assert out.finish_reason == "stop" and out.token_ids == ()
                got[out.request_id] = torch.tensor(out.embedding)
    return got


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_match_transformers_chunked_and_cached(make_tiny_model: Callable[..., Path], pooling: str) -> None:
    folder = make_tiny_model("llama")
    core = tiny_engine(folder, pooling=pooling)  # 16-token chunks: a 40-token prompt takes three prefills
    prompts = random_prompts([5, 40, 23], 320, seed=3)
    reqs = [core.make_embedding_request(f"e{i}", p, core.pooling) for i, p in enumerate(prompts)]
    got = _embed(core, reqs)
    for i, p in enumerate(prompts):
        want = _reference(folder, p, pooling)
        assert (got[f"e{i}"] - want).abs().max() < 1e-5
        assert abs(float(got[f"e{i}"].norm()) - 1.0) < 1e-5
    # Again, with the prompts' KV now in the prefix cache: mean pooling reuses none of it, last pooling may.
    again = _embed(core, [core.make_embedding_request(f"e{i}", p, core.pooling) for i, p in enumerate(prompts)])
    for key, vec in got.items():
        assert (again[key] - vec).abs().max() < 1e-5
    assert_idle_and_empty(core)


def test_embeddings_share_steps_with_decoding_requests(make_tiny_model: Callable[..., Path]) -> None:
    """Embedding prefills interleave with generation (each prefill batch holds one kind): the generated tokens and
    the embeddings are those of each request alone."""
    folder = make_tiny_model("llama")
    core = tiny_engine(folder)
    gen_prompts = random_prompts([20, 33], 320, seed=4)
    emb_prompts = random_prompts([30, 12, 45], 320, seed=5)
    solos = [run_solo(core, p, GREEDY).token_ids for p in gen_prompts]
    alone = _embed(core, [core.make_embedding_request(f"e{i}", p, "mean") for i, p in enumerate(emb_prompts)])
    driver = Driver(core)
    arrivals = [Arrival(0, f"g{i}", p, GREEDY) for i, p in enumerate(gen_prompts)]
    arrivals += [Arrival(2 * i + 1, f"e{i}", p, None) for i, p in enumerate(emb_prompts)]  # None: an embedding
    streams = driver.run(arrivals)
    assert driver.mixed_steps > 0
    for i in range(len(gen_prompts)):
        assert streams[(f"g{i}", 0)].token_ids == solos[i]
    for key, vec in alone.items():
        assert (driver.embeddings[key] - vec).abs().max() < 1e-5
    assert_idle_and_empty(core)


def test_a_retracted_embedding_is_recomputed_from_the_start(make_tiny_model: Callable[..., Path]) -> None:
    """A pool too small for everything at once: half-prefilled embeddings give their slots back and start over."""
    folder = make_tiny_model("llama")
    prompts = random_prompts([60, 50, 55], 320, seed=6)
    roomy = tiny_engine(folder)
    want = _embed(roomy, [roomy.make_embedding_request(f"e{i}", p, "mean") for i, p in enumerate(prompts)])
    tight = tiny_engine(folder, max_total_tokens=128, disable_prefix_cache=True)
    driver = Driver(tight, pin_new_token_ratio=0.0)  # reckless admission: decode growth retracts prefills
    gen = [Arrival(0, f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=60))
           for i, p in enumerate(random_prompts([20, 20], 320, seed=7))]
    driver.run(gen + [Arrival(1, f"e{i}", p, None) for i, p in enumerate(prompts)])
    got = driver.embeddings
    for key, vec in want.items():
        assert (got[key] - vec).abs().max() < 1e-5
    assert tight.scheduler.stats.retractions > 0
    assert_idle_and_empty(tight)


def test_too_long_or_empty_inputs_are_refused(make_tiny_model: Callable[..., Path]) -> None:
    from engine.sampling_params import SamplingParamsError

    core = tiny_engine(make_tiny_model("llama"))
    with pytest.raises(SamplingParamsError, match="maximum context length"):
        core.make_embedding_request("x", [1] * (core.max_context + 1), "mean")
    with pytest.raises(SamplingParamsError, match="at least one token"):
        core.make_embedding_request("x", [], "mean")


def test_pooling_is_read_from_a_sentence_transformers_folder(tmp_path: Path) -> None:
    assert model_pooling(str(tmp_path)) == "mean"
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    assert model_pooling(str(tmp_path)) == "last"
    assert model_pooling(str(tmp_path), "mean") == "mean"
    assert model_pooling(None) == "mean"
