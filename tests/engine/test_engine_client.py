"""The asyncio bridge: EngineClient over the engine thread, on a tiny random model.

No test sleeps to synchronise: outputs are awaited, and state the engine thread changes after an abort is
awaited with a bounded wait on that state. The one `asyncio.sleep(1.0)` is the measurement window of the idle
CPU test, not a synchronisation.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import psutil
import pytest

from engine.client import EngineClient
from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from scheduler_helpers import Stream, run_solo, tiny_engine

PROMPTS = [[5, 17, 99, 4, 250, 31], [77, 3, 8, 123, 200, 14, 15, 16, 17, 18, 19, 40, 41, 42, 43, 44, 45, 46]]
LONG = SamplingParams(temperature=0.0, max_tokens=3900, ignore_eos=True)  # far longer than any test waits


@pytest.fixture(scope="module")
def folder(make_tiny_model: Callable[..., Path]) -> Path:
    return make_tiny_model("llama", max_position_embeddings=4096)


def client_config(folder: Path) -> EngineConfig:
    return EngineConfig(model=str(folder), dtype="float32", max_total_tokens=8192, max_running_requests=4,
                        decode_buckets=(1, 2, 4), disable_compile=True, num_threads=1)


@asynccontextmanager
async def running_client(folder: Path) -> AsyncIterator[EngineClient]:
    client = EngineClient(client_config(folder))
    client.start()
    await client.wait_ready()
    assert client.ready
    try:
        yield client
    finally:
        client.shutdown()


async def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Bounded wait for state another thread changes (checked every 5 ms, at most `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def all_free(client: EngineClient) -> bool:
    core = client.core
    # What is not free is prefix cache nobody holds (a finished request's K/V, kept for reuse).
    return (core.scheduler.kvm.held_slots() == 0
            and core.runner.kv_pool.available_size() == core.runner.kv_pool.num_slots - core.scheduler.kvm.cached_slots()
            and core.runner.req_pool.available_size() == core.runner.req_pool.size)


async def collect(client: EngineClient, request_id: str, prompt: list[int], params: SamplingParams) -> Stream:
    stream = Stream()
    async for out in client.generate(request_id, prompt, params):
        stream.take(out)
    return stream


def test_concurrent_generate_iterators(folder: Path) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=4, max_tokens=100, ignore_eos=True)]
    solo_core = tiny_engine(folder)
    expected = [run_solo(solo_core, p, sp) for p, sp in zip(PROMPTS, params)]

    async def main() -> None:
        async with running_client(folder) as client:
            got = await asyncio.gather(*(collect(client, f"c{i}", p, sp)
                                         for i, (p, sp) in enumerate(zip(PROMPTS, params))))
            for g, e in zip(got, expected):
                assert (g.token_ids, g.text, g.finish_reason) == (e.token_ids, e.text, "length")
                assert len(g.deltas) > 1  # streamed, not one lump at the end
            # They shared decode steps: run one after the other they would need every step on its own.
            assert client.core.scheduler.stats.decode_steps < sum(sp.max_tokens - 1 for sp in params)
            assert client.num_active == 0 and all_free(client)

    asyncio.run(main())


def test_leaving_the_iterator_early_aborts(folder: Path) -> None:
    async def main() -> None:
        async with running_client(folder) as client:
            seen: list[RequestOutput] = []
            async for out in client.generate("leaver", PROMPTS[0], LONG):
                seen.append(out)
                if len(seen) == 3:
                    break  # the iterator is dropped here; closing it must abort the request in the engine
            assert seen[-1].finish_reason is None
            stats = client.core.scheduler.stats
            await wait_until(lambda: stats.aborted == 1 and all_free(client) and not client.core.has_work())
            assert stats.generation_tokens < LONG.max_tokens and client.num_active == 0
            # The engine is still serving.
            after = await collect(client, "after", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=5))
            assert after.finish_reason == "length" and len(after.token_ids) == 5

    asyncio.run(main())


def test_abort_by_id_ends_the_stream_with_abort(folder: Path) -> None:
    async def main() -> None:
        async with running_client(folder) as client:
            outs: list[RequestOutput] = []
            async for out in client.generate("victim", PROMPTS[1], LONG):
                outs.append(out)
                if len(outs) == 2:
                    client.abort("victim")
            assert outs[-1].finish_reason == "abort"
            assert all(o.finish_reason is None for o in outs[:-1])
            assert all_free(client)  # freed in the engine before the final output was delivered

    asyncio.run(main())


def test_engine_thread_idles_without_burning_cpu(folder: Path) -> None:
    async def main() -> None:
        async with running_client(folder) as client:
            await collect(client, "warm", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20))
            await wait_until(lambda: not client.core.has_work())
            engine_tid = client._thread._thread.native_id

            def engine_cpu() -> float:
                [t] = [t for t in psutil.Process().threads() if t.id == engine_tid]
                return t.user_time + t.system_time

            cpu0, thread0 = time.process_time(), engine_cpu()
            await asyncio.sleep(1.0)  # the measurement window
            assert engine_cpu() - thread0 < 0.05
            assert time.process_time() - cpu0 < 0.1

    asyncio.run(main())
