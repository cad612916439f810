"""engine.loader: HF folders (single and sharded), GGUF files (tiny round trips and the real SmolLM2), tokenizers."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig

from conftest import MakeTinyModel, SmolLM2Oracle
from engine.loader import (
    SUPPORTED_ARCHITECTURES,
    LoadedCheckpoint,
    ModelConfig,
    UnsupportedModelError,
    default_model_path,
    load_tokenizer,
    model_config_from_hf,
    open_checkpoint,
)
from tiny_gguf import write_tiny_gguf
from tiny_models import LLAMA3_ROPE, TINY_ARCHS

# (tiny arch, ModelConfig.architecture, attention_bias, qk_norm)
EXPECTED = {
    "llama": ("llama", False, False),
    "llama3": ("llama", False, False),
    "mistral": ("mistral", False, False),
    "qwen2": ("qwen2", True, False),
    "qwen3": ("qwen3", False, True),
}


def _tensors(path: Path | str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in open_checkpoint(str(path)).tensors():
        assert name not in out, f"{name} yielded twice"
        out[name] = t
    return out


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in got.items():
        assert t.shape == want[name].shape and torch.equal(t, want[name]), name


# ---- HF folders ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_hf_tensors_equal_the_models_state_dict(make_tiny_model: MakeTinyModel, arch: str) -> None:
    folder = make_tiny_model(arch)
    state = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    _assert_same_tensors(_tensors(folder), state)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_hf_config_fields(make_tiny_model: MakeTinyModel, arch: str) -> None:
    folder = make_tiny_model(arch)
    cfg = open_checkpoint(str(folder)).config
    architecture, bias, qk_norm = EXPECTED[arch]
    tok = load_tokenizer(str(folder))
    assert (cfg.architecture, cfg.attention_bias, cfg.qk_norm) == (architecture, bias, qk_norm)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (len(tok), 64, 128, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 256 and not cfg.tie_word_embeddings
    assert cfg.eos_token_ids == (tok.eos_token_id,) and cfg.bos_token_id == tok.bos_token_id
    assert cfg.name == folder.name
    if arch == "llama3":
        assert cfg.rope_theta == LLAMA3_ROPE["rope_theta"]
        assert cfg.rope_scaling == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    else:
        assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    # hf_config rides along for the oracle but takes no part in equality or repr.
    assert cfg.hf_config is not None and cfg.hf_config.model_type == architecture
    assert cfg == dataclasses.replace(cfg, hf_config=None) and "hf_config" not in repr(cfg)


def test_hf_sharded_folder(make_tiny_model: MakeTinyModel) -> None:
    folder = make_tiny_model("qwen2", max_shard_size="100KB")
    shards = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()
    assert len(set(shards)) > 1 and not (folder / "model.safetensors").exists()
    _assert_same_tensors(_tensors(folder), AutoModelForCausalLM.from_pretrained(folder).state_dict())


def test_hf_tied_embeddings(make_tiny_model: MakeTinyModel) -> None:
    folder = make_tiny_model("llama", tie_word_embeddings=True)
    assert open_checkpoint(str(folder)).config.tie_word_embeddings
    got = _tensors(folder)
    assert "lm_head.weight" not in got
    state = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert torch.equal(got["model.embed_tokens.weight"], state["lm_head.weight"])


def test_generation_config_eos_ids_are_merged(make_tiny_model: MakeTinyModel, tmp_path: Path) -> None:
    folder = shutil.copytree(make_tiny_model("llama"), tmp_path / "m")
    eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, eos, 9]}))
    assert open_checkpoint(str(folder)).config.eos_token_ids == (eos, 7, 9)


def test_sliding_window_caps_the_context(make_tiny_model: MakeTinyModel) -> None:
    assert open_checkpoint(str(make_tiny_model("mistral", sliding_window=64))).config.max_position_embeddings == 64
    unused = make_tiny_model("qwen2", sliding_window=64, use_sliding_window=False)
    assert open_checkpoint(str(unused)).config.max_position_embeddings == 256


def test_transformers_4_style_rope_attributes() -> None:
    # A stand-in for a transformers 4.x config, which has rope_theta / rope_scaling and no rope_parameters.
    old = SimpleNamespace(
        architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6,
        max_position_embeddings=32, rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0},
        eos_token_id=[3, 4], bos_token_id=1, tie_word_embeddings=True,
    )
    cfg = model_config_from_hf(old, "old")  # type: ignore[arg-type]
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.head_dim == 4 and cfg.eos_token_ids == (3, 4) and cfg.tie_word_embeddings


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as err:
        open_checkpoint(str(tmp_path))
    assert isinstance(err.value, ValueError) and "GPT2LMHeadModel" in str(err.value)
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):  # no `architectures`: named by model_type
        model_config_from_hf(GPT2Config(), "gpt2")


def test_unsupported_rope_type() -> None:
    cfg = LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    cfg.architectures = ["LlamaForCausalLM"]
    with pytest.raises(UnsupportedModelError, match="yarn"):
        model_config_from_hf(cfg, "x")


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        open_checkpoint(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(LlamaConfig(architectures=["LlamaForCausalLM"]).to_json_string())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        list(open_checkpoint(str(tmp_path)).tensors())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        open_checkpoint(str(tmp_path / "pytorch_model.bin"))


def test_tiny_tokenizer_round_trip_and_chat_template(make_tiny_model: MakeTinyModel) -> None:
    tok = load_tokenizer(str(make_tiny_model("qwen3")))
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert tok.decode(ids) == "Hello world"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ---- GGUF: tiny round trips through llama.cpp's conventions --------------------------------------------------

GGUF_CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    # The GGUF stores llama3 rope only as per-frequency factors; our reading assumes Llama 3.x's constants.
    "llama3": ("llama3", {"rope_parameters": {**LLAMA3_ROPE, "original_max_position_embeddings": 8192},
                          "max_position_embeddings": 16384}),
}


@pytest.mark.parametrize("case", GGUF_CASES)
def test_gguf_round_trip(make_tiny_model: MakeTinyModel, tmp_path: Path, case: str) -> None:
    arch, overrides = GGUF_CASES[case]
    folder = make_tiny_model(arch, **overrides)
    gguf_path = write_tiny_gguf(folder, tmp_path / f"{case}.gguf", eot_token_id=5)
    checkpoint = open_checkpoint(str(gguf_path))
    hf_cfg = open_checkpoint(str(folder)).config
    cfg = checkpoint.config
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps)  # GGUF stores it as float32
    assert cfg.name == case
    assert cfg == dataclasses.replace(
        hf_cfg, name=case, rms_norm_eps=cfg.rms_norm_eps, eos_token_ids=hf_cfg.eos_token_ids + (5,)
    )
    want = load_file(folder / "model.safetensors")
    got = dict(checkpoint.tensors())
    _assert_same_tensors(got, want)
    _assert_same_tensors(dict(checkpoint.tensors()), want)  # a second pass re-reads the file


def test_gguf_rope_freqs_that_are_not_llama3_are_refused(make_tiny_model: MakeTinyModel, tmp_path: Path) -> None:
    # original_max_position_embeddings 64 yields factors our Llama 3.x reading cannot reproduce.
    gguf_path = write_tiny_gguf(make_tiny_model("llama3"), tmp_path / "odd.gguf")
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        open_checkpoint(str(gguf_path))


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    w = GGUFWriter(path, "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*llama, qwen2, qwen3"):
        open_checkpoint(str(path))


# ---- the real SmolLM2 GGUF against transformers ------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_checkpoint() -> LoadedCheckpoint:
    return open_checkpoint(None)  # seconds: the GGUF header holds the whole tokenizer


@pytest.mark.slow
def test_smollm2_tensors_match_transformers(
    smollm2_hf_fp32: SmolLM2Oracle, smollm2_checkpoint: LoadedCheckpoint
) -> None:
    model, _, gguf_path = smollm2_hf_fp32
    assert Path(default_model_path()) == gguf_path
    state = model.state_dict()
    got = dict(smollm2_checkpoint.tensors())
    # Tied embeddings: the file has no output.weight, so lm_head is not yielded.
    assert sorted(got) == sorted(set(state) - {"lm_head.weight"})
    for name, t in got.items():
        assert t.dtype == torch.float32
        torch.testing.assert_close(t, state[name], msg=name)


@pytest.mark.slow
def test_smollm2_config(smollm2_hf_fp32: SmolLM2Oracle, smollm2_checkpoint: LoadedCheckpoint) -> None:
    model, tok, gguf_path = smollm2_hf_fp32
    cfg: ModelConfig = smollm2_checkpoint.config
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("llama", 30, 9, 3, 64)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (49152, 576, 1536)
    assert cfg.tie_word_embeddings and cfg.rope_scaling is None and cfg.rope_theta == 100000.0
    assert cfg.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),) and cfg.bos_token_id == 1
    assert cfg.max_position_embeddings == 8192 and cfg.name == gguf_path.stem
    assert model.config.num_hidden_layers == cfg.num_layers and model.config.head_dim == cfg.head_dim


@pytest.mark.slow
def test_smollm2_tokenizer(smollm2_hf_fp32: SmolLM2Oracle) -> None:
    _, tok, _ = smollm2_hf_fp32
    ids = tok.encode("Hello", add_special_tokens=False)
    assert ids and tok.decode(ids) == "Hello"
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
