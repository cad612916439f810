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


def linear_q_params() -> list:
    """One pytest.param per ember::linear_q kernel variant (scalar, avx2, avx512vnni), each run through a tier
    this CPU supports that selects it; a variant no supported tier reaches is a skip that names it."""
    import torch

    reach: dict[str, str] = {}
    if NATIVE_OPS:
        for tier in reversed(SUPPORTED_ISAS):  # lowest first: the plainest tier that reaches each variant
            reach.setdefault(str(torch.ops.ember.linear_q_variant(tier)), tier)
    out = []
    for variant in ("avx512vnni", "avx2", "scalar"):
        if variant in reach:
            out.append(pytest.param(reach[variant], id=variant))
        else:
            why = ("the C++ ops are not built" if not NATIVE_OPS else
                   f"this CPU cannot run the {variant} linear_q kernel (it runs {', '.join(SUPPORTED_ISAS)})")
            out.append(pytest.param("", id=variant, marks=pytest.mark.skip(reason=why)))
    return out


LINEAR_Q = linear_q_params()
