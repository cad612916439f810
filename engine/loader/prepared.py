"""A prepared copy of a checkpoint in the compile cache: its config, its tokenizer and the engine's weights in
their final dtype and layout (packed for ember::linear_bf16 where that applies, quantized weights in Ember's format).

Why: opening the embedded SmolLM2 GGUF costs ~10 s before the first weight is read (GGUFReader parses the
header, transformers parses it again for the config and converts the tokenizer) plus ~2 s of dequantization
and packing; a restart reads the prepared copy in well under a second. The entry's name hashes the source's
path, size and modification time and the versions that shape the files, so an edited checkpoint or an upgrade
prepares afresh. Entries are written to a temporary name and renamed, so a crash never leaves half an entry.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from engine.files import write_atomically
from engine.loader import LoadedCheckpoint, load_tokenizer, open_checkpoint
from engine.loader import safetensors_io
from engine.loader.model_config import ModelConfig
from engine.model.llama import LlamaModel
from engine.quant.module import install_from_state, state_info

log = logging.getLogger("ember.loader")

FORMAT = 6  # bump when the prepared files' meaning changes (weight layout, config fields)


def checkpoint_fingerprint(source: Path) -> str:
    """16 hex digits naming a checkpoint's files: their path, names, sizes and modification times."""
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    parts = [f"{FORMAT}|{torch.__version__}|{transformers.__version__}|{source.resolve()}"]
    parts += [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


class PreparedModel:
    """One cache entry: `<cache>/models/<name>-<fingerprint>/` with ember.json, config.json, tokenizer/ and one
    weights-<dtype>[-packed].safetensors per dtype served."""

    def __init__(self, cache_dir: str | Path, source: Path) -> None:
        self.source = source
        self.dir = Path(cache_dir) / "models" / f"{source.stem}-{checkpoint_fingerprint(source)}"

    def config(self) -> ModelConfig | None:
        meta = self.dir / "ember.json"
        if not meta.is_file():
            return None
        fields = json.loads(meta.read_text())
        for name in ("eos_token_ids", "moe_layers", "window_layers"):  # tuples in ModelConfig, lists in JSON
            if name in fields:
                fields[name] = tuple(fields[name])
        if "sampling_defaults" in fields:  # ((name, value), ...): pairs come back from JSON as lists
            fields["sampling_defaults"] = tuple((str(k), float(v)) for k, v in fields["sampling_defaults"])
        # The HF config object only serves rope types other than the default (engine/model/rope.py); parsing it
        # imports transformers' model-config modules, which import dynamo: ~1 s of a short `ember generate`.
        rope_type = (fields.get("rope_scaling") or {}).get("rope_type", "default")
        hf_config = AutoConfig.from_pretrained(self.dir) if rope_type != "default" else None
        return ModelConfig(**fields, hf_config=hf_config)

    def save_config(self, cfg: ModelConfig) -> None:
        def write(tmp: Path) -> None:
            if cfg.hf_config is not None:
                cfg.hf_config.save_pretrained(tmp)
            fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "hf_config"}
            (tmp / "ember.json").write_text(json.dumps(fields, indent=1))

        self._publish(self.dir, write, "ember.json")

    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        folder = self.dir / "tokenizer"
        return AutoTokenizer.from_pretrained(folder) if folder.is_dir() else None

    def save_tokenizer(self, tok: PreTrainedTokenizerBase) -> None:
        self._publish(self.dir / "tokenizer", lambda tmp: tok.save_pretrained(tmp), None)

    def _weights_path(self, dtype: torch.dtype, packed: bool, tag: str) -> Path:
        # tag: the weights' form (EngineConfig.weights_tag: dense, native GGUF formats, int8, int4g32, ...)
        name = f"weights-{str(dtype).removeprefix('torch.')}{'-packed' if packed else ''}-{tag}.safetensors"
        return self.dir / name

    def load_weights(self, model: LlamaModel, dtype: torch.dtype, packed: bool, tag: str) -> bool:
        """Fill a meta-device model from the entry; False when the entry has no weights for this dtype/layout/form
        (the model may then be half-filled: build a new one)."""
        path = self._weights_path(dtype, packed, tag)
        if not path.is_file():
            return False
        # Read into anonymous memory, not mapped: streaming weights from file-backed 4 KiB pages made every decode
        # step slower than on the weights a fresh load allocates (Q4_1 default model, AVX2, one client: 52.7
        # against 72.0 tok/s), and plain reads keep the file's pages out of the resident set (safetensors_io).
        tensors, metadata = safetensors_io.load(path)
        info = json.loads(metadata.get("quantized", "{}"))
        try:
            dense = install_from_state(model, tensors, info)
        except (ValueError, AttributeError):
            dense = {}
        names = {n for n, _ in model.named_parameters()}
        if set(dense) != names:
            log.warning("prepared weights %s do not match the model; preparing again", path)
            return False
        for name, tensor in dense.items():
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, nn.Parameter(tensor, requires_grad=False))
        return True

    def save_weights(self, model: LlamaModel, dtype: torch.dtype, packed: bool, tag: str) -> None:
        tensors = dict(model.state_dict())  # parameters and the quantized weights' buffers (rope tables excluded)
        info = json.dumps(state_info(model))
        write_atomically(self._weights_path(dtype, packed, tag),
                         lambda tmp: safetensors_io.save(tensors, tmp, metadata={"quantized": info}))

    @staticmethod
    def _publish(target: Path, write: Callable[[Path], object], marker: str | None) -> None:
        """Write a folder's files into a temporary sibling, then rename it into place (or merge when it exists)."""
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
        try:
            write(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; a shared cache volume is read by other users
            if not target.exists():
                os.replace(tmp, target)
                return
            for f in tmp.iterdir():  # the entry exists (weights came first): move files in, marker last
                if f.name != marker:
                    os.replace(f, target / f.name)
            if marker:
                os.replace(tmp / marker, target / marker)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def open_cached(model: str | None, prepared: PreparedModel | None) -> LoadedCheckpoint:
    """The checkpoint, its config from the prepared copy when there is one (saved there on a first open)."""
    cached = prepared.config() if prepared is not None else None
    if cached is not None:  # weights are read from the source only if the entry lacks them for this dtype
        return LoadedCheckpoint(cached, lambda keep_quantized=False: open_checkpoint(model).tensors(keep_quantized),
                                quantized_source=cached.quantized)
    checkpoint = open_checkpoint(model)
    if prepared is not None:
        prepared.save_config(checkpoint.config)
    return checkpoint


def tokenizer_cached(model: str | None, prepared: PreparedModel | None) -> PreTrainedTokenizerBase:
    """The tokenizer, from the prepared copy when there is one (saved there on a first load)."""
    tok = prepared.tokenizer() if prepared is not None else None
    if tok is None:
        tok = load_tokenizer(model)
        if prepared is not None:
            prepared.save_tokenizer(tok)
    return tok
