"""Structured outputs in the engine: grammar compile and cache, token masks, and constrained generation.

The tiny model has random weights, so whatever it emits unconstrained is gibberish: every constrained output
that parses here parses because of the mask, which makes these tests sharp.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from engine.grammar.masks import MaskBuffer, apply_masks
from engine.grammar.spec import GrammarError, GrammarSpec
from engine.sampling_params import SamplingParams
from scheduler_helpers import Arrival, Driver, assert_idle_and_empty, tiny_engine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


def _valid_person(obj: dict) -> bool:
    return (set(obj) == set(PERSON["properties"]) and isinstance(obj["name"], str) and len(obj["name"]) <= 12
            and isinstance(obj["age"], int) and 0 <= obj["age"] <= 120 and obj["role"] in ("admin", "user")
            and len(obj["tags"]) <= 3 and all(isinstance(t, str) and len(t) <= 6 for t in obj["tags"])
            and re.fullmatch(r"[0-9]{5}", obj["address"]["zip"]) is not None)


@pytest.fixture(scope="module")
def core(make_tiny_model):
    return tiny_engine(make_tiny_model("llama"))


def _prompt(core, text: str = "Answer:") -> list[int]:
    return list(core.tokenizer.encode(text))


def _run(core, items: list[tuple[list[int], SamplingParams]], **driver_args) -> dict:
    driver = Driver(core, **driver_args)
    streams = driver.run([Arrival(0, f"r{i}", p, sp) for i, (p, sp) in enumerate(items)])
    assert_idle_and_empty(core)
    return streams


def test_compile_is_cached_and_errors_name_the_field(core) -> None:
    g = core.grammars
    spec = GrammarSpec.json_schema(PERSON)
    first = g.compile(spec)
    assert g.compile(GrammarSpec.json_schema(json.dumps(PERSON))) is first  # the same schema as text: a hit
    assert g.matcher(spec) is not first  # each sequence gets its own copy
    cases = [
        (lambda: g.compile(GrammarSpec("regex", "(ab", param="guided_regex")), "guided_regex", "unclosed"),
        (lambda: g.compile(GrammarSpec.json_schema({"type": "objekt"}, param="guided_json")), "guided_json", "objekt"),
        (lambda: g.compile(GrammarSpec("lark", "start: nothing_defined", param="guided_grammar")), "guided_grammar",
         "nothing_defined"),
        (lambda: GrammarSpec.json_schema("{not json", param="response_format"), "response_format", "not valid JSON"),
        (lambda: GrammarSpec.choice([], param="guided_choice"), "guided_choice", "non-empty"),
    ]
    for call, param, words in cases:
        with pytest.raises(GrammarError) as info:
            call()
        assert info.value.param == param and words in str(info.value), str(info.value)


def test_strict_false_ignores_unknown_keywords(core) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}
    with pytest.raises(GrammarError):
        core.grammars.compile(GrammarSpec.json_schema(schema, strict=True))
    core.grammars.compile(GrammarSpec.json_schema(schema, strict=False))


def test_mask_bias_matches_the_matcher_bits(core) -> None:
    matchers = [core.grammars.matcher(GrammarSpec("regex", r"[0-9]+")), core.grammars.matcher(GrammarSpec.json_object())]
    buf = MaskBuffer(core.model_config.vocab_size)
    bits = np.unpackbits(buf.fill(matchers).numpy().view(np.uint8), axis=1, bitorder="little")
    bias = buf.bias(matchers)
    assert torch.equal(torch.isfinite(bias), torch.from_numpy(bits[:, : bias.shape[1]].astype(bool)))
    assert torch.all(bias[torch.isfinite(bias)] == 0)
    digits = [t for t in range(bias.shape[1]) if bias[0, t] == 0]
    assert digits and all(core.tokenizer.decode([t]).isdigit() for t in digits)
    # Only the named rows change; a row of the batch without a grammar keeps its logits bit for bit.
    logits = torch.randn(3, bias.shape[1])
    before = logits.clone()
    apply_masks(logits, [0, 2], bias)
    assert torch.equal(logits[1], before[1])
    assert torch.equal(torch.isfinite(logits[[0, 2]]), torch.isfinite(bias))


def test_constrained_outputs_hold_on_a_random_model(core) -> None:
    p = _prompt(core)
    regex = r"[A-Z][a-z]{2,6}-[0-9]{3}"
    items = [
        (p, SamplingParams(max_tokens=120, temperature=0, grammar=GrammarSpec.json_schema(PERSON))),
        (p, SamplingParams(max_tokens=120, temperature=1.0, seed=7, n=3, grammar=GrammarSpec.json_schema(PERSON))),
        (p, SamplingParams(max_tokens=30, temperature=1.0, seed=1, n=4, grammar=GrammarSpec("regex", regex))),
        (p, SamplingParams(max_tokens=30, temperature=1.0, n=4, grammar=GrammarSpec.choice(["red", "green", "blue"]))),
        (p, SamplingParams(max_tokens=40, temperature=0, grammar=GrammarSpec("ebnf", 'root ::= "(" [a-c]+ ")"'))),
        (p, SamplingParams(max_tokens=40, temperature=0, grammar=GrammarSpec("grammar", 'start: "x" /[0-9]/ "y"'))),
    ]
    streams = _run(core, items)
    for n in range(3):
        assert _valid_person(json.loads(streams[("r1", n)].text))
    person = streams[("r0", 0)]
    assert _valid_person(json.loads(person.text)) and person.finish_reason == "stop"
    assert all(re.fullmatch(regex, streams[("r2", n)].text) for n in range(4))
    assert all(streams[("r3", n)].text in ("red", "green", "blue") for n in range(4))
    assert re.fullmatch(r"\([a-c]+\)", streams[("r4", 0)].text)
    assert re.fullmatch(r"x[0-9]y", streams[("r5", 0)].text)
    # The grammar ending is the stop: no EOS token needs sampling, and ignore_eos cannot run past it.
    forced = _run(core, [(p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, min_tokens=10,
                                            grammar=GrammarSpec.choice(["ok"])))])
    assert forced[("r0", 0)].text == "ok" and forced[("r0", 0)].finish_reason == "stop"


def test_free_rows_are_unchanged_by_constrained_batch_mates(core) -> None:
    prompts = [_prompt(core, t) for t in ("The first prompt", "Another one here", "Third")]
    free = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)]
    alone = _run(core, [(prompts[0], free[0]), (prompts[1], free[1])])
    constrained = SamplingParams(max_tokens=150, temperature=0, grammar=GrammarSpec.json_schema(PERSON))
    mixed = _run(core, [(prompts[0], free[0]), (prompts[2], constrained), (prompts[1], free[1]),
                        (prompts[2], SamplingParams(max_tokens=60, temperature=1.0, seed=3,
                                                    grammar=GrammarSpec("regex", r"[0-9]{20}")))])
    assert mixed[("r0", 0)].token_ids == alone[("r0", 0)].token_ids
    assert mixed[("r2", 0)].token_ids == alone[("r1", 0)].token_ids
    assert _valid_person(json.loads(mixed[("r1", 0)].text))


def test_retraction_keeps_the_grammar_state(make_tiny_model) -> None:
    """A pool too small for the batch: requests are retracted and recomputed mid-output; each still matches."""
    small = tiny_engine(make_tiny_model("llama"), max_total_tokens=128)
    items = [(_prompt(small, f"Retract request {i} please"),
              SamplingParams(max_tokens=100, temperature=1.0, seed=i, grammar=GrammarSpec("regex", r"[a-z]{80}")))
             for i in range(4)]
    driver = Driver(small, pin_new_token_ratio=0.0)
    streams = driver.run([Arrival(0, f"r{i}", q, sp) for i, (q, sp) in enumerate(items)])
    assert small.scheduler.stats.retractions > 0
    assert all(re.fullmatch(r"[a-z]{80}", s.text) for s in streams.values())
    assert_idle_and_empty(small)
