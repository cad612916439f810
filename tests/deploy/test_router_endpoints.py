"""What load-aware routers read from a worker, on a real `ember serve`: GET /v1/loads in the shape smg (the
Shepherd Model Gateway, the SGLang router) deserializes for a generic worker, its numbers following the engine
(a full batch and a queued request show up, KV in use during a long generation, all back to 0 after), the
fields smg reads from /get_server_info, no endpoint that would make smg take Ember for SGLang or vLLM, and the
`--metrics-compat vllm` gauge names, present only with the flag."""
from __future__ import annotations

from contextlib import ExitStack
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import MakeTinyModel
from server_harness import (
    MAX_RUNNING,
    MODEL_NAME,
    TINY_CONTEXT,
    Server,
    http_client,
    idle,
    metrics,
    tiny_server,
    wait_until,
)

# smg's SchedulerLoadSnapshot (crates/protocols/src/worker.rs): its i32 fields must be JSON integers and its f64
# fields numbers, or serde rejects the whole body and smg stops polling the worker.
INT_FIELDS = {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens", "num_total_reqs",
              "num_used_tokens", "max_total_num_tokens", "max_running_requests"}
FLOAT_FIELDS = {"token_usage", "gen_throughput", "cache_hit_rate", "utilization"}
SMG_INCLUDE = "core,disagg,queues,memory"  # what smg's monitor.rs asks for
LONG_STREAM = {"prompt": "Hello there", "max_tokens": TINY_CONTEXT - 64, "temperature": 0, "stream": True,
               "ignore_eos": True}
VLLM_NAMES = {"vllm:num_requests_running": "ember:num_requests_running",
              "vllm:num_requests_waiting": "ember:num_requests_waiting",
              "vllm:kv_cache_usage_perc": "ember:kv_pool_usage_perc"}


def get_loads(server: Server, include: str | None = SMG_INCLUDE) -> dict[str, Any]:
    """/v1/loads without an API key (an open path, like /metrics); its one rank, after checking the types."""
    params = {"include": include} if include is not None else {}
    resp = httpx.get(server.base_url + "/v1/loads", params=params, timeout=10)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) == {"timestamp", "version", "dp_rank_count", "loads"}, body
    assert isinstance(body["timestamp"], str) and datetime.fromisoformat(body["timestamp"]).tzinfo is not None
    assert body["version"] == metadata.version("ember") and body["dp_rank_count"] == 1
    assert len(body["loads"]) == 1
    rank: dict[str, Any] = body["loads"][0]
    assert set(rank) == INT_FIELDS | FLOAT_FIELDS, rank
    for name in INT_FIELDS:
        assert type(rank[name]) is int, (name, rank[name])
    for name in FLOAT_FIELDS:
        assert type(rank[name]) in (int, float) and 0 <= rank[name], (name, rank[name])
    return rank


def test_loads_shape_when_idle(server: Server) -> None:
    wait_until(server, idle, "an idle engine")
    for include in (SMG_INCLUDE, None, "core", "all"):
        rank = get_loads(server, include)
        assert rank["dp_rank"] == 0 and rank["max_running_requests"] == MAX_RUNNING
        assert rank["max_total_num_tokens"] == 2 * TINY_CONTEXT  # --max-total-tokens
        assert (rank["num_running_reqs"], rank["num_waiting_reqs"], rank["num_total_reqs"]) == (0, 0, 0)
        assert (rank["num_used_tokens"], rank["token_usage"], rank["utilization"]) == (0, 0, 0)
        assert rank["num_waiting_uncached_tokens"] == 0 and rank["cache_hit_rate"] <= 1
    resp = httpx.get(server.base_url + "/v1/loads", params={"include": "core,bogus"}, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "include"


def test_loads_follow_a_full_batch_a_queue_and_the_end(server: Server) -> None:
    wait_until(server, idle, "an idle engine")
    before = get_loads(server)  # a throughput baseline with the engine idle
    with http_client(server) as hc, ExitStack() as streams:
        for _ in range(MAX_RUNNING + 1):  # one more than the batch holds: it waits
            streams.enter_context(hc.stream("POST", "/v1/completions", json=LONG_STREAM))
        m = wait_until(server, lambda m: m["ember:num_requests_running"] == MAX_RUNNING
                       and m["ember:num_requests_waiting"] == 1, "a full batch and one queued request")
        rank = get_loads(server)
        after = metrics(server)
        assert (rank["num_running_reqs"], rank["num_waiting_reqs"], rank["num_total_reqs"]) == (MAX_RUNNING, 1,
                                                                                                MAX_RUNNING + 1)
        assert rank["utilization"] == 1.0
        # KV held by the batch, growing a token per sequence per step: between the two scrapes around it
        assert m["ember:kv_pool_used_slots"] <= rank["num_used_tokens"] <= after["ember:kv_pool_used_slots"]
        assert rank["num_used_tokens"] > 0
        assert rank["token_usage"] == round(rank["num_used_tokens"] / rank["max_total_num_tokens"], 4) > 0
        # the queued request's prompt is still to prefill (it is in no batch yet)
        n_prompt = hc.post("/v1/tokenize", json={"prompt": LONG_STREAM["prompt"]}).json()["count"]
        assert rank["num_waiting_uncached_tokens"] >= n_prompt
        assert rank["gen_throughput"] > 0, (before, rank)  # tokens were generated since the idle poll
    wait_until(server, idle, "the streams to be aborted")
    rank = get_loads(server)
    assert (rank["num_running_reqs"], rank["num_waiting_reqs"], rank["num_total_reqs"]) == (0, 0, 0)
    assert (rank["num_used_tokens"], rank["token_usage"], rank["num_waiting_uncached_tokens"]) == (0, 0, 0)


def test_server_info_has_the_fields_smg_reads(server: Server, http: httpx.Client) -> None:
    info = http.get("/get_server_info").json()
    assert info["served_model_name"] == MODEL_NAME and info["model"] == MODEL_NAME
    assert info["context_length"] == TINY_CONTEXT and info["max_total_tokens"] == 2 * TINY_CONTEXT
    assert info["version"] == metadata.version("ember") and info["max_running_requests"] == MAX_RUNNING
    assert "model_id" not in info  # smg's ServerInfo reads "model" as an alias of model_id: both would not parse
    assert httpx.get(server.base_url + "/get_server_info").status_code == 401  # still behind the API key


def test_nothing_makes_smg_take_ember_for_sglang_or_vllm(server: Server, http: httpx.Client) -> None:
    """smg's detect_backend.rs: owned_by "sglang"/"nvidia"/"vllm", or a 2xx from /server_info (SGLang) or
    /version (vLLM), would class the worker as that engine and read that engine's metric names instead."""
    assert {m["owned_by"] for m in http.get("/v1/models").json()["data"]} == {"ember"}
    for path in ("/server_info", "/version"):
        assert http.get(path).status_code == 404, path


def test_vllm_metric_names_only_with_the_flag(server: Server, make_tiny_model: MakeTinyModel,
                                              tmp_path: Path) -> None:
    assert not [name for name in metrics(server) if name.startswith("vllm:")]
    model = make_tiny_model("llama", max_position_embeddings=TINY_CONTEXT)
    with tiny_server(model, tmp_path / "server.log", "--metrics-compat", "vllm") as compat:
        idle_m = metrics(compat)
        assert {name for name in idle_m if name.startswith("vllm:")} == set(VLLM_NAMES)
        with http_client(compat) as hc, hc.stream("POST", "/v1/completions", json=LONG_STREAM):
            m = wait_until(compat, lambda m: m["ember:num_requests_running"] == 1 and m["ember:kv_pool_used_slots"],
                           "the request to run")
            for vllm_name, ember_name in VLLM_NAMES.items():
                assert m[vllm_name] == m[ember_name], (vllm_name, m[vllm_name], m[ember_name])  # one scrape
            assert 0 < m["vllm:kv_cache_usage_perc"] < 1
        wait_until(compat, idle, "the stream to be aborted")


def test_metrics_compat_flag_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from server.cli.config_resolve import ConfigError
    from server.cli.main import resolve_args
    from server.cli.serve import settings_from_args

    monkeypatch.delenv("EMBER_METRICS_COMPAT", raising=False)
    assert settings_from_args(resolve_args(["serve"])[0]).metrics_compat is None
    assert settings_from_args(resolve_args(["serve", "--metrics-compat", "vllm"])[0]).metrics_compat == "vllm"
    monkeypatch.setenv("EMBER_METRICS_COMPAT", "vllm")
    assert settings_from_args(resolve_args(["serve"])[0]).metrics_compat == "vllm"
    monkeypatch.setenv("EMBER_METRICS_COMPAT", "sglang")
    with pytest.raises(ConfigError, match="sglang"):  # outside the choices, refused like the flag
        resolve_args(["serve"])
