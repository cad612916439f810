"""The README and docs/: the request-field tables match `RULES`, every relative link resolves (file and heading), and
no page carries issue numbers, session history or scratch paths."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest


def _repo_root() -> Path:
    """The folder holding pyproject.toml, however deep this file sits under tests/."""
    here = Path(__file__).resolve()
    return next(p for p in here.parents if (p / "pyproject.toml").is_file())


ROOT = _repo_root()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FORBIDDEN = re.compile(r"\bissue \d+|#\d{2}\b|this session|previous session|/tmp/bench", re.IGNORECASE)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def _gen_field_tables() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_field_tables", ROOT / "scripts" / "gen_field_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where brackets are code, not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def test_field_tables_match_rules() -> None:
    gen = _gen_field_tables()
    doc = ROOT / "docs" / "structured-outputs.md"
    assert gen.current_block(doc.read_text(encoding="utf-8")) is not None, "the fields:begin/end markers are missing"
    assert gen.check(doc), "docs/structured-outputs.md is stale: run scripts/gen_field_tables.py --write " \
                           "docs/structured-outputs.md"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_issue_numbers_or_session_history(page: Path) -> None:
    hits = [f"line {n}: {m.group(0)!r}" for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
            for m in FORBIDDEN.finditer(line)]
    assert not hits, f"{page.relative_to(ROOT)}: " + "; ".join(hits)
