"""engine/gc_freeze.py: a server loads with the collector off, then freezes what it loaded; stopping unfreezes."""
from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine_thread import EngineThread
from engine.gc_freeze import freeze_more, load_then_freeze, thaw


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> Node:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a


def in_a_generation(obj: object) -> bool:
    """Whether a collection can scan obj: frozen objects are in no generation (compared by identity: some objects'
    == raises)."""
    return any(o is obj for o in gc.get_objects())


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    thaw()
    assert gc.isenabled()
    yield
    thaw()
    gc.enable()


def test_loading_runs_without_collections_then_frees_its_garbage_and_freezes_the_rest() -> None:
    with load_then_freeze():
        assert not gc.isenabled()
        kept = cycle()
        garbage = weakref.ref(cycle())
        assert garbage() is not None  # no collection ran inside, though the cycle is unreachable
    assert gc.isenabled()
    assert garbage() is None  # the one collection on leaving freed it
    assert gc.get_freeze_count() > 0
    assert not in_a_generation(kept)  # frozen: no generation holds it, so no collection scans it
    thaw()
    assert gc.get_freeze_count() == 0 and in_a_generation(kept)


def test_an_exception_while_loading_still_reenables_the_collector() -> None:
    with pytest.raises(RuntimeError), load_then_freeze():
        raise RuntimeError("load failed")
    assert gc.isenabled() and gc.get_freeze_count() > 0


def test_freeze_more_freezes_what_was_loaded_later() -> None:
    with load_then_freeze():
        pass
    later = cycle()
    assert in_a_generation(later)
    freeze_more()
    assert not in_a_generation(later)


def test_the_engine_thread_freezes_the_loaded_engine_and_thaws_it_on_stop(make_tiny_model: Callable[..., Path]) -> None:
    config = EngineConfig(model=str(make_tiny_model("llama")), dtype="float32", max_total_tokens=256,
                          max_running_requests=2, decode_buckets=(1, 2), disable_compile=True).resolved()
    failures: list[BaseException] = []
    engine = EngineThread(config, deliver=lambda outs: None, on_fatal=failures.append)
    engine.start()
    assert engine.ready.wait(120) and not failures
    assert engine.core is not None and not in_a_generation(engine.core.runner.model)  # frozen with the load
    assert gc.get_freeze_count() > 0
    engine.stop(30)
    assert gc.get_freeze_count() == 0
