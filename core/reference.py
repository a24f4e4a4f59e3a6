"""docs/reference.md's generated tables, made from the spec's settings (:func:`core.spec.spec_settings`).

``python -m core.reference --markdown [settings|criteria]`` prints a table (both by default);
``python -m core.reference --update-docs`` rewrites the generated tables of docs/reference.md (exit 0; 2 on bad usage).
tests/unit/test_settings.py fails when the file differs from what :func:`core.settings.render_docs` makes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core.settings import DOC_TABLES, markdown_table, render_docs
from core.spec import spec_settings

#: docs/reference.md, whose generated tables :func:`update_docs` rewrites
REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference.md"


def update_docs(path: Path = REFERENCE) -> bool:
    """Rewrite the generated tables of ``path`` (default docs/reference.md); True when it changed.

    Raises:
        OSError: the file cannot be read or written; ValueError: as :func:`core.settings.render_docs`.
    """
    text = path.read_text(encoding="utf-8")
    new = render_docs(text, spec_settings())
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def main(argv: list[str] | None = None) -> int:
    """The command line of the module docstring. Exit 0, 2 on bad usage (argparse)."""
    parser = argparse.ArgumentParser(prog="python -m core.reference", description="the spec's settings, declared once")
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--markdown", nargs="?", const="all", choices=(*DOC_TABLES, "all"),
                     help="print the docs table(s)")
    how.add_argument("--update-docs", action="store_true", help=f"rewrite the generated tables of {REFERENCE}")
    args = parser.parse_args(argv)
    if args.update_docs:
        print(f"{REFERENCE}: {'updated' if update_docs() else 'already up to date'}")
        return 0
    tables = DOC_TABLES if args.markdown == "all" else (args.markdown,)
    print("\n".join(markdown_table(t, spec_settings()) for t in tables), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
