"""The prefix cache's disk tier: blocks of cached K/V written under the cache directory, read back on a miss,
kept across restarts and shared by replicas on one volume.

- **Blocks.** A cached sequence is cut into blocks of BLOCK_TOKENS tokens from position 0; block j holds the K/V of
  every layer for tokens [j B, (j + 1) B) and is named by a chained hash over the model's identity and all tokens
  up to its end (h_j = sha256(h_{j-1} | tokens of block j)), so a block is found only by a request whose whole
  prefix up to it is the same. The last partial block of a sequence is not stored (recomputing < B tokens).
- **Write-through.** Whenever the prefix cache gains tokens (a prefill chunk is published, a request finishes),
  the complete blocks of that sequence not yet on disk are copied out of the pool on the engine thread and
  written by a writer thread: a crash or a deploy loses nothing that was cached. A full write queue drops blocks
  (it is a cache; the next request rewrites them).
- **Read on a miss.** Admission matches the radix tree first; past the match it looks for the next blocks on disk,
  loads each one found into fresh pool slots and inserts them into the tree, so the request (and every later one)
  reuses them as ordinary cached prefix (engine/kv_manager.py).
- **Safe files.** Written to a temporary name and renamed (atomic on one filesystem), so a reader sees a whole file
  or none; each file carries a header with the identity, the block's tokens and a CRC32 of the payload, checked
  on every read: a torn, foreign or corrupt file is removed, never served. Temporary files of a writer killed
  mid-write are removed at start once they are old.
- **Window layers.** With sliding-window layers in slots of their own (engine/window_slots.py) a block stores the
  token pool's layers, then the window layers'; tokens whose window K/V was already given back store zeros there and
  are listed in the header, and a load gives them no window slot either (so they are never read as K/V).
- **Bounded.** `--kv-disk-cache-size` MiB; past it the least recently used files go (a hit refreshes a file's
  mtime, so replicas sharing the volume agree on recency).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import queue
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.pools import KVPool

log = logging.getLogger("ember.kv_disk")

BLOCK_TOKENS = 64
MAGIC = b"EMBERKV1"
SUFFIX = ".kvb"
WRITE_QUEUE_BLOCKS = 256  # blocks waiting for the writer; more are dropped
STALE_TMP_S = 600.0  # a temporary file this old belongs to a writer that died


@dataclass
class DiskStats:
    hit_blocks: int = 0  # blocks read back into the pool
    hit_tokens: int = 0  # tokens of them not already in the tree
    miss_lookups: int = 0  # admissions that looked for a block past the tree's match and found none
    written_blocks: int = 0
    written_bytes: int = 0
    dropped_blocks: int = 0  # not written: the queue was full
    evicted_files: int = 0  # removed to stay within the size
    bad_files: int = 0  # torn, foreign or corrupt files removed
    bytes: int = 0  # what the tier holds now (as this process last counted)


class DiskKVStore:
    def __init__(self, root: Path, identity: str, capacity_bytes: int, kv: KVPool) -> None:
        self.identity = identity
        self.dir = root / "kv-blocks" / hashlib.sha256(identity.encode()).hexdigest()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity, self.kv = capacity_bytes, kv
        self.stats = DiskStats()
        self._known: set[str] = set()  # blocks this process knows are on disk (a hint: files may go)
        self._queue: queue.Queue[tuple[str, list[int], torch.Tensor, list[int]] | None] = queue.Queue(
            WRITE_QUEUE_BLOCKS)
        self._sweep_tmp()
        self.stats.bytes = sum(size for _, size, _ in self._files())
        self._writer = threading.Thread(target=self._write_loop, name="ember-kv-disk", daemon=True)
        self._writer.start()

    # ---- names -----------------------------------------------------------------------------------------
    def block_names(self, ids: list[int], blocks: int) -> list[str]:
        """The names of the first `blocks` blocks of `ids` (chained: each depends on every token before it)."""
        names, h = [], hashlib.sha256(self.identity.encode()).digest()
        for j in range(blocks):
            h = hashlib.sha256(h + struct.pack(f"<{BLOCK_TOKENS}q", *ids[j * BLOCK_TOKENS : (j + 1) * BLOCK_TOKENS])
                               ).digest()
            names.append(h.hex()[:40])
        return names

    def _path(self, name: str) -> Path:
        return self.dir / (name + SUFFIX)

    # ---- write-through ---------------------------------------------------------------------------------
    def save(self, ids: list[int], slots: torch.Tensor) -> None:
        """Queue the complete blocks of a cached sequence (`slots[i]` holds token i's K/V) not yet on disk."""
        blocks = len(ids) // BLOCK_TOKENS
        for j, name in enumerate(self.block_names(ids, blocks)):
            if name in self._known:
                continue
            self._known.add(name)
            if self._path(name).exists():
                continue
            span = slots[j * BLOCK_TOKENS : (j + 1) * BLOCK_TOKENS]
            # As bytes: the same for every KV dtype (fp8 has no stack kernel; int8 rows carry their scale inside)
            payload = torch.stack([torch.stack((k.view(torch.uint8)[at], v.view(torch.uint8)[at]))
                                   for k, v, at in self._layers(span)])
            # Tokens whose window layers' K/V were given back (engine/window_slots.py) store slot 0's zeros there
            # and are listed, so a load gives them none either.
            absent = [] if self.kv.window is None else (~self.kv.window.present(span)).nonzero().flatten().tolist()
            try:
                self._queue.put_nowait((name, list(ids[j * BLOCK_TOKENS : (j + 1) * BLOCK_TOKENS]), payload, absent))
            except queue.Full:
                self._known.discard(name)
                self.stats.dropped_blocks += 1

    def _layers(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(K buffer, V buffer, rows of `slots` in them) for every layer: the token pool's, then the window layers'
        own slots when they have them."""
        out = [(k, v, slots) for k, v in zip(self.kv.k, self.kv.v)]
        if self.kv.window is not None:
            rows = self.kv.window.map[slots].to(torch.int64)
            out += [(k, v, rows) for k, v in zip(self.kv.window.k, self.kv.window.v)]
        return out

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            name, tokens, payload, absent = item
            try:
                self._write(name, tokens, payload, absent)
            except OSError as exc:  # a full or read-only volume: serving goes on without the tier
                log.warning("KV disk tier: could not write block %s: %s", name, exc)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, name: str, tokens: list[int], payload: torch.Tensor, absent: list[int]) -> None:
        raw = payload.numpy().tobytes()
        header = json.dumps({"identity": self.identity, "tokens": tokens, "dtype": str(self.kv.k[0].dtype),
                             "shape": list(payload.shape), "absent": absent, "crc32": zlib.crc32(raw)}).encode()
        path = self._path(name)
        tmp = path.with_name(f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header + raw)
        os.replace(tmp, path)
        size = path.stat().st_size
        self.stats.written_blocks += 1
        self.stats.written_bytes += size
        self.stats.bytes += size
        if self.stats.bytes > self.capacity:
            self._evict()

    def flush_writes(self) -> None:
        """Wait until every queued block is on disk (tests, shutdown)."""
        self._queue.join()

    # ---- read on a miss --------------------------------------------------------------------------------
    def load(self, ids: list[int], have: int, allocate: Callable[[int], torch.Tensor | None]
             ) -> tuple[int, torch.Tensor]:
        """Read the blocks of `ids` past its first `have` tokens (already in the tree) from disk, as long as they
        are found, into fresh slots from `allocate`: (tokens now covered, the slots of tokens have..covered)."""
        blocks = len(ids) // BLOCK_TOKENS
        first = have // BLOCK_TOKENS
        if first >= blocks:
            return have, torch.empty(0, dtype=torch.int64)
        parts: list[torch.Tensor] = []
        covered = have
        for j, name in enumerate(self.block_names(ids, blocks)[first:], start=first):
            block = self._read(name, ids[j * BLOCK_TOKENS : (j + 1) * BLOCK_TOKENS])
            if block is None:
                break
            payload, absent = block
            skip = covered - j * BLOCK_TOKENS  # the first block may overlap the tree's match
            slots = allocate(BLOCK_TOKENS - skip)
            if slots is None:
                break
            for layer, (k, v, at) in enumerate(self._layers(slots)):
                k.view(torch.uint8)[at] = payload[layer, 0, skip:]
                v.view(torch.uint8)[at] = payload[layer, 1, skip:]
            gone = [i - skip for i in absent if i >= skip]
            if gone and self.kv.window is not None:
                self.kv.window.detach(slots[gone])
            parts.append(slots)
            covered = (j + 1) * BLOCK_TOKENS
            self.stats.hit_blocks += 1
            self.stats.hit_tokens += BLOCK_TOKENS - skip
        if not parts:
            self.stats.miss_lookups += 1
            return have, torch.empty(0, dtype=torch.int64)
        return covered, torch.cat(parts)

    def _read(self, name: str, tokens: list[int]) -> tuple[torch.Tensor, list[int]] | None:
        path = self._path(name)
        try:
            data = path.read_bytes()
        except OSError:
            self._known.discard(name)
            return None
        payload = self._parse(data, tokens)
        if payload is None:
            self.stats.bad_files += 1
            log.warning("KV disk tier: removing %s (torn, foreign or corrupt)", path.name)
            self._remove(path)
            return None
        self._known.add(name)
        try:
            os.utime(path)  # recency for the LRU of every replica
        except OSError:
            pass
        return payload

    def _parse(self, data: bytes, tokens: list[int]) -> tuple[torch.Tensor, list[int]] | None:
        """The payload of a block file and its tokens without window K/V, or None unless it is whole, this model's
        and these tokens'."""
        if len(data) < 12 or data[:8] != MAGIC:
            return None
        (hlen,) = struct.unpack("<I", data[8:12])
        try:
            header = json.loads(data[12 : 12 + hlen])
        except ValueError:
            return None
        raw = data[12 + hlen :]
        k0 = self.kv.k[0]
        layers = len(self.kv.k) + (len(self.kv.window.k) if self.kv.window is not None else 0)
        want_shape = [layers, 2, BLOCK_TOKENS, *k0.view(torch.uint8).shape[1:]]  # bytes, see `save`
        absent = header.get("absent")
        if (header.get("identity") != self.identity or header.get("tokens") != tokens
                or header.get("dtype") != str(k0.dtype) or header.get("shape") != want_shape
                or header.get("crc32") != zlib.crc32(raw) or len(raw) != math.prod(want_shape)
                or not isinstance(absent, list) or not all(isinstance(i, int) and 0 <= i < BLOCK_TOKENS
                                                           for i in absent)):
            return None
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(want_shape), absent

    # ---- size, flush ------------------------------------------------------------------------------------
    def _files(self) -> list[tuple[float, int, Path]]:
        out = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(SUFFIX):
                try:
                    st = entry.stat()
                except OSError:
                    continue
                out.append((st.st_mtime, st.st_size, Path(entry.path)))
        return out

    def _evict(self) -> None:
        """Remove the least recently used files until the tier holds at most 90 % of its size."""
        files = sorted(self._files())
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= 0.9 * self.capacity:
                break
            self._remove(path)
            self._known.discard(path.name[: -len(SUFFIX)])
            total -= size
            self.stats.evicted_files += 1
        self.stats.bytes = total

    def _remove(self, path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass  # another replica removed it first

    def _sweep_tmp(self) -> None:
        now = time.time()
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".tmp"):
                try:
                    if now - entry.stat().st_mtime > STALE_TMP_S:
                        os.unlink(entry.path)
                except OSError:
                    pass

    def flush(self) -> int:
        """Remove every block of this model (waiting writes first); returns the files removed."""
        self.flush_writes()
        files = self._files()
        for _, _, path in files:
            self._remove(path)
        self._known.clear()
        self.stats.bytes = 0
        return len(files)

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=30)
