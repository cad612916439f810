"""Gemma 3 (Gemma3ForCausalLM, GGUF `gemma3`) on tiny random models against transformers eager fp32.

The tiny model has a window of 8 positions on four of its six layers, so every prompt and decode here runs past it:
a window layer that saw one position too many or too few, a ring entry overwritten too early, or a chunk that missed
the cached tail of the window would change the logits. The other layers use the global rope base and linear scaling;
the window layers a different base; the query scale is not 1/sqrt(head_dim); the norms are perturbed.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from gguf import GGMLQuantizationType
from safetensors.torch import load_file
from transformers import AutoConfig

from engine.config import EngineConfig
from engine.loader import UnsupportedModelError, load_tokenizer, open_checkpoint
from engine.loader.gguf_file import gguf_chat_template
from engine.loader.prepared import PreparedModel
from engine.model.weights import model_on_meta
from engine.forward_batch import ForwardBatch, PrefillChunk
from engine.model_runner import ModelRunner
from engine.pools import KVPool
from engine.quant.module import quantized_weights
from engine.sampling_params import SamplingParams
from engine_helpers import ManualBatch, assert_greedy_close, make_runner, random_prompts
from scheduler_helpers import Arrival, Driver, assert_idle_and_empty, run_solo, tiny_engine
from tiny_gguf import add_weight, finish, shape_writer
from tiny_gemma3 import WINDOW, hf_gemma3, hf_logits, write_tiny_gemma3

PROMPTS = [5, 20, 9, 33]  # within the window, past it, just past it, four windows long
DECODE_STEPS = 16
CASES: dict[str, dict[str, Any]] = {
    "window": {},
    "softcap": {"final_logit_softcapping": 3.0},  # small enough to bend the logits of this peaked model
    "gguf_shape": {"query_pre_attn_scalar": 16, "layer_types": None, "sliding_window_pattern": 6,
                   "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 100_000.0},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}},
}


def write_gemma3_gguf(hf_folder: Path, out: Path, qtype: GGMLQuantizationType | None = None,
                      pattern: int | list[bool] | None = None) -> Path:
    """`hf_folder` as llama.cpp's converter writes a Gemma 3: norms stored as 1 + w, ffn_norm is the pre-feedforward
    norm, no Q/K permutation, no query scale, no layer pattern unless given (llama.cpp's defaults), the chat
    template."""
    cfg = AutoConfig.from_pretrained(hf_folder)
    tok = load_tokenizer(str(hf_folder))
    w = shape_writer(out, "gemma3", hf_folder.name, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(cfg.sliding_window)
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    w.add_token_list([tok.convert_ids_to_tokens(i) for i in range(len(tok))])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_eot_token_id(tok.convert_tokens_to_ids("<end_of_turn>"))
    w.add_chat_template(tok.chat_template)
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for name, t in load_file(hf_folder / "model.safetensors").items():
        if name in top:
            gguf_name = top[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, _, kind = rest.rpartition(".")
            gguf_name = f"blk.{layer}.{names[module]}.{kind}"
        add_weight(w, gguf_name, (t.float() + 1.0 if name.endswith("norm.weight") else t.float()).numpy(), qtype)
    return finish(w, out)


@pytest.fixture(scope="module")
def make_gemma3(tmp_path_factory: pytest.TempPathFactory):
    built: dict[str, Path] = {}

    def make(case: str) -> Path:
        if case not in built:
            built[case] = write_tiny_gemma3(tmp_path_factory.mktemp(case) / f"gemma3-{case}", **CASES[case])
        return built[case]

    return make


@pytest.mark.parametrize("layout", ["rings", "pool"])
@pytest.mark.parametrize("case", CASES)
def test_prefill_and_decode_match_transformers(make_gemma3, case: str, layout: str) -> None:
    """Both homes of the window layers' K/V: per-request rings (the prefix cache off) and the token pool (on)."""
    folder = make_gemma3(case)
    hf = hf_gemma3(folder)
    runner = make_runner(folder, compile=False, rings=layout == "rings")
    assert (runner.window_pool is not None) == (layout == "rings")
    prompts = random_prompts(PROMPTS, hf.config.vocab_size)
    batch = ManualBatch(runner, prompts)
    seqs = batch.decode(DECODE_STEPS)
    for i, (prompt, seq) in enumerate(zip(prompts, seqs)):
        ref = hf_logits(hf, seq[:-1], len(prompt))
        got = torch.stack([batch.prefill_logits[i], *(s[i] for s in batch.step_logits)])
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
        assert seq[len(prompt):] == ref.argmax(-1).tolist()


def test_the_window_is_what_transformers_masks(make_gemma3) -> None:
    """The parity above is not vacuous: the same model with a window as long as the context (so nothing is ever
    masked) gives other logits past position 8."""
    folder = make_gemma3("window")
    hf = hf_gemma3(folder)
    seq = random_prompts([30], hf.config.vocab_size, seed=9)[0]
    windowed = hf_logits(hf, seq, 1)
    hf.config.sliding_window = 256
    for layer in hf.model.layers:
        layer.self_attn.sliding_window = 256
    full = hf_logits(hf, seq, 1)
    torch.testing.assert_close(windowed[:WINDOW], full[:WINDOW], atol=1e-5, rtol=1e-5)
    assert (windowed[WINDOW:] - full[WINDOW:]).abs().max() > 1e-2


@pytest.mark.parametrize("layout", ["rings", "pool"])
@pytest.mark.parametrize("chunk", [1, 3, 7, 8, 9, 40])
def test_chunked_prefill_matches_one_forward(make_gemma3, chunk: int, layout: str) -> None:
    """A 40-token prompt in chunks shorter than, equal to and longer than the window: each chunk must see the cached
    tail of the window (in a ring: before it overwrites it)."""
    folder = make_gemma3("window")
    hf = hf_gemma3(folder)
    runner = make_runner(folder, compile=False, rings=layout == "rings")
    prompt = random_prompts([40], hf.config.vocab_size, seed=4)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    row = runner.req_pool.allocate()
    slots = runner.kv_pool.allocate(40)
    assert row is not None and slots is not None
    for start in range(0, 40, chunk):
        end = min(40, start + chunk)
        part = PrefillChunk(row, start, prompt[start:end], slots[start:end], fill_len=40)
        logits = runner.forward(ForwardBatch.prefill([part]))[0]
        torch.testing.assert_close(logits, ref[end - 1], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["rings", "pool"])
@pytest.mark.parametrize("chunk", [3, 40])
def test_int8_kv_rings_and_pool_decode_what_full_precision_kv_does(make_gemma3, chunk: int, layout: str) -> None:
    """--kv-cache-dtype int8 on a window model, in both homes of the window layers' K/V: int8 rings (window prefill
    dequantizes the rows it gathers, decode reads them in the kernel) and the int8 token pool; chunks shorter than the
    window read the cached int8 tail, as in serving."""
    folder = make_gemma3("window")
    prompts = random_prompts(PROMPTS, 320, seed=2)

    def run(kv: str) -> tuple[list[torch.Tensor], list[list[int]]]:
        runner = make_runner(folder, compile=False, kv_cache_dtype=kv, rings=layout == "rings")
        assert (runner.window_pool is not None) == (layout == "rings")
        assert runner.window_pool is None or runner.window_pool.k[0].dtype == runner.kv_pool.dtype
        rows, logits = [], []
        for p in prompts:  # each prompt prefilled in chunks, then all decoded together
            row, slots = runner.req_pool.allocate(), runner.kv_pool.allocate(len(p))
            assert row is not None and slots is not None
            for start in range(0, len(p), chunk):
                end = min(len(p), start + chunk)
                out = runner.forward(ForwardBatch.prefill([PrefillChunk(row, start, p[start:end], slots[start:end])]))
            rows.append(row)
            logits.append(out[0])
        seqs = [p + [int(lg.argmax())] for p, lg in zip(prompts, logits)]
        steps = [torch.stack(logits)]
        for _ in range(DECODE_STEPS):
            slots = runner.kv_pool.allocate(len(seqs))
            ids = torch.tensor([s[-1] for s in seqs])
            pos = torch.tensor([len(s) - 1 for s in seqs])
            steps.append(runner.forward(ForwardBatch.decode(ids, pos, torch.tensor(rows), slots)))
            seqs = [s + [int(t)] for s, t in zip(seqs, steps[-1].argmax(-1))]
        return steps, seqs

    full, full_seqs = run("auto")
    q8, q8_seqs = run("int8")
    worst = assert_greedy_close(q8, full, 0.999)
    assert 0 < worst < 0.05
    assert sum(a == b for a, b in zip(q8_seqs, full_seqs)) >= 3


def test_window_layers_keep_one_window_per_request(make_gemma3) -> None:
    """Memory: the window layers' buffers hold max_running x (window + the draft cap) entries (+ the padding slot)
    whatever the context; only the global layers are in the token pool, whose slot size counts them alone."""
    folder = make_gemma3("window")
    runner = make_runner(folder, compile=False, max_running=4, max_total_tokens=1000, rings=True)
    mc = runner.model_config
    assert mc.window_layers == (0, 1, 3, 4) and mc.sliding_window == WINDOW and runner.max_context == 256
    assert runner.window_pool is not None and runner.window_pool.ring == WINDOW + runner.config.num_speculative_tokens
    for i, (k, v) in enumerate(zip(runner.k_caches, runner.v_caches)):
        rows = 4 * runner.window_pool.ring + 1 if i in mc.window_layers else 1001
        assert k.shape == v.shape == (rows, 2, 16)
    assert runner.kv_pool.k == [runner.k_caches[2], runner.k_caches[5]]
    assert KVPool.bytes_per_slot(len(runner.kv_pool.k), 2, 16, torch.float32) * 3 == KVPool.bytes_per_slot(
        mc.num_layers, 2, 16, torch.float32)


def test_window_as_long_as_the_context_needs_no_rings(make_gemma3) -> None:
    folder = make_gemma3("window")
    config = EngineConfig(model=str(folder), dtype="float32", max_total_tokens=512, max_running_requests=2,
                          decode_buckets=(1, 2), disable_compile=True, max_context_len=WINDOW)
    runner = ModelRunner(config, open_checkpoint(str(folder)))
    assert runner.window_pool is None and len(runner.kv_pool.k) == 6
    hf = hf_gemma3(folder)
    prompt = random_prompts([6], hf.config.vocab_size)[0]
    batch = ManualBatch(runner, [prompt])
    seq = batch.decode(1)[0]
    torch.testing.assert_close(torch.stack([batch.prefill_logits[0], batch.step_logits[0][0]]),
                               hf_logits(hf, seq[:-1], 6), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["rings", "pool"])
def test_output_independent_of_batch_mates_and_padding(make_gemma3, layout: str) -> None:
    runner = make_runner(make_gemma3("window"), compile=False, rings=layout == "rings")
    prompts = random_prompts([20, 3, 11], runner.model_config.vocab_size, seed=3)
    together = ManualBatch(runner, prompts)  # 3 rows padded to the 4-bucket
    joint = together.decode(DECODE_STEPS)
    together.release()
    for i, p in enumerate(prompts):
        alone = ManualBatch(runner, [p])
        assert alone.decode(DECODE_STEPS)[0] == joint[i]
        for a, t in zip(alone.step_logits, together.step_logits):
            torch.testing.assert_close(a[0], t[i], atol=1e-5, rtol=1e-5)
        alone.release()
    assert runner.kv_pool.available_size() == runner.kv_pool.num_slots


@pytest.mark.parametrize("layout", ["rings", "pool"])
def test_compiled_decode_equals_eager_without_recompiles(make_gemma3, layout: str) -> None:
    folder = make_gemma3("softcap")
    prompts = random_prompts([20, 3, 11], 320, seed=1)
    eager = ManualBatch(make_runner(folder, compile=False, buckets=(4,), rings=layout == "rings"), prompts)
    eager_seqs = eager.decode(DECODE_STEPS)
    torch._dynamo.reset()
    runner = make_runner(folder, compile=True, buckets=(4,), rings=layout == "rings")
    assert runner.graphs.compiled and set(runner.graphs.compile_seconds) == {4}
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = ManualBatch(runner, prompts)
        assert compiled.decode(DECODE_STEPS) == eager_seqs
        for e, c in zip(eager.step_logits, compiled.step_logits):
            torch.testing.assert_close(c, e, atol=1e-4, rtol=1e-4)
    assert runner.graphs.steps_per_bucket[4] == DECODE_STEPS


@pytest.mark.parametrize("cache", [False, True], ids=["rings-no-cache", "pool-prefix-cache"])
def test_engine_matches_transformers_and_reuses_rows(make_gemma3, cache: bool) -> None:
    """Through the scheduler: 16-token prefill chunks, 6 requests over 2 rows (so rows, and rings, are reused by
    later requests and decode batches mix lengths), greedy tokens equal transformers'. With the prefix cache (window
    layers in the token pool) a shared prefix is reused, window layers included; without it, recomputed."""
    folder = make_gemma3("window")
    hf = hf_gemma3(folder)
    core = tiny_engine(folder, max_running_requests=2, decode_buckets=(1, 2), disable_prefix_cache=not cache)
    assert (core.scheduler.kvm.cache is not None) == cache and (core.runner.window_pool is None) == cache
    prompts = random_prompts([40, 5, 23, 40, 9, 17], hf.config.vocab_size, seed=6)
    prompts[3] = prompts[0][:30] + prompts[3][30:]  # a shared prefix
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    streams = Driver(core).run([Arrival(i // 2, f"r{i}", p, params) for i, p in enumerate(prompts)])
    assert_idle_and_empty(core)
    for i, prompt in enumerate(prompts):
        got = streams[(f"r{i}", 0)].token_ids
        assert got == hf_logits(hf, prompt + got[:-1], len(prompt)).argmax(-1).tolist()
    assert run_solo(core, prompts[2], params).token_ids == streams[("r2", 0)].token_ids
    assert (core.kvm.stats.hit_tokens >= 29) == cache  # request 3 found request 0's first 30 tokens cached


def test_hf_config(make_gemma3) -> None:
    checkpoint = open_checkpoint(str(make_gemma3("window")))
    cfg = checkpoint.config
    assert cfg.architecture == "gemma3" and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.max_position_embeddings == 256, "the window does not cap a Gemma 3's context"
    assert cfg.rope_theta == 100_000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.local_rope_theta == 1_000.0 and cfg.query_scale == pytest.approx(24**-0.5)
    folder = make_gemma3("window")
    tok = load_tokenizer(str(folder))
    assert tok.convert_tokens_to_ids("<end_of_turn>") in cfg.eos_token_ids
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.parametrize("option,message", [({"attn_logit_softcapping": 50.0}, "soft-capping"),
                                            ({"hidden_activation": "relu"}, "hidden_activation"),
                                            ({"use_bidirectional_attention": True}, "bidirectional")])
def test_unsupported_options_are_refused(tmp_path: Path, option: dict[str, Any], message: str) -> None:
    folder = write_tiny_gemma3(tmp_path / "odd", **option)
    with pytest.raises(UnsupportedModelError, match=message):
        open_checkpoint(str(folder))


def test_gguf_round_trip(make_gemma3, tmp_path: Path) -> None:
    """llama.cpp's defaults (every 6th layer global, local base 10000, query scale 1/sqrt(head_dim)) read back as
    the HF config; norms come back without the stored 1; same logits; the chat template and <end_of_turn> carried."""
    folder = make_gemma3("gguf_shape")
    path = write_gemma3_gguf(folder, tmp_path / "g.gguf")
    gguf, hf = open_checkpoint(str(path)), open_checkpoint(str(folder))
    cfg = gguf.config
    assert cfg.window_layers == (0, 1, 2, 3, 4)
    assert cfg == dataclasses.replace(hf.config, name="g", rms_norm_eps=cfg.rms_norm_eps)  # float32 in the file
    want = load_file(folder / "model.safetensors")
    got = dict(gguf.tensors())
    assert set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, atol=1e-7, rtol=0)
    assert gguf_chat_template(path) == load_tokenizer(str(folder)).chat_template
    assert load_tokenizer(str(folder)).convert_tokens_to_ids("<end_of_turn>") in cfg.eos_token_ids
    prompts = random_prompts(PROMPTS[:3], cfg.vocab_size)
    ours = ManualBatch(make_runner(path, compile=False), prompts)
    ref = ManualBatch(make_runner(folder, compile=False), prompts)
    assert ours.decode(8) == ref.decode(8)
    for a, b in zip([ours.prefill_logits, *ours.step_logits], [ref.prefill_logits, *ref.step_logits]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_gguf_layer_pattern_and_quantized_weights(make_gemma3, tmp_path: Path) -> None:
    """A Q8_0 file stays quantized and decodes as its dequantized self; a per-layer pattern array is honoured."""
    folder = make_gemma3("gguf_shape")
    path = write_gemma3_gguf(folder, tmp_path / "q8_0.gguf", qtype=GGMLQuantizationType.Q8_0)
    native = make_runner(path, compile=False)
    weights = quantized_weights(native.model)
    assert {"layers.0.qkv_proj", "layers.0.gate_up_proj", "layers.5.down_proj"} <= set(weights)
    config = EngineConfig(model=str(path), dtype="float32", quantization="none", max_total_tokens=4096,
                          max_running_requests=4, decode_buckets=(1, 2, 4), disable_compile=True)
    dense = ModelRunner(config, open_checkpoint(str(path)))
    prompts = random_prompts([20, 3, 11], native.model_config.vocab_size, seed=2)
    ours, ref = ManualBatch(native, prompts), ManualBatch(dense, prompts)
    ours.decode(DECODE_STEPS)
    ref.decode(DECODE_STEPS)
    # int8 activations in the decode linears (ember::linear_gguf), through 6 layers: cosine 0.99983 measured
    assert_greedy_close([ours.prefill_logits, *ours.step_logits], [ref.prefill_logits, *ref.step_logits], 0.999)
    patterned = write_gemma3_gguf(folder, tmp_path / "pattern.gguf", pattern=[True, False] * 3)
    assert open_checkpoint(str(patterned)).config.window_layers == (0, 2, 4)
    assert open_checkpoint(str(write_gemma3_gguf(folder, tmp_path / "p3.gguf", pattern=3))).config.window_layers == (
        0, 1, 3, 4)


def test_prepared_config_builds_the_same_model(make_gemma3, tmp_path: Path) -> None:
    """The compile cache's copy of the config (ember.json + the HF config for the scaled global rope)."""
    folder = make_gemma3("window")
    cfg = open_checkpoint(str(folder)).config
    prepared = PreparedModel(tmp_path / "cache", folder)
    prepared.save_config(cfg)
    again = prepared.config()
    assert again == cfg
    a, b = model_on_meta(cfg, 64), model_on_meta(again, 64)
    for name in ("rope_cos", "rope_sin", "local_cos", "local_sin", "embed_scale"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert not torch.equal(a.rope_cos, a.local_cos)


@pytest.mark.parametrize("rings", [True, False], ids=["rings", "pool"])
def test_retraction_recomputes_into_fresh_rings(make_gemma3, rings: bool) -> None:
    """A pool too small for everyone's output: requests are retracted (their rows, and so their rings, go to others)
    and recomputed (with the prefix cache: from what is still cached), and every output is still the uninterrupted
    one."""
    folder = make_gemma3("window")
    prompts = random_prompts([12, 30, 7, 21, 16, 9], 320, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    solo_core = tiny_engine(folder, disable_prefix_cache=rings)
    solos = [run_solo(solo_core, p, params).token_ids for p in prompts]
    core = tiny_engine(folder, max_total_tokens=120 if rings else 200, max_running_requests=4,
                       decode_buckets=(1, 2, 4), disable_prefix_cache=rings)
    streams = Driver(core, pin_new_token_ratio=0.0).run([Arrival(0, f"r{i}", p, params) for i, p in enumerate(prompts)])
    assert core.scheduler.stats.retractions > 0
    assert_idle_and_empty(core)
    for i, want in enumerate(solos):
        assert streams[(f"r{i}", 0)].token_ids == want


def test_speculation_drafts_through_the_window_layers_in_the_token_pool(make_gemma3) -> None:
    """Window layers in the token pool give every draft row its own slots, so window models draft: the output with
    speculation (every proposal verified) and the prefix cache equals rings with neither."""
    folder = make_gemma3("window")
    prompts = [p * 3 for p in random_prompts([9, 13, 7], 320, seed=12)]  # repeated phrases: the drafter has material
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    arrivals = [Arrival(i, f"r{i}", p, params) for i, p in enumerate(prompts)]
    want = Driver(tiny_engine(folder, disable_prefix_cache=True)).run(arrivals)
    core = tiny_engine(folder, speculative="ngram")
    assert core.speculator is not None and core.runner.window_pool is None
    core.speculator.planner.cost = lambda rows: 1.0 if rows <= 8 else None  # type: ignore[method-assign]
    got = Driver(core).run(arrivals)
    assert_idle_and_empty(core)
    assert {k: s.token_ids for k, s in got.items()} == {k: s.token_ids for k, s in want.items()}
    assert core.speculator.stats.accepted > 0


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_speculation_drafts_on_rings(make_gemma3, compiled: bool) -> None:
    """Rings (the prefix cache off) keep num_speculative_tokens spare entries, so a verify step's drafts never wrap
    onto a position an earlier row still reads: every proposal verified, greedy and seeded outputs equal speculation
    off's, with sequences many windows long."""
    folder = make_gemma3("window")
    prompts = [p * 3 for p in random_prompts([9, 13, 7, 11], 320, seed=12)]  # repeated phrases: the drafter has material
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    seeded = SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=30, ignore_eos=True)
    arrivals = [Arrival(i, f"r{i}", p, seeded if i % 2 else greedy) for i, p in enumerate(prompts)]
    # One 8-row bucket: every step, drafted or not, runs one compiled graph (one compile, not four).
    settings: dict[str, Any] = dict(disable_prefix_cache=True, disable_compile=not compiled,
                                    num_speculative_tokens=5, decode_buckets=(8,))
    want = Driver(tiny_engine(folder, **settings)).run(arrivals)
    core = tiny_engine(folder, speculative="ngram", **settings)
    pool = core.runner.window_pool
    assert core.speculator is not None and pool is not None
    assert pool.ring == WINDOW + 5 and pool.k[0].shape[0] == 8 * (WINDOW + 5) + 1
    core.speculator.planner.cost = lambda rows: 1.0 if rows <= 8 else None  # type: ignore[method-assign]
    with torch._dynamo.config.patch(error_on_recompile=compiled):
        got = Driver(core).run(arrivals)
    assert_idle_and_empty(core)
    assert {k: s.token_ids for k, s in got.items()} == {k: s.token_ids for k, s in want.items()}
    assert core.speculator.stats.accepted > 10
    assert all(len(p) + 30 > 2 * (WINDOW + 5) for p in prompts)  # every ring wrapped
    if compiled:
        assert core.runner.graphs.steps_per_bucket == {0: 0, 8: core.scheduler.stats.decode_steps}
