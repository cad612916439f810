"""Parametrize a test over the kernel ISA tiers (engine/ops/csrc/common/cpu_isa.h): every tier this CPU runs is
tested, and each tier it cannot run shows up as a skip that names it."""
from __future__ import annotations

import pytest

from engine.ops.native import LINEAR_TIERS, NATIVE_OPS, SUPPORTED_ISAS

ALL_TIERS = ("avx512bf16", "avx512", "avx2", "scalar")


def tier_params(tiers: tuple[str, ...] = ALL_TIERS) -> list:
    """pytest.param per tier, skipped (naming the tier) where this CPU or build cannot run it."""
    out = []
    for tier in tiers:
        marks = []
        if not NATIVE_OPS:
            marks.append(pytest.mark.skip(reason=f"{tier}: the C++ ops are not built (EMBER_NATIVE_OPS=0)"))
        elif tier not in SUPPORTED_ISAS:
            marks.append(pytest.mark.skip(reason=f"this CPU cannot run the {tier} kernels (it runs "
                                                 f"{', '.join(SUPPORTED_ISAS)})"))
        out.append(pytest.param(tier, id=tier, marks=marks))
    return out


LINEAR = tier_params(LINEAR_TIERS)
EVERY = tier_params()
