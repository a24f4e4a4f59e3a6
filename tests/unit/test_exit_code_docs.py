"""Issue 52: docs/reference.md's table of exit codes, and what a stop or a kill leaves, is backed by named tests. Each
test the table names exists (its file, a function of that name), and every exit code `plan` and `verify` can give
is in the table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from core.record import verify
from tests.paths import REPO
from tui import cli

TABLE = re.compile(r"<!-- BEGIN exit codes -->\n(.*?)<!-- END exit codes -->", re.S)


def _rows() -> list[list[str]]:
    text = (REPO / "docs" / "reference.md").read_text(encoding="utf-8")
    found = TABLE.search(text)
    assert found, "docs/reference.md has no exit-code table"
    lines = [line for line in found.group(1).splitlines() if line.startswith("| ") and "---" not in line]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[1:]]


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_test_the_exit_code_table_names_exists():
    rows = _rows()
    assert len(rows) >= 25
    named = 0
    for command, code, _when, tests in rows:
        ids = re.findall(r"`([\w/]+\.py)::(\w+)`", tests)
        assert ids, f"{command} {code}: no test named"
        for file, function in ids:
            assert function in _functions(REPO / "tests" / file), f"{file}::{function} (for {command} {code})"
            named += 1
    assert named >= len(rows)


def _codes(command: str) -> set[int]:
    out: set[int] = set()
    for row_command, code, _, _ in _rows():
        if row_command == command:
            out |= {int(c) for c in re.findall(r"\d+", code)}
    return out


def test_every_exit_code_of_plan_and_verify_is_in_the_table():
    assert _codes("`plan`") == {cli.EXIT_OK, cli.EXIT_USAGE, cli.EXIT_DOES_NOT_FIT, cli.EXIT_FIT_UNKNOWN}
    verify_codes = {value for name, value in vars(verify).items() if name.startswith("EXIT_") and isinstance(value, int)}
    assert _codes("`verify`") - {143} == verify_codes
    assert _codes("every command that prints") == {cli.EXIT_STDOUT_ERROR, cli.EXIT_BROKEN_PIPE}


def test_the_readmes_claims_about_a_stop_and_a_kill_point_at_their_rows():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "(docs/reference.md#exit-codes)" in readme and "### Exit codes\n" in \
        (REPO / "docs" / "reference.md").read_text(encoding="utf-8")
    claims = {("`run --headless`", "130, 143, 129"), ("`run --headless`", "137")}  # the README's two claims
    assert claims <= {(command, code) for command, code, _, _ in _rows()}
