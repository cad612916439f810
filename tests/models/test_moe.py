"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers eager fp32, on tiny random models whose
every expert is routed to: prefill and decode logits, compiled == eager, batch-mate independence, GGUF round trips
(F32 and Q8_0 experts), quantization at load, the prepared copy, and the grouped op against a per-token loop."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from engine.config import EngineConfig
from engine.loader import UnsupportedModelError, model_config_from_hf, open_checkpoint
from engine.loader.prepared import PreparedModel
from engine.model.moe import sparse_layers
from engine.model_runner import ModelRunner
from engine.ops.moe import moe_experts
from engine.quant.module import QuantizedWeight
from engine_helpers import ManualBatch, assert_greedy_close, random_prompts
from tiny_gguf import add_weight, finish, gguf_name, llama_cpp_permute, shape_writer
from tiny_models import tiny_tokenizer

EXPERTS, TOP_K = 8, 2
LENGTHS = [7, 19, 3, 12]
DECODE_STEPS = 16
# name -> (config class, kwargs): 3 Qwen3-MoE variants (norm_topk_prob both ways, a dense layer among sparse ones)
VARIANTS: dict[str, tuple[type, dict[str, Any]]] = {
    "qwen3_moe": (Qwen3MoeConfig, dict(num_experts=EXPERTS, moe_intermediate_size=32, norm_topk_prob=True,
                                       num_hidden_layers=2)),
    "qwen3_moe_unnormed_dense1": (Qwen3MoeConfig, dict(num_experts=EXPERTS, moe_intermediate_size=32,
                                                       norm_topk_prob=False, num_hidden_layers=3, mlp_only_layers=[1])),
    "mixtral": (MixtralConfig, dict(num_local_experts=EXPERTS, intermediate_size=32, num_hidden_layers=2,
                                    sliding_window=None)),
}


def write_tiny_moe(folder: Path, variant: str, seed: int = 0) -> Path:
    cls, kwargs = VARIANTS[variant]
    tok = tiny_tokenizer()
    cfg = cls(vocab_size=len(tok), hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts_per_tok=TOP_K,
              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
              **({"intermediate_size": 128} if cls is Qwen3MoeConfig else {}), **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):  # decisive routing: top-k near-ties are rare
                p.normal_(0.0, 0.5)
        model.get_output_embeddings().weight.mul_(8.0)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory):
    built: dict[str, Path] = {}

    def make(variant: str) -> Path:
        if variant not in built:
            built[variant] = write_tiny_moe(tmp_path_factory.mktemp(variant) / variant, variant)
        return built[variant]

    return make


def _runner(path: Path, *, compile: bool = False, buckets: tuple[int, ...] = (1, 2, 4), quantization: str = "auto",
            cache: Path | None = None) -> ModelRunner:
    config = EngineConfig(model=str(path), dtype="float32", quantization=quantization, max_total_tokens=4096,
                          max_running_requests=4, decode_buckets=buckets, disable_compile=not compile,
                          compile_cache_dir=str(cache) if cache else None)
    return ModelRunner(config, open_checkpoint(str(path)), prepared=PreparedModel(cache, path) if cache else None)


def _hf(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, experts_implementation="eager").eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(tiny_moe, variant: str) -> None:
    folder = tiny_moe(variant)
    hf = _hf(folder)
    runner = _runner(folder)
    cfg = runner.model_config
    assert cfg.num_experts == EXPERTS and cfg.num_experts_per_tok == TOP_K
    assert cfg.moe_layers == ((0, 2) if "dense1" in variant else (0, 1))
    assert [layer.moe is None for layer in runner.model.layers] == [i not in cfg.moe_layers
                                                                     for i in range(cfg.num_layers)]
    batch = ManualBatch(runner, random_prompts(LENGTHS, hf.config.vocab_size))
    seqs = batch.decode(DECODE_STEPS)
    routed: list[set[int]] = [set() for _ in cfg.moe_layers]
    with torch.no_grad():
        for i, seq in enumerate(seqs):
            out = hf(torch.tensor([seq]), output_router_logits=True)
            for chosen, logits in zip(routed, out.router_logits):  # one [tokens, E] per sparse layer
                chosen.update(logits.topk(TOP_K, dim=-1).indices.flatten().tolist())
            ref, n = out.logits[0], LENGTHS[i]
            torch.testing.assert_close(batch.prefill_logits[i], ref[n - 1], atol=2e-5, rtol=1e-5)
            for step, logits in enumerate(batch.step_logits):
                torch.testing.assert_close(logits[i], ref[n + step], atol=2e-5, rtol=1e-5)
            assert seq[n:] == [int(ref[n - 1 + k].argmax()) for k in range(DECODE_STEPS + 1)]
    assert all(chosen == set(range(EXPERTS)) for chosen in routed), "every expert of every sparse layer is used"


@pytest.mark.parametrize("variant", ["qwen3_moe_unnormed_dense1", "mixtral"])
def test_compiled_decode_equals_eager_without_recompiles(tiny_moe, variant: str) -> None:
    folder = tiny_moe(variant)
    prompts = random_prompts([9, 2, 14], 320, seed=1)
    eager = ManualBatch(_runner(folder), prompts)
    eager_seqs = eager.decode(DECODE_STEPS)
    runner = _runner(folder, compile=True, buckets=(1, 4))  # fullgraph=True: the grouped experts are one op node
    assert runner.graphs.compiled and set(runner.graphs.compile_seconds) == {1, 4}
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = ManualBatch(runner, prompts)
        assert compiled.decode(DECODE_STEPS) == eager_seqs  # batch of 3 in the 4-bucket
        for e, c in zip(eager.step_logits, compiled.step_logits):
            torch.testing.assert_close(c, e, atol=1e-5, rtol=1e-5)
        compiled.release()
        alone = ManualBatch(runner, prompts[:1])
        assert alone.decode(3) == [eager_seqs[0][: len(prompts[0]) + 4]]
    assert runner.graphs.steps_per_bucket[4] == DECODE_STEPS and runner.graphs.steps_per_bucket[1] == 3


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_stacked_expert_names_load_too(tiny_moe, tmp_path: Path, variant: str) -> None:
    """transformers 5.x's in-memory names (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]), which
    save_pretrained converts back to per-expert names, load like those."""
    folder = tiny_moe(variant)
    stacked = tmp_path / variant
    shutil.copytree(folder, stacked)
    state = _hf(folder).state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    save_file({k: v.contiguous() for k, v in state.items()}, stacked / "model.safetensors")
    prompts = random_prompts([9, 4], 320, seed=6)
    assert torch.equal(ManualBatch(_runner(stacked), prompts).prefill_logits,
                       ManualBatch(_runner(folder), prompts).prefill_logits)


def test_output_independent_of_batch_mates_and_padding(tiny_moe) -> None:
    runner = _runner(tiny_moe("qwen3_moe_unnormed_dense1"))
    prompts = random_prompts([6, 15, 4], 320, seed=3)
    together = ManualBatch(runner, prompts)  # 3 rows padded to the 4-bucket; experts see other tokens beside them
    joint = together.decode(DECODE_STEPS)
    together.release()
    for i, p in enumerate(prompts):
        alone = ManualBatch(runner, [p])
        assert alone.decode(DECODE_STEPS)[0] == joint[i]
        alone.release()
    assert runner.kv_pool.available_size() == runner.kv_pool.num_slots


def test_grouped_experts_equal_a_per_token_loop() -> None:
    """ember::moe_experts (each active expert once over its tokens) against the plain per-token definition."""
    g = torch.Generator().manual_seed(0)
    e, h, i, t, k = 6, 32, 16, 9, 2
    x = torch.randn(t, h, generator=g)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[:, 0] = ids[:, 0] % 3  # some experts unused
    weights = torch.rand(t, k, generator=g)
    ref = torch.zeros(t, h)
    for r in range(t):
        for s in range(k):
            gt, up = (gate_up[ids[r, s]] @ x[r]).chunk(2)
            ref[r] += weights[r, s] * (down[ids[r, s]] @ (torch.nn.functional.silu(gt) * up))
    out = moe_experts(x, ids, weights, gate_up, None, None, down, None, None, i)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(torch.ops.ember.moe_experts(x, ids, weights, gate_up, None, None, down, None, None, i),
                               out, atol=0, rtol=0)


# ---- GGUF ---------------------------------------------------------------------------------------------------


def write_moe_gguf(folder: Path, out: Path, qtype: T | None = None, per_expert: bool = False) -> Path:
    """The folder as llama.cpp's converter writes it: `qwen3moe`, or Mixtral as `llama` with expert_count and Q/K
    permuted; experts stacked into ffn_{gate,up,down}_exps [E, ...] (per_expert: the old per-expert Mixtral
    tensors blk.N.ffn_gate.E.weight). qtype: experts (and the other 2-D weights, not the router) quantized."""
    cfg = AutoConfig.from_pretrained(folder)
    mixtral = cfg.model_type == "mixtral"
    arch = "llama" if mixtral else "qwen3moe"
    w = shape_writer(out, arch, folder.name, cfg)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_expert_count(cfg.num_local_experts if mixtral else cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if mixtral:
        w.add_rope_dimension_count(cfg.head_dim)
    else:
        w.add_key_length(cfg.head_dim)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)

    def add(name: str, t: torch.Tensor) -> None:
        add_weight(w, name, t.float().numpy(), None if "ffn_gate_inp" in name else qtype)  # the router stays F32

    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in load_file(folder / "model.safetensors").items():
        parts = name.split(".")
        if ".experts." in name:  # model.layers.N.<mlp|block_sparse_moe>.experts.E.<proj>.weight
            proj = {"w1": "gate", "w3": "up", "w2": "down"}.get(parts[6], parts[6].removesuffix("_proj"))
            experts.setdefault((int(parts[2]), proj), {})[int(parts[5])] = t
        elif name.endswith(".gate.weight"):
            add(f"blk.{parts[2]}.ffn_gate_inp.weight", t)
        else:
            if mixtral and ".q_proj." in name:
                t = llama_cpp_permute(t, cfg.num_attention_heads)
            elif mixtral and ".k_proj." in name:
                t = llama_cpp_permute(t, cfg.num_key_value_heads)
            add(gguf_name(name), t)
    for (layer, proj), by_expert in experts.items():
        stack = torch.stack([by_expert[e] for e in range(len(by_expert))])
        if per_expert:
            for e in range(stack.shape[0]):
                add(f"blk.{layer}.ffn_{proj}.{e}.weight", stack[e])
        else:
            add(f"blk.{layer}.ffn_{proj}_exps.weight", stack)
    return finish(w, out)


@pytest.mark.parametrize("variant, per_expert", [("qwen3_moe", False), ("mixtral", False), ("mixtral", True)],
                         ids=["qwen3moe", "mixtral-as-llama", "mixtral-per-expert-tensors"])
def test_gguf_round_trip(tiny_moe, tmp_path: Path, variant: str, per_expert: bool) -> None:
    folder = tiny_moe(variant)
    path = write_moe_gguf(folder, tmp_path / f"{variant}.gguf", per_expert=per_expert)
    from_gguf, from_hf = _runner(path), _runner(folder)
    cfg = from_gguf.model_config
    assert cfg.architecture == from_hf.model_config.architecture
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
            cfg.moe_layers) == (EXPERTS, TOP_K, 32, True, (0, 1))
    prompts = random_prompts(LENGTHS, cfg.vocab_size, seed=2)
    a, b = ManualBatch(from_gguf, prompts), ManualBatch(from_hf, prompts)
    assert a.decode(4) == b.decode(4)
    for x, y in zip([a.prefill_logits, *a.step_logits], [b.prefill_logits, *b.step_logits]):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_gguf_quantized_experts_stay_quantized(tiny_moe, tmp_path: Path) -> None:
    path = write_moe_gguf(tiny_moe("qwen3_moe"), tmp_path / "q8.gguf", qtype=T.Q8_0)
    native, exact = _runner(path, quantization="auto"), _runner(path, quantization="none")
    for moe in sparse_layers(native.model):
        for w in (moe.gate_up_proj, moe.down_proj):
            assert isinstance(w, QuantizedWeight) and w.sources() == ["Q8_0"]
            assert w.parts[0].blocks.shape[0] == EXPERTS  # one stack: the file's blocks per expert
        assert isinstance(moe.gate, torch.Tensor), "the router stays dense"
    prompts = random_prompts([5, 23], native.model_config.vocab_size, seed=4)
    a, b = ManualBatch(native, prompts), ManualBatch(exact, prompts)
    a.decode(8)
    b.decode(8)
    # the attention linears take int8 activations in decode steps (ember::linear_gguf): near-ties may tip
    assert_greedy_close([a.prefill_logits, *a.step_logits], [b.prefill_logits, *b.step_logits], 0.9999)


def test_quantized_at_load_and_prepared_copy(tiny_moe, tmp_path: Path) -> None:
    folder = tiny_moe("qwen3_moe_unnormed_dense1")
    first = _runner(folder, quantization="int8", cache=tmp_path / "cache")
    second = _runner(folder, quantization="int8", cache=tmp_path / "cache")  # from the prepared copy
    dense = _runner(folder, quantization="none")
    assert second.model_config.moe_layers == (0, 2)
    for moe in sparse_layers(second.model):
        assert isinstance(moe.gate_up_proj, QuantizedWeight) and moe.gate_up_proj.sources() == ["int8"]
    prompts = random_prompts([11, 4], first.model_config.vocab_size, seed=5)
    p1, p2, pd = (ManualBatch(r, prompts).prefill_logits for r in (first, second, dense))
    assert torch.equal(p1, p2)
    assert torch.nn.functional.cosine_similarity(p1, pd, dim=-1).min() > 0.999


def test_unsupported_moe_architecture_is_refused() -> None:
    cfg = Qwen2MoeConfig(architectures=["Qwen2MoeForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="Qwen3MoeForCausalLM.*MixtralForCausalLM"):
        model_config_from_hf(cfg, name="x")
