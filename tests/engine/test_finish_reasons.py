"""Every way a sequence ends, through the whole engine on a tiny random model: stop strings split across
tokens, stop token ids, EOS (the config's and generation_config's), min_tokens, ignore_eos, max_tokens and the
context length. Expected outputs are derived from an unconstrained solo run of the same prompt.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.core import EngineCore
from engine.sampling_params import SamplingParams, SamplingParamsError
from scheduler_helpers import Arrival, Driver, Stream, assert_idle_and_empty, run_solo, tiny_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def folder(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def core(folder: Path) -> EngineCore:
    return tiny_engine(folder)


@pytest.fixture(scope="module")
def prompt(core: EngineCore) -> list[int]:
    return core.tokenizer.encode("The capital of France is")


@pytest.fixture(scope="module")
def solo(core: EngineCore, prompt: list[int]) -> Stream:
    return run_solo(core, prompt, GREEDY)


def spanning_stop(solo: Stream, tokens_spanned: int) -> tuple[str, int]:
    """A stop string from the last character of one token's text to the first character of the text of the
    token `tokens_spanned - 1` text-bearing tokens later, whose first occurrence is exactly there (so it
    really is split across tokens). Returns (stop string, index of the token that completes it)."""
    text = solo.text
    starts = [len("".join(solo.deltas[:i])) for i in range(len(solo.deltas))]
    bearing = [i for i, d in enumerate(solo.deltas) if d]
    for a, c in zip(bearing, bearing[tokens_spanned - 1:]):
        begin, end = starts[a] + len(solo.deltas[a]) - 1, starts[c] + 1
        stop = text[begin:end]
        if REPLACEMENT not in stop and text.find(stop) == begin:
            return stop, c
    raise AssertionError(f"no stop string spanning {tokens_spanned} tokens in {solo.deltas}")


@pytest.mark.parametrize("tokens_spanned", [2, 3])
def test_stop_string_split_across_tokens(core: EngineCore, prompt: list[int], solo: Stream,
                                        tokens_spanned: int) -> None:
    stop, last = spanning_stop(solo, tokens_spanned)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=("never-there", stop))
    # Alongside two other requests, arriving while they decode.
    other = SamplingParams(temperature=0.0, max_tokens=30)
    streams = Driver(core).run([Arrival(0, "a", prompt[:3], other), Arrival(0, "b", prompt[2:], other),
                                Arrival(2, "stop", prompt, params)])
    got = streams[("stop", 0)]
    assert (got.finish_reason, got.stop_reason) == ("stop", stop)
    assert got.token_ids == solo.token_ids[: last + 1]
    assert got.text == solo.text[: solo.text.find(stop)]
    assert stop not in got.text
    assert_idle_and_empty(core)


def test_stop_token_ids(core: EngineCore, prompt: list[int], solo: Stream) -> None:
    eos = core.model_config.eos_token_ids
    k = next(i for i, t in enumerate(solo.token_ids) if i >= 2 and t not in eos and t not in solo.token_ids[:i])
    stop_id = solo.token_ids[k]
    got = run_solo(core, prompt, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(stop_id,)))
    assert (got.finish_reason, got.stop_reason) == ("stop", stop_id)
    assert got.token_ids == solo.token_ids[: k + 1]  # the stop token is returned as a token, not as text
    assert got.text == core.tokenizer.decode(solo.token_ids[:k], skip_special_tokens=True)


def test_min_tokens_suppresses_eos_and_stop_ids(core: EngineCore, prompt: list[int]) -> None:
    [eos] = core.model_config.eos_token_ids
    no_eos = run_solo(core, prompt, SamplingParams(temperature=0.0, max_tokens=8, logit_bias={eos: -100.0}))
    # EOS is pushed to the top, so it comes the moment min_tokens allows it, and not before.
    got = run_solo(core, prompt, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5, logit_bias={eos: 100.0}))
    assert got.token_ids == no_eos.token_ids[:5] + [eos]
    assert (got.finish_reason, got.stop_reason) == ("stop", None)
    free = run_solo(core, prompt, SamplingParams(temperature=0.0, max_tokens=20, logit_bias={eos: 100.0}))
    assert (free.token_ids, free.finish_reason, free.text) == ([eos], "stop", "")
    stop_id = no_eos.token_ids[0]
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=3, stop_token_ids=(stop_id,),
                            logit_bias={stop_id: 100.0, eos: -100.0})
    got = run_solo(core, prompt, params)
    assert len(got.token_ids) == 4 and got.token_ids[-1] == stop_id and stop_id not in got.token_ids[:3]
    assert (got.finish_reason, got.stop_reason) == ("stop", stop_id)


def test_ignore_eos_and_max_tokens(core: EngineCore, prompt: list[int], solo: Stream) -> None:
    [eos] = core.model_config.eos_token_ids
    all_eos = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={eos: 100.0})
    got = run_solo(core, prompt, all_eos)
    assert (got.token_ids, got.finish_reason, got.text) == ([eos] * 8, "length", "")  # special: no text
    got = run_solo(core, prompt, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    assert (got.token_ids, got.finish_reason, got.stop_reason) == (solo.token_ids[:7], "length", None)


def test_eos_ids_from_generation_config(folder: Path, prompt: list[int], tmp_path: Path) -> None:
    """Extra EOS ids that only generation_config.json lists (as Llama 3 does) end a sequence too."""
    copy = Path(shutil.copytree(folder, tmp_path / "extra-eos"))
    gen = json.loads((copy / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], 5]
    (copy / "generation_config.json").write_text(json.dumps(gen))
    core = tiny_engine(copy)
    assert 5 in core.model_config.eos_token_ids
    got = run_solo(core, prompt, SamplingParams(temperature=0.0, max_tokens=10, logit_bias={5: 100.0}))
    assert (got.token_ids, got.finish_reason, got.stop_reason) == ([5], "stop", None)


def test_context_length_limit(folder: Path) -> None:
    core = tiny_engine(folder, max_context_len=64)
    prompt = list(range(3, 63))  # 60 tokens: room for 4 more
    got = run_solo(core, prompt, SamplingParams(temperature=0.0, ignore_eos=True))  # max_tokens unset
    assert (len(got.token_ids), got.finish_reason) == (4, "length")
    with pytest.raises(SamplingParamsError) as err:
        core.make_requests("too-long", prompt, SamplingParams(max_tokens=5))
    assert err.value.param == "max_tokens"
    assert_idle_and_empty(core)
