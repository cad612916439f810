"""Load a HuggingFace model folder: config.json, generation_config.json and safetensors weights (single or sharded)."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

from engine.loader.model_config import ModelConfig, model_config_from_hf

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(folder: Path) -> ModelConfig:
    """The folder's ModelConfig; eos ids merge config.json's and generation_config.json's."""
    cfg = _su_rope_config(folder) or AutoConfig.from_pretrained(folder)
    mc = model_config_from_hf(cfg, name=folder.name, extra_eos_token_ids=_generation_eos_ids(folder))
    return dataclasses.replace(mc, sampling_defaults=generation_sampling_defaults(folder))


# generation_config.json's sampling keys, as SamplingParams names them (vLLM's --generation-config auto reads these).
_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_sampling_defaults(folder: Path) -> tuple[tuple[str, float], ...]:
    """The sampling values generation_config.json sets (absent keys: none). A file that says do_sample false
    means greedy, whatever temperature it also carries (transformers ignores it then)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return ()
    raw = json.loads(path.read_text())
    out = [(k, float(raw[k])) for k in _GENERATION_KEYS if isinstance(raw.get(k), int | float)]
    if raw.get("do_sample") is False and out:
        out = [(k, v) for k, v in out if k != "temperature"] + [("temperature", 0.0)]
    return tuple(out)


def _su_rope_config(folder: Path) -> PretrainedConfig | None:
    """Phi-3's first 128k releases spell LongRoPE "su"; transformers 5.x renames it only after checking the
    longrope keys, which then lack original_max_position_embeddings (a top-level key in those configs). So read
    such a config.json with the new name; None for every other folder."""
    path = folder / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    scaling = raw.get("rope_scaling") or {}
    if "su" not in (scaling.get("type"), scaling.get("rope_type")) or raw.get("model_type") not in CONFIG_MAPPING:
        return None
    raw["rope_scaling"] = {**scaling, "type": "longrope", "rope_type": "longrope"}
    return CONFIG_MAPPING[raw["model_type"]].from_dict(raw)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files, in index order; raises FileNotFoundError naming what was expected."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in dict.fromkeys(weight_map.values())]
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    found = sorted(p.name for p in folder.iterdir())
    raise FileNotFoundError(
        f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors checkpoints are supported); "
        f"found: {found}"
    )


def iter_hf_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, tensor) one at a time, in the checkpoint's dtype.

    Each tensor is read from the memory-mapped file when its turn comes, so the caller can copy it into the
    model and drop it before the next one: the checkpoint never exists twice in memory.
    """
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                # Old checkpoints saved rope's inverse frequencies as a buffer; the engine computes its own.
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                yield name, f.get_tensor(name)


def _generation_eos_ids(folder: Path) -> tuple[int, ...]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)
