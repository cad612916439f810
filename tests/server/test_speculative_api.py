"""Speculative decoding seen from a real server: per-request draft counts in /generate's meta_info, the /metrics
counters and /get_server_info's settings. That output equals speculation off is the engine tests' business
(tests/engine/test_speculative.py); here, that what the server reports adds up."""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import httpx

from server_harness import Server, http_client, run_server, tiny_server_args


def _counter(metrics: str, name: str, drafter: str = "ngram") -> float:
    match = re.search(rf'^{re.escape(name)}_total{{drafter="{drafter}"}} (\S+)$', metrics, re.M)
    assert match, name
    return float(match.group(1))


def _generate(http: httpx.Client, ids: list[int], n: int) -> dict:
    sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    resp = http.post("/generate", json={"input_ids": ids, "sampling_params": sp})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_draft_counts_add_up_across_meta_info_and_metrics(server: Server, http: httpx.Client) -> None:
    info = http.get("/get_server_info").json()["speculative"]
    assert info["mode"] == "ngram" and info["num_speculative_tokens"] == 15
    # A random model's greedy text soon falls into a cycle; a prompt that ends in one gives the drafter material.
    prompt = [11, 12, 13, 14, 15, 16] * 3
    for _ in range(2):
        prompt += _generate(http, prompt, 40)["output_ids"]
    before = http.get("/metrics").text
    # Whether a step drafts is the planner's call from measured step times, which a busy machine (the rest of the
    # suite on two cores) can make look too dear for a while: rounds of 3 until one kept a draft, at most 6.
    metas: list[dict] = []
    while len(metas) < 18 and not sum(m["spec_accepted_tokens"] for m in metas):
        metas += [_generate(http, prompt, 48)["meta_info"] for _ in range(3)]
    after = http.get("/metrics").text
    proposed = sum(m["spec_proposed_tokens"] for m in metas)
    accepted = sum(m["spec_accepted_tokens"] for m in metas)
    assert 0 < accepted <= proposed
    assert all(m["completion_tokens"] == 48 for m in metas)
    for name, total in (("ember:spec_proposed_tokens", proposed), ("ember:spec_accepted_tokens", accepted)):
        assert _counter(after, name) - _counter(before, name) == total
    assert _counter(after, "ember:spec_verify_steps") > _counter(before, "ember:spec_verify_steps")
    info = http.get("/get_server_info").json()["speculative"]
    assert info["accepted_tokens"] >= accepted
    # the decode steps just run were timed per bucket, the planner's costs: the batch of one's bucket among them
    assert "1" in info["step_ms"] and all(ms > 0 for ms in info["step_ms"].values())


def test_a_draft_model_server_reports_its_drafts(make_tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """--speculative draft --draft-model: the model drafting for itself (so its drafts are kept). The planner
    drafts while the draft's cost is unmeasured, then only if it pays, which a draft as big as the model never
    does: at least the first round is verified and reported under drafter="draft"."""
    model = make_tiny_model("llama")
    args = [*tiny_server_args(model), "--speculative", "draft", "--draft-model", str(model)]
    with run_server(args, tmp_path / "server.log") as server, http_client(server) as http:
        info = http.get("/get_server_info").json()["speculative"]
        assert info["mode"] == "draft" and info["draft_model"] == str(model)
        metas = [_generate(http, [11, 12, 13, 14, 15, 16, 17], 24)["meta_info"] for _ in range(2)]
        proposed = sum(m["spec_proposed_tokens"] for m in metas)
        accepted = sum(m["spec_accepted_tokens"] for m in metas)
        assert 0 < accepted <= proposed
        metrics = http.get("/metrics").text
        assert _counter(metrics, "ember:spec_proposed_tokens", "draft") == proposed
        assert _counter(metrics, "ember:spec_accepted_tokens", "draft") == accepted
