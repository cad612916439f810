#!/usr/bin/env python3
"""The request-field tables of docs/structured-outputs.md, rendered from `RULES` in server/api/request_fields.py.

    .venv/bin/python scripts/gen_field_tables.py                                   # print the block
    .venv/bin/python scripts/gen_field_tables.py --write docs/structured-outputs.md  # replace the doc's block
    .venv/bin/python scripts/gen_field_tables.py --check docs/structured-outputs.md  # exit 1 if it is stale

The block sits between the lines `<!-- fields:begin -->` and `<!-- fields:end -->`; nothing outside them is touched.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere: the repository's packages come first
    sys.path.insert(0, str(ROOT))

from server.api.request_fields import RULES, markdown_table  # noqa: E402

BEGIN = "<!-- fields:begin -->"
END = "<!-- fields:end -->"
DOC = ROOT / "docs" / "structured-outputs.md"


def render() -> str:
    """The text between the markers: both tables, with how many fields each one lists."""
    ignored = sum(1 for r in RULES if r.hint is not None)
    refused = sum(1 for r in RULES if r.reason is not None)
    parts = [
        f"**Accepted and ignored** ({ignored} fields):",
        "",
        markdown_table("ignored"),
        "",
        f"**Refused unless at their neutral value** ({refused} fields):",
        "",
        markdown_table("rejected"),
    ]
    return "\n".join(parts)


def current_block(text: str) -> str | None:
    """The text between the markers in `text`, or None when either marker is missing."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return None
    return text[start + len(BEGIN):end].strip("\n")


def with_block(text: str, block: str) -> str:
    """`text` with its block replaced by `block` (the markers must be there)."""
    start, end = text.index(BEGIN), text.index(END)
    return f"{text[:start + len(BEGIN)]}\n{block}\n{text[end:]}"


def check(path: Path = DOC) -> bool:
    """True when the doc's block equals what `render()` gives now."""
    return current_block(path.read_text(encoding="utf-8")) == render()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", type=Path, metavar="DOC", help="exit 1 if DOC's block differs from RULES")
    mode.add_argument("--write", type=Path, metavar="DOC", help="replace DOC's block with the rendered tables")
    args = parser.parse_args(argv)
    if args.check is not None:
        if check(args.check):
            return 0
        print(f"{args.check}: the request-field tables differ from server/api/request_fields.py RULES; "
              f"run scripts/gen_field_tables.py --write {args.check}", file=sys.stderr)
        return 1
    if args.write is not None:
        text = args.write.read_text(encoding="utf-8")
        if current_block(text) is None:
            print(f"{args.write}: no {BEGIN} / {END} markers", file=sys.stderr)
            return 1
        args.write.write_text(with_block(text, render()), encoding="utf-8")
        return 0
    print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
