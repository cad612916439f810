"""OpenMP's wait policy for Ember's processes. Set before torch is imported (libgomp reads it once, at load).

OpenMP workers spin this many rounds (well under a millisecond) after a parallel region before sleeping. A decode
step runs ~150 short regions (every linear and attention call): with no spin (OMP_WAIT_POLICY=PASSIVE) each one
paid a futex wake-up, 37 vs 53-62 tok/s at batch 1 and 483 vs 817 at batch 32. With libgomp's default spin (or
ACTIVE) idle workers keep a core busy and starve the HTTP event loop on small machines. The `ember` command and the
profiling scripts set the same, so a profile measures what the server runs.
"""
from __future__ import annotations

import os

DEFAULT_GOMP_SPINCOUNT = "10000"


def set_thread_env() -> None:
    """GOMP_SPINCOUNT=10000 unless the environment already chose a wait policy (an explicit choice wins)."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = DEFAULT_GOMP_SPINCOUNT
