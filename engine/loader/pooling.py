"""Which pooling a model's embeddings use (/v1/embeddings), read from its folder the way sentence-transformers does.

An embedding model published for sentence-transformers names its pooling in `modules.json` (the Pooling module's
folder, usually `1_Pooling`) and that folder's `config.json` (`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`).
Decoder embedding models (Qwen3-Embedding, e5-mistral, gte-Qwen) pool the last token, whose causal attention has
seen the whole input; a model that says nothing is mean-pooled, the common default for a plain decoder.
"""
from __future__ import annotations

import json
from pathlib import Path

from engine.request import Pooling


def model_pooling(model: str | None, choice: str = "auto") -> Pooling:
    if choice in ("mean", "last"):
        return choice  # type: ignore[return-value]
    folder = Path(model) if model else None
    if folder is None or not folder.is_dir():
        return "mean"
    pooling_dir = folder / "1_Pooling"
    modules = folder / "modules.json"
    if modules.is_file():
        try:
            for module in json.loads(modules.read_text()):
                if str(module.get("type", "")).endswith("Pooling"):
                    pooling_dir = folder / str(module.get("path", "1_Pooling"))
        except (ValueError, AttributeError):
            pass
    cfg = pooling_dir / "config.json"
    if cfg.is_file():
        try:
            modes = json.loads(cfg.read_text())
        except ValueError:
            return "mean"
        if modes.get("pooling_mode_lasttoken"):
            return "last"
    return "mean"
