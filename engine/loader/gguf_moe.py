"""Mixture-of-experts GGUF files: llama.cpp's `qwen3moe`, and Mixtral, which llama.cpp writes as `llama` with
`llama.expert_count` > 0.

Tensors (gguf constants MODEL_TENSOR.FFN_GATE_INP / FFN_*_EXP): `blk.N.ffn_gate_inp.weight` is the router [E, hidden];
`blk.N.ffn_gate_exps.weight`, `ffn_up_exps` ([E, inter, hidden] in torch order) and `ffn_down_exps` ([E, hidden,
inter]) stack the experts (llama.cpp's converter torch.stacks the HF experts, Mixtral's w1/w3/w2 as gate/up/down);
older Mixtral files have one `blk.N.ffn_gate.E.weight` (and up, down) per expert. They are yielded per expert under
the names transformers' save_pretrained writes (model.layers.N.mlp.experts.E.gate_proj.weight, ...), so the model
loads both sources one way (engine/model/moe.py). A quantized expert of a type Ember's kernels run stays quantized
(one GGUFTensor of the file's bytes per expert, stacked again at load); other types are dequantized. Expert rows are never
permuted: llama.cpp permutes only attn_q / attn_k.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from transformers import MixtralConfig, PretrainedConfig

from engine.quant.gguf_tensor import NATIVE_GGUF_TYPES, AnyQuantized, GGUFTensor

_ROUTER = re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight")
_STACKED = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_PER_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def _metadata(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def moe_gguf_config(cfg: PretrainedConfig, reader: GGUFReader, arch: str) -> PretrainedConfig:
    """The transformers config of a MoE file with what transformers does not read from it; `cfg` unchanged for a
    dense file. Mixtral: transformers reads a `llama` file as Llama, so it becomes a MixtralConfig here."""
    experts = _metadata(reader, f"{arch}.expert_count")
    if not experts:
        return cfg
    names = {t.name for t in reader.tensors}
    expert_ffn = _metadata(reader, f"{arch}.expert_feed_forward_length")
    used = int(_metadata(reader, f"{arch}.expert_used_count"))
    if arch == "llama":
        fields = {k: v for k, v in cfg.to_dict().items()
                  if k not in ("model_type", "architectures", "transformers_version")}
        if expert_ffn:
            fields["intermediate_size"] = int(expert_ffn)
        return MixtralConfig(**fields, num_local_experts=int(experts), num_experts_per_tok=used)
    # qwen3moe. transformers does not map expert_feed_forward_length (moe_intermediate_size would be the class
    # default); the expert tensors' shape says it too.
    if not expert_ffn:
        gate = next(t for t in reader.tensors if _STACKED.fullmatch(t.name) and "gate" in t.name)
        expert_ffn = int(gate.shape[1])
    cfg.moe_intermediate_size = int(expert_ffn)
    cfg.num_experts, cfg.num_experts_per_tok = int(experts), used
    norm = _metadata(reader, f"{arch}.expert_weights_norm")
    if norm is not None:  # else transformers' GGUF default for qwen3_moe (True, as llama.cpp's qwen3moe.cpp computes)
        cfg.norm_topk_prob = bool(norm)
    # llama.cpp's qwen3moe has no dense layers; a file that carries some (dense ffn_gate, no router) still reads.
    cfg.mlp_only_layers = [i for i in range(cfg.num_hidden_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    return cfg


def is_moe_tensor(name: str) -> bool:
    return bool(_ROUTER.fullmatch(name) or _STACKED.fullmatch(name) or _PER_EXPERT.fullmatch(name))


def moe_tensors(t: ReaderTensor, keep_quantized: bool, widened: dict[str, list[str]],
                ) -> Iterator[tuple[str, torch.Tensor | AnyQuantized]]:
    """(HF name, tensor) for a router (always dense fp32) or for each expert of an expert tensor."""
    if m := _ROUTER.fullmatch(t.name):
        yield f"model.layers.{m[1]}.mlp.gate.weight", torch.from_numpy(_dense(t))
        return
    if m := _PER_EXPERT.fullmatch(t.name):  # one expert, 2-D
        layer, proj, experts = m[1], m[2], [int(m[3])]
        stacked = False
    else:
        m = _STACKED.fullmatch(t.name)
        assert m is not None, t.name
        layer, proj, experts, stacked = m[1], m[2], range(int(t.shape[-1])), True
    if keep_quantized and t.tensor_type in NATIVE_GGUF_TYPES:
        for i, e in enumerate(experts):
            raw = t.data[i] if stacked else t.data  # copied out of the read-only map, one expert at a time
            yield _expert_name(layer, e, proj), GGUFTensor(torch.from_numpy(np.array(raw)), t.tensor_type,
                                                             int(t.shape[0]))
        return
    if keep_quantized:
        widened.setdefault(t.tensor_type.name, []).append(t.name)
    values = _dense(t)
    for i, e in enumerate(experts):
        yield _expert_name(layer, e, proj), torch.from_numpy(np.array(values[i] if stacked else values))


def _expert_name(layer: str, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{_PROJ[proj]}.weight"


def _dense(t: ReaderTensor) -> np.ndarray:
    """fp32, in torch's dimension order (GGUF lists dimensions innermost first), writeable (a copy of the map)."""
    values = dequantize(t.data, t.tensor_type)
    expected = tuple(int(d) for d in reversed(t.shape))
    if values.shape != expected:
        raise ValueError(f"GGUF tensor {t.name}: dequantized shape {values.shape}, expected {expected}")
    return np.array(values, dtype=np.float32)
