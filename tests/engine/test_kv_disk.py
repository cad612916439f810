"""The prefix cache's disk tier (engine/kv_disk.py): the block store on its own (round trip, foreign, torn and
corrupt files, the size bound, a writer killed mid-write), then whole engines that restart on the same cache
directory and must give the tokens of an engine that never restarted, with slot accounting checked every step."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.kv_disk import BLOCK_TOKENS, SUFFIX, DiskKVStore
from engine.pools import KVPool
from engine.sampling_params import SamplingParams
from scheduler_helpers import Arrival, Driver, assert_idle_and_empty, tiny_engine

LAYERS, HEADS, DIM = 2, 2, 8


def _pool(slots: int = 512, seed: int = 0) -> KVPool:
    pool = KVPool(slots, LAYERS, HEADS, DIM, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for t in (*pool.k, *pool.v):
        t.copy_(torch.randn(t.shape, generator=gen))
    return pool


def _store(root: Path, pool: KVPool, identity: str = "model-a", mib: float = 64) -> DiskKVStore:
    return DiskKVStore(root, identity, int(mib * 2**20), pool)


def _ids(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def _allocator(pool: KVPool) -> Callable[[int], torch.Tensor | None]:
    return pool.allocate


def test_blocks_round_trip_into_another_pool(tmp_path: Path) -> None:
    src = _pool()
    ids = _ids(3 * BLOCK_TOKENS + 10)
    slots = src.allocate(len(ids))
    assert slots is not None
    store = _store(tmp_path, src)
    store.save(ids, slots)
    store.flush_writes()
    assert len(list(store.dir.glob("*" + SUFFIX))) == 3  # the partial last block is not stored
    dst = _pool(seed=9)
    covered, got = _store(tmp_path, dst).load(ids, 0, _allocator(dst))
    assert covered == 3 * BLOCK_TOKENS and got.numel() == covered
    for layer in range(LAYERS):
        assert torch.equal(dst.k[layer][got], src.k[layer][slots[:covered]])
        assert torch.equal(dst.v[layer][got], src.v[layer][slots[:covered]])
    # A load that starts inside block 1 (the tree already had 70 tokens) reads only what is missing.
    dst2 = _pool(seed=3)
    covered, got = _store(tmp_path, dst2).load(ids, 70, _allocator(dst2))
    assert covered == 3 * BLOCK_TOKENS and got.numel() == covered - 70
    assert torch.equal(dst2.k[1][got], src.k[1][slots[70:covered]])
    # Another prefix (one token changed in block 1) finds block 0 only: names chain over every earlier token.
    other = list(ids)
    other[BLOCK_TOKENS + 5] += 1
    assert _store(tmp_path, _pool()).load(other, 0, _allocator(_pool()))[0] == BLOCK_TOKENS


def test_foreign_torn_and_corrupt_files_are_removed_never_served(tmp_path: Path) -> None:
    src = _pool()
    ids = _ids(2 * BLOCK_TOKENS)
    slots = src.allocate(len(ids))
    assert slots is not None
    store = _store(tmp_path, src)
    store.save(ids, slots)
    store.flush_writes()
    assert _store(tmp_path, src, identity="model-b").load(ids, 0, _allocator(_pool()))[0] == 0  # another model
    first, second = (store.dir / (n + SUFFIX) for n in store.block_names(ids, 2))
    second.write_bytes(second.read_bytes()[:-100])  # torn
    reader = _store(tmp_path, _pool())
    assert reader.load(ids, 0, _allocator(_pool()))[0] == BLOCK_TOKENS
    assert not second.exists() and reader.stats.bad_files == 1
    data = bytearray(first.read_bytes())
    data[-1] ^= 0xFF  # one payload bit: the CRC no longer matches
    first.write_bytes(bytes(data))
    reader = _store(tmp_path, _pool())
    assert reader.load(ids, 0, _allocator(_pool()))[0] == 0 and not first.exists()


def test_size_bound_evicts_least_recently_used(tmp_path: Path) -> None:
    src = _pool(slots=2048)
    block_bytes = 2 * LAYERS * BLOCK_TOKENS * HEADS * DIM * 4
    store = _store(tmp_path, src, mib=4.5 * block_bytes / 2**20)  # room for about four blocks
    seqs = [_ids(BLOCK_TOKENS, seed=s) for s in range(6)]
    for n, ids in enumerate(seqs):
        slots = src.allocate(BLOCK_TOKENS)
        assert slots is not None
        store.save(ids, slots)
        store.flush_writes()
        if n == 2:  # read the first sequence back: it becomes the most recently used
            os.utime(store.dir / (store.block_names(seqs[0], 1)[0] + SUFFIX), (1e10, 1e10))
    names = {p.name for p in store.dir.glob("*" + SUFFIX)}
    assert len(names) <= 4 and store.stats.evicted_files >= 2
    assert store.block_names(seqs[0], 1)[0] + SUFFIX in names  # recently used: kept
    assert store.block_names(seqs[1], 1)[0] + SUFFIX not in names  # oldest: gone
    assert store.flush() == len(names) and not list(store.dir.glob("*" + SUFFIX))


def test_a_writer_killed_mid_write_leaves_nothing_servable_but_whole_blocks(tmp_path: Path) -> None:
    """A child process writes blocks in a loop and is killed with SIGKILL: every block file left is whole (renamed
    only once complete) and loads; a temporary file it left is never read."""
    script = textwrap.dedent(f"""
        import random, sys, torch
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / "support")!r})
        from engine.kv_disk import DiskKVStore
        from engine.pools import KVPool
        pool = KVPool(4096, {LAYERS}, {HEADS}, {DIM}, torch.float32)
        store = DiskKVStore(__import__("pathlib").Path({str(tmp_path)!r}), "model-a", 1 << 30, pool)
        rng = random.Random(0)
        n = 0
        while True:
            ids = [rng.randrange(1000) for _ in range({BLOCK_TOKENS})]
            store.save(ids, pool.allocate({BLOCK_TOKENS}) if pool.available_size() >= {BLOCK_TOKENS} else
                       torch.arange(1, {BLOCK_TOKENS} + 1))
            store.flush_writes()
            n += 1
            if n == 5:
                print("written", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    store = _store(tmp_path, _pool(slots=8192))
    files = list(store.dir.glob("*" + SUFFIX))
    assert len(files) >= 5
    rng = random.Random(0)  # the child's sequences, in its order: every file left is one of them, whole
    seqs = [[rng.randrange(1000) for _ in range(BLOCK_TOKENS)] for _ in range(len(files) + 5)]
    found = sum(store.load(ids, 0, store.kv.allocate)[0] == BLOCK_TOKENS for ids in seqs)
    assert found == len(files) and store.stats.bad_files == 0


# ---- whole engines on a cache directory -------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama")


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _serve(core: object, arrivals: list[Arrival]) -> dict[str, list[int]]:
    streams = Driver(core).run(arrivals)  # type: ignore[arg-type]
    assert_idle_and_empty(core)  # type: ignore[arg-type]
    return {k[0]: v.token_ids for k, v in streams.items()}


def test_a_restarted_engine_reads_the_prefix_back_and_writes_the_same_tokens(folder: Path, tmp_path: Path) -> None:
    rng = random.Random(5)
    system = [rng.randrange(5, 300) for _ in range(3 * BLOCK_TOKENS + 20)]
    questions = [[rng.randrange(5, 300) for _ in range(rng.randint(3, 12))] for _ in range(3)]
    arrivals = [Arrival(i, f"q{i}", system + q, GREEDY) for i, q in enumerate(questions)]
    want = _serve(tiny_engine(folder, disable_prefix_cache=True), arrivals)
    first = tiny_engine(folder, compile_cache_dir=str(tmp_path), kv_disk_cache_size=64)
    assert _serve(first, arrivals[:1]) == {"q0": want["q0"]}
    first.close()
    assert first.kvm.disk is not None and first.kvm.disk.stats.written_blocks >= 3
    restarted = tiny_engine(folder, compile_cache_dir=str(tmp_path), kv_disk_cache_size=64)
    assert _serve(restarted, arrivals) == want
    disk = restarted.kvm.disk
    # The first request read the system prompt's three whole blocks back instead of recomputing them; the others
    # found them in the tree it inserted them into (their fourth blocks differ from its: nothing more to read).
    assert disk is not None and (disk.stats.hit_blocks, disk.stats.hit_tokens) == (3, 3 * BLOCK_TOKENS)
    # A flushed tier serves nothing after the next restart.
    restarted.kvm.flush()
    restarted.close()
    again = tiny_engine(folder, compile_cache_dir=str(tmp_path), kv_disk_cache_size=64)
    assert _serve(again, arrivals[:1]) == {"q0": want["q0"]}
    assert again.kvm.disk is not None and again.kvm.disk.stats.hit_blocks == 0
    again.close()


def test_evicted_prefixes_come_back_from_disk_on_a_small_pool(folder: Path, tmp_path: Path) -> None:
    """A pool too small to keep every prompt cached: entries are evicted from the tree, and later requests for
    them load their blocks from the disk tier instead of recomputing; outputs equal the cache-off run."""
    rng = random.Random(8)
    prompts = [[rng.randrange(5, 300) for _ in range(2 * BLOCK_TOKENS + 7)] for _ in range(6)]
    # Six prompts one after another, twice: the pool keeps about four cached, so the second round's first ones
    # were evicted; a few arrive together too (they overlap while the earlier ones decode).
    arrivals = [Arrival(30 * i, f"p{i}", prompts[i % 6], GREEDY) for i in range(12)]
    arrivals += [Arrival(400 + i, f"x{i}", prompts[i], GREEDY) for i in range(3)]
    want = _serve(tiny_engine(folder, disable_prefix_cache=True, max_total_tokens=600), arrivals)
    core = tiny_engine(folder, compile_cache_dir=str(tmp_path), kv_disk_cache_size=64, max_total_tokens=600)
    assert _serve(core, arrivals) == want
    assert core.kvm.stats.evicted_tokens > 0
    assert core.kvm.disk is not None and core.kvm.disk.stats.hit_blocks > 0
    core.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_every_kv_dtype_round_trips_byte_for_byte(tmp_path: Path, dtype: torch.dtype) -> None:
    """Blocks are stored as the cache's bytes (an int8 / fp8 row's scale included, --kv-cache-dtype), so any KV dtype
    comes back bit-identical; a store of another dtype does not read them."""
    def pool(seed: int) -> KVPool:
        p = KVPool(256, LAYERS, HEADS, DIM, dtype)
        gen = torch.Generator().manual_seed(seed)
        for t in (*p.k, *p.v):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen,
                                                    dtype=torch.uint8))
        return p

    src, dst = pool(0), pool(1)
    ids = _ids(2 * BLOCK_TOKENS)
    slots = src.allocate(len(ids))
    assert slots is not None
    store = DiskKVStore(tmp_path, "model-a", 2**26, src)
    store.save(ids, slots)
    store.flush_writes()
    covered, got = DiskKVStore(tmp_path, "model-a", 2**26, dst).load(ids, 0, dst.allocate)
    assert covered == 2 * BLOCK_TOKENS
    for a, b in zip((*src.k, *src.v), (*dst.k, *dst.v)):
        assert torch.equal(a.view(torch.uint8)[slots], b.view(torch.uint8)[got])
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    foreign = KVPool(256, LAYERS, HEADS, DIM, other)
    assert DiskKVStore(tmp_path, "model-a", 2**26, foreign).load(ids, 0, foreign.allocate)[0] == 0
