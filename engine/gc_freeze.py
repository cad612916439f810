"""Python's cyclic garbage collector in a process that holds a loaded model.

Importing torch and transformers and loading a model leave ~0.5 million long-lived objects, and every full
collection scans them all again: ~0.25 s each on an idle core here. Measured on the default model (2026-12-06, AMX
Xeon, a warm start of `ember serve`): 12 full collections during the start and the loading of its saved decode steps
took 1.65 s in all. So a long-lived process loads with collection off, then collects once and freezes what is left
(`gc.freeze`: those objects are never scanned again); later collections scan only what serving allocates. With it a
warm start reached `/health` in 5.7-5.9 s instead of 6.3-6.6 and had every bucket in 8.5-8.9 s instead of 10.0-10.1
(`scripts/startup_time.py --all-buckets`, three starts of each tree alternated). The same objects are unfrozen when
the engine stops, so a process that starts engines one after another (the tests) can still free an old engine's
reference cycles.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def load_then_freeze() -> Iterator[None]:
    """Collection off inside; on leaving (even by an exception), collect once and freeze every object left."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        if was_enabled:
            gc.enable()


def freeze_more() -> None:
    """Freeze every object now tracked, without a collection first (no pause): for what a long-lived process
    loaded in the background after `load_then_freeze` (saved decode steps, each ~3 ms more of every full
    collection), at the price of keeping any reference cycle that was garbage already."""
    gc.freeze()


def thaw() -> None:
    """The frozen objects back to the oldest generation, where a full collection can free them again."""
    gc.unfreeze()
