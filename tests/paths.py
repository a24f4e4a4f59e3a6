"""Where the tests find the repository, the public cases and the committed fixture records (one home, so a test file
can move between tests/unit and tests/integration without its paths changing)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
#: real-world cases from public bug reports (planner.toml, resume.md, ...): each stays a test with its right value
CASES = TESTS / "cases"
#: committed fixture records (tests/records.py writes them)
RECORDS = TESTS / "data" / "records"
