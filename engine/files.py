"""Atomic file writes for the caches that concurrent or interrupted starts share."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: Path, write: Callable[[str], object]) -> None:
    """`write(tmp_name)` fills a temporary file beside `path`, which is then renamed onto it: a reader sees the
    old file or the whole new one, never half of it. The result is world-readable (a shared cache volume)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
