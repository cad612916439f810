"""The short soak (scripts/soak.py --short): three replicas behind smg under mixed traffic, a drain and a SIGKILL
midway; about 80 s on two cores. The script checks the soak itself and exits non-zero on a failed check; this test
also reads its JSON summary, so a soak that silently did little (no traffic, no faults) fails too."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_short_soak_passes(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "soak.py"), "--short", "--json", str(out),
                           "--log-dir", str(tmp_path / "logs")],
                          cwd=REPO, capture_output=True, text=True, timeout=400)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, f"soak failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    s = json.loads(out.read_text())
    assert s["passed"] and all(c["passed"] for c in s["checks"].values()), s["checks"]
    assert s["requests"] > 300, s["requests"]
    assert s["violations"] == 0 and s["status_counts"].get("500", 0) == 0
    assert {"sample", "greedy", "long", "disconnect", "bad"} <= set(s["by_kind"]), s["by_kind"]
    assert s["client_aborts"] > 0 and s["outcome_counts"].get("bad_ok", 0) > 0
    assert all(v > 0 for v in s["served_per_replica"].values()), s["served_per_replica"]
    assert s["restarts"] >= 2 and {f["kind"] for f in s["faults"]} == {"drain", "kill"}, s["faults"]
    assert s["restarts"] + s["retries"] > 0
    assert s["greedy"]["comparisons"] > 0 and s["greedy"]["mismatches"] == 0, s["greedy"]
    # a restarted replica has two lives, each with its own RSS baseline
    assert sum(len(lives) for lives in s["replicas"].values()) == len(s["replicas"]) + s["restarts"]
    assert all(v == 0 for m in s["end_metrics"].values() for v in m.values()), s["end_metrics"]
