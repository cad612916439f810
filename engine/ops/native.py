"""Build (first time, ~1-2 min, cached under TORCH_EXTENSIONS_DIR) and load the engine's C++ CPU ops.

One extension holds every kernel in csrc/ (layout: docs/architecture.md "Kernels"). It is built for generic x86-64: each
ISA-specific file compiles its kernels under its own `#pragma GCC target`, and the ops dispatch at run time to the
best tier the CPU supports (csrc/common/cpu_isa.cpp), so one build serves every CPU. `EMBER_ISA=avx2|avx512|
avx512bf16|scalar` forces a lower tier (any machine can run and test the AVX2 path). EMBER_NATIVE_OPS=0 forces
the Python references, and a machine without a C++ compiler falls back to them with a warning. With a compiler
present a failed build is an error: silently serving the slow path hides bugs.
"""
from __future__ import annotations

import logging
import os
import shutil
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger("ember.ops")

CSRC = Path(__file__).parent / "csrc"
# Every .cpp under csrc/ is part of the extension; headers are found from csrc/ (#include "linear/...").
SOURCES = tuple(sorted(str(p.relative_to(CSRC)) for p in CSRC.rglob("*.cpp")))
LINEAR_TIERS = ("avx512bf16", "avx512", "avx2")  # tiers with packed kernels (ember::linear_bf16 and linear_f32)


def _load() -> bool:
    if os.environ.get("EMBER_NATIVE_OPS", "1") == "0":
        return False
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("no C++ compiler: ember:: ops run their (slower) Python references")
        return False
    from torch.utils.cpp_extension import load

    # No -march=native: the ISA files pick their own instructions, the rest is generic x86-64, so the build
    # (and a cache volume holding it) is the same on every CPU.
    load(name="ember_native", sources=[str(CSRC / s) for s in SOURCES], is_python_module=False,
         extra_include_paths=[str(CSRC)], extra_cflags=["-O3", "-ffast-math", "-fopenmp"],
         extra_ldflags=["-fopenmp"])
    return True


NATIVE_OPS = _load()


def active_isa() -> str:
    """The tier the ember:: ops run now (ACTIVE_ISA unless a test forced another with `forced_isa`)."""
    return str(torch.ops.ember.isa_active()) if NATIVE_OPS else "python"


# Tiers this CPU runs, best first; the ops dispatch to ACTIVE_ISA (EMBER_ISA or the best) from load on.
SUPPORTED_ISAS: tuple[str, ...] = tuple(torch.ops.ember.isa_supported()) if NATIVE_OPS else ("python",)
ACTIVE_ISA: str = active_isa()
NATIVE_LINEAR = NATIVE_OPS and ACTIVE_ISA in LINEAR_TIERS


@contextmanager
def forced_isa(name: str) -> Iterator[None]:
    """Run the dispatched ops on tier `name` inside the block (tests: every tier the CPU supports)."""
    before = active_isa()
    torch.ops.ember.isa_select(name)
    try:
        yield
    finally:
        torch.ops.ember.isa_select(before)


def describe_tiers() -> str:
    """One line for the start-up log: which tier each op runs."""
    if not NATIVE_OPS:
        return "ember:: ops run their Python references (EMBER_NATIVE_OPS=0 or no C++ compiler)"
    linear = ACTIVE_ISA if NATIVE_LINEAR else "torch F.linear (no packed kernel on this tier)"
    attention = ACTIVE_ISA if ACTIVE_ISA != "scalar" else "portable C++ loop"
    forced = " (forced by EMBER_ISA)" if os.environ.get("EMBER_ISA") else ""
    return (f"CPU tiers {', '.join(SUPPORTED_ISAS)}; active {ACTIVE_ISA}{forced}: packed linear {linear}, "
            f"decode_attention {attention}")
