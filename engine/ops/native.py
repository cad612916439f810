"""Build (first time, ~1-2 min, cached under TORCH_EXTENSIONS_DIR) and load the engine's C++ CPU ops.

One extension holds every kernel in csrc/: `ember::decode_attention` and `ember::linear_bf16`. EMBER_NATIVE_OPS=0
forces the Python references, and a machine without a C++ compiler falls back to them with a warning. With a
compiler present a failed build is an error: silently serving the slow path hides bugs.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger("ember.ops")

SOURCES = ("decode_attention.cpp", "linear_bf16.cpp")


def _load() -> bool:
    if os.environ.get("EMBER_NATIVE_OPS", "1") == "0":
        return False
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("no C++ compiler: ember:: ops run their (slower) Python references")
        return False
    from torch.utils.cpp_extension import load

    csrc = Path(__file__).parent / "csrc"
    # -march=native: the build cache must not be shared with a CPU of another capability (a cache volume can be).
    cpu = torch.backends.cpu.get_cpu_capability().lower()
    load(name=f"ember_native_{cpu}", sources=[str(csrc / s) for s in SOURCES], is_python_module=False,
         extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"], extra_ldflags=["-fopenmp"])
    return True


NATIVE_OPS = _load()
# The packed bf16 linear needs AVX512-BF16 at build time (-march=native on a CPU that has it).
NATIVE_LINEAR = NATIVE_OPS and bool(torch.ops.ember.native_linear_available())
