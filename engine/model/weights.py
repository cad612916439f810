"""Build the decoder on the meta device and fill it from a checkpoint's (HF name, tensor) stream.

Each parameter is materialised once, at its first shard, in the target dtype; checkpoint tensors are
copied in one at a time, so peak memory is the model plus one source tensor. Quantized tensors in the stream
(a GGUF's own formats) are kept as they come and become a QuantizedWeight once every shard of their fused
weight has arrived; `quantize` turns the dense linear weights into int8/int4 ones after loading.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from engine.loader.model_config import ModelConfig
from engine.model.gemma3 import Gemma3Model
from engine.model.llama import LINEAR_WEIGHTS, LlamaModel
from engine.model.moe import ExpertLoader, pack_experts, quantize_experts
from engine.model.rope import inv_freq_and_scaling, longrope_long_table, rope_table
from engine.ops.linear import can_pack, pack_linear_weight
from engine.quant.format import QuantizedTensor
from engine.quant.gguf_tensor import AnyQuantized, GGUFTensor
from engine.quant.module import QuantizedWeight, dequantize_any, install
from engine.quant.quantize import quantize_weight

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# HF name inside a layer -> (our parameter, which shard of a fused weight or None)
_LAYER_MAP: dict[str, tuple[str, str | None]] = {
    "input_layernorm.weight": ("input_layernorm", None),
    "post_attention_layernorm.weight": ("post_attention_layernorm", None),
    "self_attn.q_proj.weight": ("qkv_proj", "q"),
    "self_attn.k_proj.weight": ("qkv_proj", "k"),
    "self_attn.v_proj.weight": ("qkv_proj", "v"),
    "self_attn.qkv_proj.weight": ("qkv_proj", None),  # phi3 stores them fused, in our order
    "self_attn.q_proj.bias": ("qkv_bias", "q"),
    "self_attn.k_proj.bias": ("qkv_bias", "k"),
    "self_attn.v_proj.bias": ("qkv_bias", "v"),
    "self_attn.o_proj.weight": ("o_proj", None),
    "self_attn.q_norm.weight": ("q_norm", None),
    "self_attn.k_norm.weight": ("k_norm", None),
    "mlp.gate_proj.weight": ("gate_up_proj", "gate"),
    "mlp.up_proj.weight": ("gate_up_proj", "up"),
    "mlp.gate_up_proj.weight": ("gate_up_proj", None),  # phi3
    "mlp.down_proj.weight": ("down_proj", None),
    "pre_feedforward_layernorm.weight": ("pre_feedforward_layernorm", None),  # gemma3
    "post_feedforward_layernorm.weight": ("post_feedforward_layernorm", None),
}
_TOP_MAP = {"model.embed_tokens.weight": "embed_tokens", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}


def _shard_range(cfg: ModelConfig, shard: str) -> tuple[int, int]:
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), "gate": (0, inter), "up": (inter, 2 * inter)}[shard]


def model_on_meta(cfg: ModelConfig, max_positions: int) -> LlamaModel:
    """The decoder with meta-device parameters (to be filled) and real rope tables."""
    rope_type = (cfg.rope_scaling or {}).get("rope_type", "default")
    layer_type = "full_attention" if cfg.architecture == "gemma3" else None  # its rope dict is per layer type
    cos, sin = rope_table(*inv_freq_and_scaling(cfg.hf_config, rope_type, cfg.rope_theta, cfg.rotary_dim, layer_type),
                          max_positions)
    if cfg.architecture == "gemma3":
        local = rope_table(*inv_freq_and_scaling(cfg.hf_config, "default", cfg.local_rope_theta, cfg.rotary_dim),
                           max_positions)
        embed_scale = torch.tensor(cfg.hidden_size**0.5)
        with torch.device("meta"):
            return Gemma3Model(cfg, cos, sin, *local, embed_scale)
    rope_long = longrope_long_table(cfg.hf_config, max_positions) if rope_type == "longrope" else None
    with torch.device("meta"):  # parameters only: the rope tables above are real
        return LlamaModel(cfg, cos, sin, rope_long)


_FUSED_SHARDS: dict[str, tuple[str, ...]] = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}


def build_model(
    cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor | AnyQuantized]], dtype: torch.dtype,
    max_positions: int, pack: bool = True, quantize: str | None = None, group: int = 32,
) -> LlamaModel:
    """pack: dense linear weights in the ember::linear_bf16/f32 layout where this CPU runs it (False: plain [N, K]).
    quantize: "int8" or "int4" (with `group`) quantizes every dense linear weight (engine/quant/quantize.py)."""
    model = model_on_meta(cfg, max_positions)
    pending: dict[tuple[nn.Module, str], dict[str | None, AnyQuantized]] = {}
    experts = ExpertLoader(model, dtype)  # routers and experts of the sparse layers (engine/model/moe.py)

    for name, tensor in tensors:
        if experts.take(name, tensor):
            continue
        target: tuple[nn.Module, str, str | None] | None = None
        if name in _TOP_MAP:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # some tied checkpoints store a copy; the embedding is the head
            target = (model, _TOP_MAP[name], None)
        elif (m := _LAYER.fullmatch(name)) and m.group(2) in _LAYER_MAP:
            attr, shard = _LAYER_MAP[m.group(2)]
            if hasattr(model.layers[int(m.group(1))], attr):  # (gemma3's extra norms exist in its layers only)
                target = (model.layers[int(m.group(1))], attr, shard)
        elif name.endswith("rotary_emb.inv_freq"):
            continue
        if target is None:
            raise ValueError(f"unexpected weight {name!r} in checkpoint for architecture {cfg.architecture}")
        module, attr, shard = target
        if isinstance(tensor, (QuantizedTensor, GGUFTensor)):
            pending.setdefault((module, attr), {})[shard] = tensor
            # Placed as soon as its last shard arrives, so the file's blocks of one weight at a time are alive next
            # to the model being built, not the whole file's (a first start held every weight twice at its peak).
            got = set(pending[(module, attr)])
            if got == set(_shard_order(attr, pending[(module, attr)])) and getattr(module, attr).is_meta:
                _place_quantized(cfg, module, attr, pending.pop((module, attr)), dtype)
            continue
        param = getattr(module, attr)
        if param.is_meta:
            param = nn.Parameter(torch.empty(param.shape, dtype=dtype), requires_grad=False)
            setattr(module, attr, param)
        dst = param.data if shard is None else param.data[slice(*_shard_range(cfg, shard))]
        if dst.shape != tensor.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)

    for (module, attr), shards in pending.items():
        _place_quantized(cfg, module, attr, shards, dtype)
    experts.finish()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"checkpoint lacks weights: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if quantize is not None:
        quantize_weights(model, quantize, group)
    if pack and can_pack(dtype):
        pack_weights(model)
    return model.eval()


def _shard_order(attr: str, shards: dict[str | None, AnyQuantized]) -> tuple[str | None, ...]:
    """The shards a quantized weight is installed from, in order: one when stored fused (phi3), else its parts."""
    return (None,) if None in shards else _FUSED_SHARDS.get(attr, (None,))


def _place_quantized(cfg: ModelConfig, module: nn.Module, attr: str, shards: dict[str | None, AnyQuantized],
                     dtype: torch.dtype) -> None:
    """All shards quantized: install them as one QuantizedWeight (in shard order). A fused weight whose other
    shards came dense (an F16 attn_v beside Q4_K attn_q, say) is served dense: its quantized shards are
    dequantized into it."""
    order = _shard_order(attr, shards)
    param = getattr(module, attr)
    if isinstance(param, nn.Parameter) and param.is_meta and set(shards) == set(order):
        parts = [shards[s] for s in order]
        if (sum(p.shape[0] for p in parts), parts[0].shape[1]) != tuple(param.shape):
            raise ValueError(f"quantized {attr} has shape {[p.shape for p in parts]}, expected {tuple(param.shape)}")
        install(module, attr, QuantizedWeight.from_tensors(parts))
        return
    if param.is_meta:
        param = nn.Parameter(torch.empty(param.shape, dtype=dtype), requires_grad=False)
        setattr(module, attr, param)
    for shard, q in shards.items():
        dst = param.data if shard is None else param.data[slice(*_shard_range(cfg, shard))]
        dst.copy_(dequantize_any(q))


def quantize_weights(model: LlamaModel, mode: str, group: int) -> None:
    """Replace each dense linear weight by its int8/int4 form, one at a time (peak: the dense model)."""
    def convert(module: nn.Module, attr: str, head: bool) -> None:
        w = getattr(module, attr)
        if isinstance(w, torch.Tensor):
            install(module, attr, QuantizedWeight.from_tensors([quantize_weight(w.data, mode, group, head)]))

    for layer in model.layers:
        for attr in LINEAR_WEIGHTS:
            convert(layer, attr, head=False)
    convert(model, "embed_tokens" if model.lm_head is None else "lm_head", head=True)
    quantize_experts(model, mode, group)



def pack_weights(model: LlamaModel) -> None:
    """Replace every linear weight by its ember::linear_bf16 layout, one at a time (peak: one extra weight).

    A tied embedding is packed as the head: `engine.ops.linear.embedding` gathers rows from the packed table, so the
    model keeps a single copy of it.
    """
    def repack(module: nn.Module, attr: str) -> None:
        w = getattr(module, attr)
        if not isinstance(w, torch.Tensor):
            return  # quantized: ember::linear_q reads its own format
        packed = pack_linear_weight(w.data)
        setattr(module, attr, nn.Parameter(packed, requires_grad=False))

    for layer in model.layers:
        for attr in LINEAR_WEIGHTS:
            repack(layer, attr)
    repack(model, "embed_tokens" if model.lm_head is None else "lm_head")
    pack_experts(model)
