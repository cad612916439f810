"""Load a single .gguf file: config through transformers, tensors under their HF names: quantized linear weights of
the types Ember's kernels run kept in the file's own blocks (engine/quant/gguf_tensor.py), every other tensor
dequantized to fp32."""
from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from transformers import AutoConfig

from engine.loader.gguf_phi3 import (
    PHI3_BLOCK_NAMES,
    ROPE_FACTOR_TENSORS,
    fix_phi3_config,
    phi3_end_of_turn_ids,
    phi3_q_rows,
)
from engine.loader.gguf_gemma3 import GEMMA3_BLOCK_NAMES, fix_gemma3_config, gemma3_norm_offset
from engine.loader.gguf_moe import is_moe_tensor, moe_gguf_config, moe_tensors
from engine.loader.gguf_pages import release_pages
from engine.loader.model_config import ModelConfig, UnsupportedModelError, model_config_from_hf
from engine.quant.gguf_tensor import NATIVE_GGUF_TYPES, GGUFTensor
from engine.quant.gguf_tensor import AnyQuantized

log = logging.getLogger("ember.loader")

# GGUF `general.architecture` values we read. llama.cpp writes Mistral models as "llama".
GGUF_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "phi3", "qwen3moe", "gemma3")  # Mixtral: llama with
# experts
# llama.cpp's converter permutes the rows of Q and K for these (see _unpermute_rope_rows).
_PERMUTED_QK_ARCHITECTURES: tuple[str, ...] = ("llama",)
_ROPE_FREQS = "rope_freqs.weight"

_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Architectures whose block tensors differ from llama's: its table with their names laid over it.
_ARCH_BLOCK_NAMES: dict[str, dict[str, str]] = {
    "phi3": _BLOCK_NAMES | PHI3_BLOCK_NAMES,
    "gemma3": _BLOCK_NAMES | GEMMA3_BLOCK_NAMES,
}


def read_gguf_config(path: Path, reader: GGUFReader) -> ModelConfig:
    """The file's ModelConfig. Ties embeddings iff the file has no `output.weight` (transformers decides so too)."""
    arch = _metadata(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)} "
            "(mistral GGUFs are written as llama)"
        )
    cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    cfg = moe_gguf_config(cfg, reader, arch)  # experts (engine/loader/gguf_moe.py); dense files unchanged
    # Two things transformers does not read from a GGUF, fixed on `cfg`: it was built just above and is ours
    # alone, and fixing it (not only the ModelConfig) keeps hf_config telling the same story.
    # 1. head_dim: for qwen2/qwen3 it falls back to the config class default (128 for Qwen3), whatever the
    #    file holds. The Q projection's rows are num_heads * head_dim, always.
    q_rows = next((int(t.shape[-1]) for t in reader.tensors if t.name == "blk.0.attn_q.weight"), None)
    if q_rows is None and arch == "phi3":  # fused attn_qkv
        q_rows = phi3_q_rows(reader, cfg.num_attention_heads, cfg.num_key_value_heads)
    if q_rows is None:
        raise UnsupportedModelError(f"{path} has no blk.0.attn_q.weight: not a supported transformer checkpoint")
    cfg.head_dim = q_rows // cfg.num_attention_heads
    if arch == "phi3":  # partial rotary, LongRoPE, sliding window (engine/loader/gguf_phi3.py)
        fix_phi3_config(reader, cfg)
    # 2. rope scaling.
    scaling = _rope_scaling(reader, arch, cfg)
    if arch == "gemma3":  # per-layer-type rope, layer types, query scale (engine/loader/gguf_gemma3.py)
        fix_gemma3_config(reader, cfg, scaling)
    elif scaling is not None:
        cfg.rope_parameters = {**cfg.rope_parameters, **scaling}
    eos = [_metadata(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    if arch == "phi3":
        eos += phi3_end_of_turn_ids(reader)
    mc = model_config_from_hf(cfg, name=path.stem, extra_eos_token_ids=[int(e) for e in eos if e is not None])
    quantized = any(len(t.shape) > 1 and t.tensor_type in NATIVE_GGUF_TYPES for t in reader.tensors)
    return dataclasses.replace(mc, quantized=quantized, sampling_defaults=gguf_sampling_defaults(reader))


# llama.cpp's recommended-sampling keys (gguf-py's Keys.General.SAMPLING_*) -> SamplingParams field names
_GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                  "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                  "general.sampling.penalty_repeat": "repetition_penalty"}


def gguf_sampling_defaults(reader: GGUFReader) -> tuple[tuple[str, float], ...]:
    return tuple((name, float(v)) for key, name in _GGUF_SAMPLING.items()
                 if isinstance(v := _metadata(reader, key), int | float))


def gguf_chat_template(path: Path) -> str | None:
    return _metadata(GGUFReader(path), "tokenizer.chat_template")


class GGUFTensors:
    """The `tensors` callable of a GGUF checkpoint.

    Parsing a GGUF header costs seconds (GGUFReader builds an object per tokenizer string) and the parsed reader
    holds ~170 MB for SmolLM2. So the reader that read the config serves the first iteration and is then
    dropped; a later call parses the file again.
    """

    def __init__(self, path: Path, config: ModelConfig, reader: GGUFReader) -> None:
        self._path = path
        self._config = config
        self._reader: GGUFReader | None = reader

    def __call__(self, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | AnyQuantized]]:
        reader, self._reader = self._reader or GGUFReader(self._path), None
        return iter_gguf_tensors(reader, self._config, keep_quantized)


def iter_gguf_tensors(reader: GGUFReader, config: ModelConfig, keep_quantized: bool = False,
                      ) -> Iterator[tuple[str, torch.Tensor | AnyQuantized]]:
    """Yield (HF parameter name, tensor) one at a time: fp32, dequantized (only the current one is in memory), or
    with keep_quantized, a GGUFTensor (the file's bytes) for each 2-D weight of a type the kernels run (the log
    names the rest)."""
    arch = _metadata(reader, "general.architecture")
    permuted = arch in _PERMUTED_QK_ARCHITECTURES
    widened: dict[str, list[str]] = {}
    # The parsed header is hundreds of MB of Python objects for a 49k-token vocabulary (an array view per token
    # string); only the tensors' entries are needed from here on, so the rest is not kept alive during the load.
    tensors = reader.tensors
    del reader
    for t in tensors:
        if t.name == _ROPE_FREQS or t.name in ROPE_FACTOR_TENSORS:
            continue  # llama3 / LongRoPE factors, already turned into config.rope_scaling
        if is_moe_tensor(t.name):  # routers and experts, per expert (engine/loader/gguf_moe.py)
            yield from moe_tensors(t, keep_quantized, widened)
            release_pages(t.data, t.data_offset, t.n_bytes)
            continue
        hf_name = hf_tensor_name(t.name, arch)
        if keep_quantized and len(t.shape) == 2:
            if t.tensor_type in NATIVE_GGUF_TYPES:
                # A copy out of the read-only memory map (torch refuses to alias it), one tensor at a time.
                q = GGUFTensor(torch.from_numpy(np.array(t.data)), t.tensor_type, int(t.shape[0]))
                release_pages(t.data, t.data_offset, t.n_bytes)
                yield hf_name, _unpermute_quantized(q, hf_name, config) if permuted else q
                continue
            widened.setdefault(t.tensor_type.name, []).append(t.name)
        values = dequantize(t.data, t.tensor_type)
        # GGUF lists dimensions innermost first; the dequantized array is already in torch's (rows, cols) order.
        expected = tuple(int(d) for d in reversed(t.shape))
        if values.shape != expected:
            raise ValueError(f"GGUF tensor {t.name}: dequantized shape {values.shape}, expected {expected}")
        # Copies when the array is still a read-only view of the memory map (unquantized F32 tensors).
        if values.dtype != np.float32 or not values.flags.writeable:
            values = values.astype(np.float32)
        release_pages(t.data, t.data_offset, t.n_bytes)
        tensor = torch.from_numpy(values)
        if arch == "gemma3" and (offset := gemma3_norm_offset(hf_name)):
            tensor = tensor + offset  # stored as 1 + w (engine/loader/gguf_gemma3.py)
        if permuted and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = _unpermute_rope_rows(tensor, config.num_heads)
        elif permuted and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = _unpermute_rope_rows(tensor, config.num_kv_heads)
        yield hf_name, tensor
    for kind, names in widened.items():
        log.info("GGUF %s weights served dequantized (no %s kernel): %s", kind, kind,
                 ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else ""))


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """token_embd.weight -> model.embed_tokens.weight, blk.3.attn_q.bias -> model.layers.3.self_attn.q_proj.bias."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    names = _ARCH_BLOCK_NAMES.get(arch, _BLOCK_NAMES)
    if m is None or m[2] not in names:
        raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no HF counterpart in the supported models")
    return f"model.layers.{m[1]}.{names[m[2]]}.{m[3]}"


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation.

    HF orders each head's rows as two halves [r_0 .. r_{d/2-1} | r_{d/2} .. r_{d-1}] (rotate_half rope);
    llama.cpp interleaves them as pairs (r_0, r_{d/2}, r_1, r_{d/2+1}, ...) for its pairwise rope. So view a
    head as (d/2, 2) and transpose to (2, d/2). Works for weights (rows x cols) and biases (rows).
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _unpermute_quantized(q: GGUFTensor, hf_name: str, config: ModelConfig) -> GGUFTensor:
    """_unpermute_rope_rows for a quantized weight: a row is a run of whole blocks, so the rows move whole."""
    if hf_name.endswith("q_proj.weight"):
        heads = config.num_heads
    elif hf_name.endswith("k_proj.weight"):
        heads = config.num_kv_heads
    else:
        return q
    rows = q.shape[0]
    index = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)
    return q.rows(index)


def _metadata(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _rope_scaling(reader: GGUFReader, arch: str, cfg: Any) -> dict[str, Any] | None:
    """HF-style rope scaling from GGUF metadata, or None for plain rope; raises for variants we can't express."""
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is not None:
        factors = dequantize(freqs.data, freqs.tensor_type).astype(np.float64).reshape(-1)
        return _llama3_scaling_from_factors(factors, cfg.rope_parameters["rope_theta"], cfg.head_dim)
    kind = _metadata(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_metadata(reader, f"{arch}.rope.scaling.factor"))}
    raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported; supported: none, linear, llama3")


def _llama3_factors(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores as rope_freqs for llama3 rope scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def _llama3_scaling_from_factors(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    # The file keeps only the resulting factors. Every Llama 3.x release uses these constants with its own
    # factor (the largest divisor); accept the guess only if it reproduces the stored factors.
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(_llama3_factors(theta, head_dim, scaling), factors, rtol=1e-5):
        raise UnsupportedModelError("GGUF rope_freqs do not match llama3 rope scaling; use the HF checkpoint")
    return scaling
