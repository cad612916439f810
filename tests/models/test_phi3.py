"""Phi-3 / Phi-3.5 / Phi-4-mini (Phi3ForCausalLM, GGUF `phi3`) on tiny random models against transformers eager fp32.

What Phi-3 adds to the Llama path: fused qkv_proj / gate_up_proj in the checkpoint, LongRoPE (short factors up to
original_max_position_embeddings, long ones past it, chosen per forward as transformers does), partial rotary
(Phi-4-mini: 0.75), a sliding window that caps the context, <|end|> as end of turn. The reference decodes with
transformers' own KV cache, one forward per token as `generate` does: that is where LongRoPE's switch happens.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from gguf import GGMLQuantizationType
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, Phi3Config, PreTrainedModel

from engine.config import EngineConfig
from engine.loader import UnsupportedModelError, load_tokenizer, open_checkpoint
from engine.loader.prepared import PreparedModel
from engine.model.weights import model_on_meta
from engine.forward_batch import ForwardBatch, PrefillChunk
from engine.model_runner import ModelRunner
from engine.quant.module import quantized_weights
from engine.sampling_params import SamplingParams
from engine_helpers import ManualBatch, hf_model, make_runner, random_prompts
from scheduler_helpers import Arrival, Driver, tiny_engine
from tiny_gguf import add_weight, finish, shape_writer
from tiny_models import tiny_tokenizer

PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
DECODE_STEPS = 16
SHORT = [7, 19, 3, 12]  # with the decode steps, all within original_max_position_embeddings = 64 below
CROSSING = [40, 9, 25]  # original 32: past it from the prompt on, never, and during decode (positions 25 -> 41)


def _longrope(rotary_dim: int) -> dict[str, Any]:
    # Exact in float32, as a GGUF stores them; distinct per frequency so a mix-up of the two sets shows.
    half = rotary_dim // 2
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.125 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)]}


CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "longrope": {"rope_scaling": _longrope(16), "original_max_position_embeddings": 64},
    "longrope_past_original": {"rope_scaling": _longrope(16), "original_max_position_embeddings": 32},
    "partial_rotary": {"rope_scaling": _longrope(12), "original_max_position_embeddings": 32,
                       "partial_rotary_factor": 0.75},
    "partial_rotary_plain_rope": {"partial_rotary_factor": 0.5},
}
PROMPTS = {"plain": SHORT, "longrope": SHORT, "longrope_past_original": CROSSING, "partial_rotary": CROSSING,
           "partial_rotary_plain_rope": SHORT}


def write_tiny_phi3(folder: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A random fp32 Phi3ForCausalLM (2 layers, hidden 64, 4 heads of 16, 2 KV heads) with Phi-3's chat specials
    and template; generation_config ends at <|end|> or <|endoftext|>, as Phi-3's does."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]})
    tok.chat_template = PHI3_TEMPLATE
    kwargs: dict[str, Any] = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.pad_token_id, pad_token_id=tok.pad_token_id,
    )
    kwargs.update(overrides)
    cfg = Phi3Config(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
        model.get_output_embeddings().weight.mul_(8.0)  # clear greedy margins
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    model.save_pretrained(folder)
    end = tok.convert_tokens_to_ids("<|end|>")
    GenerationConfig(eos_token_id=[end, tok.pad_token_id], bos_token_id=tok.bos_token_id).save_pretrained(folder)
    return folder


def write_phi3_gguf(hf_folder: Path, out: Path, qtype: GGMLQuantizationType | None = None,
                    factors: tuple[str, ...] = ("long", "short")) -> Path:
    """`hf_folder` as llama.cpp's converter (Phi3MiniModel) writes it: fused attn_qkv and ffn_up (gate then up),
    no Q/K permutation, LongRoPE as rope_factors_long/short tensors, sliding_window 0 for none; the token texts but
    eos = <|endoftext|> only, as many Phi-3 GGUFs have."""
    cfg = AutoConfig.from_pretrained(hf_folder)
    tok = load_tokenizer(str(hf_folder))
    rope = cfg.rope_parameters
    w = shape_writer(out, "phi3", hf_folder.name, cfg)
    w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings", cfg.original_max_position_embeddings))
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(cfg.sliding_window or 0)
    w.add_token_list([tok.convert_ids_to_tokens(i) for i in range(len(tok))])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(tok.pad_token_id)
    if rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        for kind in factors:
            w.add_tensor(f"rope_factors_{kind}.weight", torch.tensor(rope[f"{kind}_factor"]).float().numpy())
    names = {"input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for name, t in load_file(hf_folder / "model.safetensors").items():
        if name in top:
            gguf_name = top[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, _, kind = rest.rpartition(".")
            gguf_name = f"blk.{layer}.{names[module]}.{kind}"
        add_weight(w, gguf_name, t.float().numpy(), qtype)
    return finish(w, out)


@pytest.fixture(scope="module")
def make_phi3(tmp_path_factory: pytest.TempPathFactory):
    built: dict[str, Path] = {}

    def make(case: str, **extra: Any) -> Path:
        key = case + repr(sorted(extra.items()))
        if key not in built:
            built[key] = write_tiny_phi3(tmp_path_factory.mktemp(case) / f"phi3-{case}", **CASES[case], **extra)
        return built[key]

    return make


def hf_incremental_logits(hf: PreTrainedModel, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """[1 + len(continuation), V]: the prompt's last logits, then one decode step per continuation token, with
    transformers' KV cache (LongRoPE picks its factors per forward, so a single forward over the whole sequence
    is not the same model past original_max_position_embeddings)."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        rows = [out.logits[0, -1]]
        for t in continuation:
            out = hf(torch.tensor([[t]]), cache=out.cache, use_cache=True)
            rows.append(out.logits[0, -1])
    return torch.stack(rows)


@pytest.mark.parametrize("case", CASES)
def test_prefill_and_decode_match_transformers(make_phi3, case: str) -> None:
    folder = make_phi3(case)
    hf = hf_model(folder)
    runner = make_runner(folder, compile=False)
    prompts = random_prompts(PROMPTS[case], hf.config.vocab_size)
    batch = ManualBatch(runner, prompts)  # all requests in one prefill and one decode batch
    seqs = batch.decode(DECODE_STEPS)
    for i, (prompt, seq) in enumerate(zip(prompts, seqs)):
        ref = hf_incremental_logits(hf, prompt, seq[len(prompt):-1])
        torch.testing.assert_close(batch.prefill_logits[i], ref[0], atol=2e-5, rtol=1e-5)
        for step, logits in enumerate(batch.step_logits):
            torch.testing.assert_close(logits[i], ref[1 + step], atol=2e-5, rtol=1e-5)
        assert seq[len(prompt):] == [int(r.argmax()) for r in ref]


def test_longrope_switch_is_exercised(make_phi3) -> None:
    """The crossing prompts really test the long factors: transformers' single forward over a sequence past the
    original context (long factors for every token) differs from the incremental one we match above."""
    hf = hf_model(make_phi3("longrope_past_original"))
    prompt = random_prompts(CROSSING, hf.config.vocab_size)[2]  # 25 tokens, decode crosses 32
    cont = random_prompts([12], hf.config.vocab_size, seed=5)[0]
    incremental = hf_incremental_logits(hf, prompt, cont)
    with torch.no_grad():
        one_forward = hf(torch.tensor([prompt + cont])).logits[0, len(prompt) - 1:]
    assert (incremental[:7] - one_forward[:7]).abs().max() > 1e-2  # all positions < 32: short vs long factors
    runner = make_runner(make_phi3("longrope_past_original"), compile=False)
    assert runner.model.rope_long_after == 32 and runner.model.rope_cos_long is not None


def test_no_long_table_when_the_context_stays_within_the_original(make_phi3) -> None:
    folder = make_phi3("longrope", max_position_embeddings=64)  # == original: never switches
    assert make_runner(folder, compile=False).model.rope_long_after is None


def test_output_independent_of_batch_mates_and_padding(make_phi3) -> None:
    runner = make_runner(make_phi3("partial_rotary"), compile=False)
    prompts = random_prompts(CROSSING, runner.model_config.vocab_size, seed=3)
    together = ManualBatch(runner, prompts)  # 3 rows padded to the 4-bucket; one long, one short, one crossing
    joint = together.decode(DECODE_STEPS)
    together.release()
    for i, p in enumerate(prompts):
        alone = ManualBatch(runner, [p])
        assert alone.decode(DECODE_STEPS)[0] == joint[i]
        torch.testing.assert_close(alone.prefill_logits[0], together.prefill_logits[i], atol=1e-5, rtol=1e-5)
        for a, t in zip(alone.step_logits, together.step_logits):
            torch.testing.assert_close(a[0], t[i], atol=1e-5, rtol=1e-5)
        alone.release()
    assert runner.kv_pool.available_size() == runner.kv_pool.num_slots


def test_compiled_decode_equals_eager_without_recompiles(make_phi3) -> None:
    folder = make_phi3("partial_rotary")
    prompts = random_prompts(CROSSING, 320, seed=1)
    eager = ManualBatch(make_runner(folder, compile=False, buckets=(4,)), prompts)
    eager_seqs = eager.decode(DECODE_STEPS)
    runner = make_runner(folder, compile=True, buckets=(4,))  # fullgraph=True: the table switch traces
    assert runner.graphs.compiled and set(runner.graphs.compile_seconds) == {4}
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = ManualBatch(runner, prompts)
        assert compiled.decode(DECODE_STEPS) == eager_seqs  # batch of 3 runs in the 4-bucket
        for e, c in zip(eager.step_logits, compiled.step_logits):
            torch.testing.assert_close(c, e, atol=1e-4, rtol=1e-4)
        compiled.release()
    assert runner.graphs.steps_per_bucket[4] == DECODE_STEPS


def test_hf_config_and_fused_weights(make_phi3) -> None:
    folder = make_phi3("partial_rotary", sliding_window=48)
    checkpoint = open_checkpoint(str(folder))
    cfg = checkpoint.config
    assert cfg.architecture == "phi3" and cfg.rotary_dim == 12 and cfg.head_dim == 16
    assert cfg.max_position_embeddings == 48, "the sliding window caps the context"
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "longrope"
    names = {n for n, _ in checkpoint.tensors()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    tok = load_tokenizer(str(folder))
    end = tok.convert_tokens_to_ids("<|end|>")
    assert end in cfg.eos_token_ids and tok.pad_token_id in cfg.eos_token_ids
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>\nHi<|end|>\n<|assistant|>\n"


@pytest.mark.parametrize("case", ["partial_rotary", "plain"])
def test_gguf_round_trip(make_phi3, tmp_path: Path, case: str) -> None:
    folder = make_phi3(case, sliding_window=200) if case == "plain" else make_phi3(case)
    path = write_phi3_gguf(folder, tmp_path / f"{case}.gguf")
    gguf, hf = open_checkpoint(str(path)), open_checkpoint(str(folder))
    end = load_tokenizer(str(folder)).convert_tokens_to_ids("<|end|>")
    cfg = gguf.config
    assert cfg == dataclasses.replace(hf.config, name=case, rms_norm_eps=cfg.rms_norm_eps)
    assert end in cfg.eos_token_ids, "<|end|> ends a turn although the file's eos is <|endoftext|>"
    want = load_file(folder / "model.safetensors")
    got = dict(gguf.tensors())
    assert set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, atol=0, rtol=0)
    prompts = random_prompts(PROMPTS[case][:3], cfg.vocab_size)
    ours = ManualBatch(make_runner(path, compile=False), prompts)
    ref = ManualBatch(make_runner(folder, compile=False), prompts)
    assert ours.decode(8) == ref.decode(8)
    for a, b in zip([ours.prefill_logits, *ours.step_logits], [ref.prefill_logits, *ref.step_logits]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_gguf_fused_weights_stay_quantized(make_phi3, tmp_path: Path) -> None:
    folder = make_phi3("partial_rotary")
    path = write_phi3_gguf(folder, tmp_path / "q8_0.gguf", qtype=GGMLQuantizationType.Q8_0)
    native = make_runner(path, compile=False)
    weights = quantized_weights(native.model)
    assert {"layers.0.qkv_proj", "layers.0.gate_up_proj", "layers.1.down_proj"} <= set(weights)
    assert {s for w in weights.values() for s in w.sources()} == {"Q8_0"}
    config = EngineConfig(model=str(path), dtype="float32", quantization="none", max_total_tokens=4096,
                          max_running_requests=4, decode_buckets=(1, 2, 4), disable_compile=True)
    dense = ModelRunner(config, open_checkpoint(str(path)))
    prompts = random_prompts(CROSSING, native.model_config.vocab_size, seed=2)
    ours, ref = ManualBatch(native, prompts), ManualBatch(dense, prompts)
    assert ours.decode(DECODE_STEPS) == ref.decode(DECODE_STEPS)
    # int8 activations in the decode linears (ember::linear_gguf): within 1 % of the max logit (0.5 % measured)
    for a, b in zip([ours.prefill_logits, *ours.step_logits], [ref.prefill_logits, *ref.step_logits]):
        assert (a - b).abs().max() <= 1e-2 * b.abs().max()


def test_gguf_with_one_rope_factor_tensor_is_refused(make_phi3, tmp_path: Path) -> None:
    path = write_phi3_gguf(make_phi3("longrope"), tmp_path / "odd.gguf", factors=("long",))
    with pytest.raises(UnsupportedModelError, match="LongRoPE needs both"):
        open_checkpoint(str(path))


@pytest.mark.parametrize("case", ["partial_rotary", "partial_rotary_plain_rope"])
def test_prepared_config_keeps_longrope_and_partial_rotary(make_phi3, tmp_path: Path, case: str) -> None:
    """The compile cache's copy of the config (ember.json + the HF config for LongRoPE) builds the same rope."""
    path = write_phi3_gguf(make_phi3(case), tmp_path / f"{case}.gguf")
    cfg = open_checkpoint(str(path)).config
    prepared = PreparedModel(tmp_path / "cache", path)
    prepared.save_config(cfg)
    again = prepared.config()
    assert again == cfg
    a, b = model_on_meta(cfg, 128), model_on_meta(again, 128)
    for name in ("rope_cos", "rope_sin", "rope_cos_long", "rope_sin_long"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or torch.equal(x, y)
    assert a.rope_cos.shape == (128, cfg.rotary_dim) and a.rope_long_after == b.rope_long_after


def test_old_su_rope_config_reads_as_longrope(make_phi3, tmp_path: Path) -> None:
    """Phi-3's first 128k configs: rope_scaling {"type": "su", ...} and a top-level original_max_position_embeddings
    (transformers 5.x itself refuses them; Ember reads them as the longrope they are)."""
    folder = make_phi3("longrope_past_original")
    old = tmp_path / "phi3-su"
    shutil.copytree(folder, old)
    raw = json.loads((old / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope["rope_theta"]
    raw["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    raw["rope_scaling"] = {"type": "su", "long_factor": rope["long_factor"], "short_factor": rope["short_factor"]}
    (old / "config.json").write_text(json.dumps(raw))
    got, want = open_checkpoint(str(old)).config, open_checkpoint(str(folder)).config
    assert got == dataclasses.replace(want, name="phi3-su")


def test_chunked_prefill_picks_the_factors_of_the_whole_prompt(make_phi3) -> None:
    """A 40-token prompt (original context 32) prefilled in two chunks of 20: both take the long factors, as
    transformers' single forward over the prompt does; the first chunk alone would not pass 32."""
    folder = make_phi3("partial_rotary")
    hf = hf_model(folder)
    runner = make_runner(folder, compile=False)
    prompt = random_prompts([40], hf.config.vocab_size, seed=4)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    row = runner.req_pool.allocate()
    assert row is not None
    slots = runner.kv_pool.allocate(40)
    assert slots is not None
    runner.forward(ForwardBatch.prefill([PrefillChunk(row, 0, prompt[:20], slots[:20], fill_len=40)]))
    logits = runner.forward(ForwardBatch.prefill([PrefillChunk(row, 20, prompt[20:], slots[20:], fill_len=40)]))[0]
    torch.testing.assert_close(logits, ref, atol=2e-5, rtol=1e-5)
    # Without the whole prompt's length the first chunk takes the short factors: a different model.
    runner.forward(ForwardBatch.prefill([PrefillChunk(row, 0, prompt[:20], slots[:20])]))
    plain = runner.forward(ForwardBatch.prefill([PrefillChunk(row, 20, prompt[20:], slots[20:])]))[0]
    assert (plain - ref).abs().max() > 1e-2


def test_engine_with_chunked_prefill_matches_transformers_generate(make_phi3) -> None:
    """Through the scheduler (16-token prefill chunks, the three requests batched together): greedy tokens equal
    transformers' incremental greedy decoding, for a prompt past the original context, one within it and one whose
    decoding crosses it."""
    folder = make_phi3("partial_rotary")
    hf = hf_model(folder)
    prompts = random_prompts(CROSSING, hf.config.vocab_size, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=True)
    streams = Driver(tiny_engine(folder, max_running_requests=4)).run(
        [Arrival(0, f"r{i}", p, params) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        got = streams[(f"r{i}", 0)]
        ref = hf_incremental_logits(hf, prompt, got.token_ids[:-1]).log_softmax(-1)
        assert got.token_ids == [int(r.argmax()) for r in ref]  # greedy, one forward per token, as generate() runs
        want = [float(r[t]) for r, t in zip(ref, got.token_ids)]
        assert [lp.logprob for lp in got.logprobs] == pytest.approx(want, abs=1e-4)
