"""Write a tiny HF folder as a .gguf file the way llama.cpp's converter does (F32 tensors, no tokenizer vocab).

An independent re-statement of the converter's conventions, for round-trip tests of engine.loader.gguf_file:
GGUF tensor names, llama's Q/K row permutation, llama3's rope_freqs tensor, tied embeddings as a missing
output.weight.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file
from transformers import AutoConfig, PretrainedConfig

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: half-split rope rows -> interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name)
    assert m is not None, hf_name
    return f"blk.{m[1]}.{_HF_TO_GGUF[m[2]]}.{m[3]}"


def llama3_rope_factors(theta: float, head_dim: int, scaling: dict[str, float]) -> np.ndarray:
    """llama.cpp LlamaModel.generate_extra_tensors for rope_type llama3."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def shape_writer(out: Path, arch: str, name: str, cfg: PretrainedConfig) -> GGUFWriter:
    """A GGUFWriter holding the keys every converted checkpoint has: its name, the layer shape, the norm epsilon and
    the vocabulary size. Callers add their architecture's rope, tokenizer and special-token keys."""
    w = GGUFWriter(out, arch)
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    return w


# Where each K-quant block keeps its fp16 super-block scales (d, and dmin for Q4_K / Q5_K).
_K_FP16_FIELDS = {GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q5_K: (0, 2),
                  GGMLQuantizationType.Q6_K: (208,)}


def random_k_blocks(values: np.ndarray, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """Random K-quant blocks for a weight of `values`' shape (the gguf package cannot quantize to K-quants): random
    bytes with positive fp16 super-block scales near 2^-12 (and Q6_K's sub-scales 1..32), so every weight stays
    well below 1 like a trained one.
    A random model all the same: tests compare two ways of serving the same file, never the source weights."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = int(np.prod(values.shape[:-1])), values.shape[-1]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for off in _K_FP16_FIELDS[qtype]:
        d = np.exp2(rng.uniform(-13, -11, raw.shape[:2])).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    if qtype == GGMLQuantizationType.Q6_K:  # its 16 int8 sub-scales: 1..32, the magnitudes of the 6-bit ones
        raw[:, :, 192:208] = rng.integers(1, 33, (*raw.shape[:2], 16), dtype=np.uint8)
    return raw.reshape(*values.shape[:-1], cols // block * size)


def add_weight(w: GGUFWriter, name: str, values: np.ndarray, qtype: GGMLQuantizationType | None) -> None:
    """The tensor as it is, or quantized to `qtype` when it is a weight matrix (or a stack of them); K-quants are
    random blocks of the same shape (random_k_blocks)."""
    if qtype is not None and values.ndim >= 2:
        if qtype in _K_FP16_FIELDS:
            data = random_k_blocks(values, qtype, seed=sum(name.encode()))
        elif qtype == GGMLQuantizationType.BF16:
            data = torch.from_numpy(values).to(torch.bfloat16).view(torch.uint8).numpy()  # round to nearest even
        else:
            data = quantize(values, qtype)
        w.add_tensor(name, data, raw_dtype=qtype)
    else:
        w.add_tensor(name, values)


def finish(w: GGUFWriter, out: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_tiny_gguf(hf_folder: Path, out: Path, eot_token_id: int | None = None,
                    qtype: GGMLQuantizationType | None = None) -> Path:
    """Convert `hf_folder` (a tests.tiny_models folder) to `out`; mistral is written as llama, like llama.cpp.
    qtype: store every 2-D weight quantized to that type (gguf's own quantizer), as llama-quantize would."""
    cfg = AutoConfig.from_pretrained(hf_folder)
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[cfg.model_type]
    w = shape_writer(out, arch, hf_folder.name, cfg)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch == "llama":
        w.add_rope_dimension_count(cfg.head_dim)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    if eot_token_id is not None:
        w.add_eot_token_id(eot_token_id)
    if cfg.rope_parameters.get("rope_type") == "llama3":
        factors = llama3_rope_factors(cfg.rope_parameters["rope_theta"], cfg.head_dim, cfg.rope_parameters)
        w.add_tensor("rope_freqs.weight", factors)
    for name, t in load_file(hf_folder / "model.safetensors").items():
        if arch == "llama" and ".q_proj." in name:
            t = llama_cpp_permute(t, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            t = llama_cpp_permute(t, cfg.num_key_value_heads)
        add_weight(w, gguf_name(name), t.float().numpy(), qtype)
    return finish(w, out)
