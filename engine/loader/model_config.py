"""The model's shape, read once from a transformers config: everything the engine needs to build and serve it."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from transformers import PretrainedConfig

from engine.loader.errors import UnsupportedModelError
from engine.loader.gemma_config import gemma_fields, gemma_rope
from engine.loader.moe_config import moe_fields

__all__ = ["ModelConfig", "UnsupportedModelError", "model_config_from_hf", "SUPPORTED_ARCHITECTURES"]

# HF `architectures` value -> our architecture name. The order is the one error messages list.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",  # mixture of experts: engine/model/moe.py
    "MixtralForCausalLM": "mixtral",
    "Gemma3ForCausalLM": "gemma3",  # text-only checkpoints (270M, 1B); sliding-window layers: engine/model/window.py
}
# Configs built from a GGUF file carry no `architectures`, only `model_type`.
_MODEL_TYPES: dict[str, str] = {arch: hf for hf, arch in SUPPORTED_ARCHITECTURES.items()} | {
    "gemma3_text": "Gemma3ForCausalLM"}
# Rope variants the engine implements; anything else would load and then silently compute wrong positions.
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # llama | mistral | qwen2 | qwen3 | phi3 | qwen3_moe | mixtral | gemma3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # HF-style scaling dict with a "rope_type" key ("linear", "llama3" or "longrope") and that type's keys; None = plain
    # rope.
    rope_scaling: dict[str, Any] | None = field(hash=False)
    # For a sliding-window model this is capped at the window: within it full attention is exact.
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections have a bias (always for qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before rope (qwen3)
    eos_token_ids: tuple[int, ...]  # any of these ends a sequence; never empty for the supported models
    bos_token_id: int | None
    name: str  # the served model name: folder name or GGUF file stem
    hf_config: PretrainedConfig | None = field(default=None, compare=False, repr=False, hash=False)
    # Rope turns only the first int(head_dim * this) dims of each head (Phi-4-mini: 0.75); the rest pass through.
    partial_rotary_factor: float = 1.0
    # Mixture of experts (engine/loader/moe_config.py, engine/model/moe.py); no experts = a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is the routed experts; the others stay dense
    # Sliding-window attention (Gemma 3): the layers in `window_layers` see the last `sliding_window` positions
    # (their own included) and keep only those in the KV cache (engine/model/window.py); the others see everything.
    sliding_window: int = 0
    window_layers: tuple[int, ...] = ()
    local_rope_theta: float = 0.0  # rope base of the window layers when it differs from rope_theta (Gemma 3)
    query_scale: float = 0.0  # attention's score scale; 0: head_dim ** -0.5
    final_logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap); 0: none
    # The checkpoint stores weights in quantized types Ember serves as they are (a Q4_K_M GGUF; not a bf16 GGUF
    # or a HF folder): --quantization auto keeps them, and --dtype auto then runs float32 activations.
    quantized: bool = False
    # The model's recommended sampling values (generation_config.json, a GGUF's general.sampling.* keys), by
    # SamplingParams field name: what a request that leaves the field unset gets (server/api/prompts.py).
    # Not in the repr: the saved decode steps are named after repr(ModelConfig), and sampling does not reach a graph.
    sampling_defaults: tuple[tuple[str, float], ...] = field(default=(), compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)  # as transformers rounds it


def model_config_from_hf(
    cfg: PretrainedConfig, name: str, extra_eos_token_ids: Iterable[int] = ()
) -> ModelConfig:
    """Validate a transformers config and read it into a ModelConfig.

    `extra_eos_token_ids` are merged after the config's own (from generation_config.json or GGUF metadata).
    Raises UnsupportedModelError for architectures, activations or rope variants the engine does not run.
    """
    architecture = _architecture(cfg)
    gemma = architecture == "gemma3"
    if not gemma and getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {cfg.hidden_act!r} is not supported; only 'silu'")
    if getattr(cfg, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    rope_theta, rope_scaling = gemma_rope(cfg)[:2] if gemma else _rope(cfg)
    num_heads = int(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size),
        intermediate_size=int(cfg.intermediate_size),
        num_layers=int(cfg.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.rms_norm_eps),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.max_position_embeddings) if gemma else _max_positions(cfg),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        attention_bias=architecture == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
        qk_norm=architecture in ("qwen3", "qwen3_moe", "gemma3"),
        eos_token_ids=_unique_ids(_as_ids(getattr(cfg, "eos_token_id", None)) + tuple(extra_eos_token_ids)),
        bos_token_id=getattr(cfg, "bos_token_id", None),
        name=name,
        hf_config=cfg,
        partial_rotary_factor=_partial_rotary_factor(cfg),
        **moe_fields(cfg, architecture),
        **(gemma_fields(cfg) if gemma else {}),
    )


def _unsupported(value: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"unsupported model architecture {value!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _architecture(cfg: PretrainedConfig) -> str:
    names = getattr(cfg, "architectures", None) or []
    if not names:
        model_type = getattr(cfg, "model_type", "") or "<none>"
        if model_type not in _MODEL_TYPES:
            raise _unsupported(model_type)
        names = [_MODEL_TYPES[model_type]]
    for hf_name in names:
        if hf_name not in SUPPORTED_ARCHITECTURES:
            raise _unsupported(hf_name)
    if len({SUPPORTED_ARCHITECTURES[n] for n in names}) != 1:
        raise UnsupportedModelError(f"config lists several architectures {names}; expected one")
    return SUPPORTED_ARCHITECTURES[names[0]]


def _rope(cfg: PretrainedConfig) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers 5.x `rope_parameters` or the older `rope_theta` / `rope_scaling`."""
    params = getattr(cfg, "rope_parameters", None)
    if params is not None:
        scaling = dict(params)
        if "rope_theta" not in scaling and any(isinstance(v, dict) for v in scaling.values()):
            raise UnsupportedModelError(f"per-layer-type rope parameters are not supported: {params}")
        theta = scaling.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    else:
        theta = getattr(cfg, "rope_theta", 10000.0)
        scaling = dict(getattr(cfg, "rope_scaling", None) or {})
    # Old configs spell the key "type"; normalise to "rope_type".
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **scaling}


def _partial_rotary_factor(cfg: PretrainedConfig) -> float:
    """transformers 5.x keeps it in rope_parameters (Phi-3 always, 1.0 by default); older configs as an attribute."""
    params = getattr(cfg, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    factor = 1.0 if factor is None else float(factor)
    if not 0.0 < factor <= 1.0 or int(_head_dim(cfg) * factor) % 2:
        raise UnsupportedModelError(f"partial_rotary_factor {factor} does not give an even number of rotary dims")
    return factor


def _head_dim(cfg: PretrainedConfig) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _max_positions(cfg: PretrainedConfig) -> int:
    max_positions = int(cfg.max_position_embeddings)
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    # transformers 5.x marks windowed layers in layer_types; older qwen2 configs use a flag; mistral has neither.
    if layer_types is not None:
        windowed = "sliding_attention" in layer_types
    else:
        windowed = bool(getattr(cfg, "use_sliding_window", True))
    if window and windowed and window < max_positions:
        # The engine attends over the whole context; capping the context at the window keeps that exact.
        return int(window)
    return max_positions


def _as_ids(value: int | Iterable[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _unique_ids(ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))
