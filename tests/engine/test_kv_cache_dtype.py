"""--kv-cache-dtype on whole runners and engines of a tiny random Llama: int8 (and fp8) KV decodes what full-precision
KV does, the pool holds as many more tokens as the bytes say, compiled steps equal eager ones, and retraction and the
prefix cache keep every KV slot owned exactly once (the slot-partition check after every step)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig
from engine.loader import open_checkpoint
from engine.model_runner import size_kv_pool
from engine.pools import KVPool
from engine_helpers import ManualBatch, assert_greedy_close, make_runner, random_prompts
from scheduler_helpers import Driver, assert_idle_and_empty, tiny_engine

PROMPTS = random_prompts([7, 30, 61, 12], 320, seed=8)
MakeTinyModel = Callable[..., Path]


@pytest.fixture(scope="module")
def folder(make_tiny_model: MakeTinyModel) -> Path:
    return make_tiny_model("llama")


# fp8 keeps 3 mantissa bits to int8's ~7: looser logits, and one more prompt that leaves full precision off a near-tie.
@pytest.mark.parametrize("kv,storage,cosine,err,whole", [("int8", torch.int8, 0.9999, 0.05, 3),
                                                         ("fp8_e4m3", torch.float8_e4m3fn, 0.999, 0.15, 2)])
def test_int8_kv_decodes_what_full_precision_kv_does(folder: Path, caplog: pytest.LogCaptureFixture, kv: str,
                                                     storage: torch.dtype, cosine: float, err: float,
                                                     whole: int) -> None:
    full = ManualBatch(make_runner(folder, compile=False), PROMPTS)
    want = full.decode(24)
    with caplog.at_level(logging.INFO, logger="ember.runner"):
        runner = make_runner(folder, compile=False, kv_cache_dtype=kv)
    assert f"KV pool: 4096 slots of {kv} (160 bytes a token" in caplog.text  # 2 layers x K, V x 2 heads x (16 + 4)
    assert runner.k_caches[0].dtype == storage and runner.k_caches[0].shape[-1] == 16 + 4
    q8 = ManualBatch(runner, PROMPTS)
    got = q8.decode(24)
    # Every step's logits close and the same greedy token, up to a divergence off a near-tie of the full-precision
    # logits (int8: prompt 3 at its 4th token, top two 0.002 apart); `whole` prompts agree over all 24 tokens.
    worst = assert_greedy_close([q8.prefill_logits, *q8.step_logits], [full.prefill_logits, *full.step_logits], cosine)
    assert 0 < worst < err  # the rounding shows, a little
    assert sum(g == w for g, w in zip(got, want)) >= whole


@pytest.mark.parametrize("dtype,ratio", [("float32", 4 * 16 / 20), ("bfloat16", 2 * 16 / 20)])
def test_the_pool_holds_more_tokens_by_the_ratio_of_bytes(folder: Path, dtype: str, ratio: float,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # One memory budget: int8 rows of head_dim + 4 bytes (the scale) against head_dim values of 4 or 2 bytes.
    mc = open_checkpoint(str(folder)).config
    monkeypatch.setattr("engine.model_runner.psutil.virtual_memory", lambda: SimpleNamespace(available=2**30))

    def slots(kv: str) -> int:
        config = EngineConfig(model=str(folder), dtype=dtype, kv_cache_dtype=kv, max_running_requests=10**6,
                              mem_fraction=0.5)
        return size_kv_pool(config, mc, 256, mc.num_layers)

    assert slots("int8") / slots("auto") == pytest.approx(ratio, rel=1e-3)
    assert slots("fp8_e4m3") == slots("int8")
    assert KVPool.bytes_per_slot(2, 2, 16, torch.int8) == 2 * 2 * 2 * 20
    assert slots("bfloat16") == slots("auto") * (2 if dtype == "float32" else 1)


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_compiled_step_equals_eager_with_int8_kv(folder: Path, kv: str) -> None:
    want = ManualBatch(make_runner(folder, compile=False, kv_cache_dtype=kv), PROMPTS)
    want_seqs = want.decode(10)
    compiled = make_runner(folder, compile=True, buckets=(4,), kv_cache_dtype=kv)
    assert compiled.graphs.compiled and compiled.graphs.ready_buckets == [4]
    got = ManualBatch(compiled, PROMPTS)
    assert got.decode(10) == want_seqs
    assert compiled.graphs.steps_per_bucket[4] == 10
    for a, b in zip(got.step_logits, want.step_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_saved_steps_are_keyed_by_the_kv_dtype(folder: Path, tmp_path: Path) -> None:
    def artifact_dir(kv: str) -> Path | None:
        config = EngineConfig(model=str(folder), dtype="float32", kv_cache_dtype=kv, max_total_tokens=512,
                              max_running_requests=2, decode_buckets=(2,), disable_compile=True,
                              compile_cache_dir=str(tmp_path))
        from engine.model_runner import ModelRunner

        return ModelRunner(config, open_checkpoint(str(folder)))._decode_artifact_dir()

    dirs = {kv: artifact_dir(kv) for kv in ("auto", "float32", "bfloat16", "int8", "fp8_e4m3")}
    assert dirs["auto"] == dirs["float32"]  # auto is the serving dtype: the same steps
    assert len({dirs["float32"], dirs["bfloat16"], dirs["int8"], dirs["fp8_e4m3"]}) == 4


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_int8_kv_engine_with_prefix_cache_and_retraction_keeps_the_slot_partition(folder: Path, kv: str) -> None:
    # The prefix-cache workload (shared prefixes, repeats, n > 1, aborts) in a pool small enough to evict and retract;
    # Driver runs KVManager.check after every step. The oracle: the same int8 engine with the cache off.
    from test_prefix_cache import _completed, shared_prefix_workload

    arrivals, aborts = shared_prefix_workload(5)
    off = tiny_engine(folder, kv_cache_dtype=kv, disable_prefix_cache=True)
    expected = _completed(Driver(off).run(arrivals, aborts=aborts))
    on = tiny_engine(folder, kv_cache_dtype=kv, max_total_tokens=220)
    assert on.runner.kv_pool.dtype == on.config.kv_torch_dtype != torch.float32
    got = _completed(Driver(on, pin_new_token_ratio=0.0).run(arrivals, aborts=aborts))
    common = expected.keys() & got.keys()
    assert len(common) > 0.8 * len(expected)
    same = sum(got[k] == expected[k] for k in common)
    assert same == len(common), f"{len(common) - same} of {len(common)} outputs differ"
    stats = on.scheduler.kvm.stats
    assert stats.evicted_tokens > 0 and stats.hit_tokens > 0 and on.scheduler.stats.retractions > 0
    assert_idle_and_empty(on)
