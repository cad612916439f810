"""The loader's error for a readable checkpoint the engine cannot run (its own module: the config readers share it)."""
from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The checkpoint is readable but describes a model the engine cannot run."""
