"""The criteria a record was judged by, and its stated criteria rows against the rows recomputed from its numbers:
shared by ``verify`` of gpuaccept's own records (core/record/verify.py) and of command records
(core/record/command.py)."""

from __future__ import annotations

import math
from typing import Any

from core.criteria import AcceptCriteria, Judgement
from core.errors import SpecError
from core.record.verdicts import STAGES, entry, subtable
from core.record.written import clean
from core.status import StageStatus


def criteria_of(rec: dict[str, Any]) -> AcceptCriteria:
    """The criteria a record was judged by: its ``accept`` table (schema 4), the defaults before it.

    Raises:
        ValueError: the table holds a criterion gpuaccept does not know or a value out of its range (a SpecError).
    """
    if rec["schema_version"] < 4:
        return AcceptCriteria()
    try:
        return AcceptCriteria.from_table(subtable(entry(rec, "accept", "record"), "accept"))
    except SpecError as exc:
        raise ValueError(f"the accept table: {exc}") from None


def criteria_rows_problems(rec: dict[str, Any], rows: dict[str, list[Judgement]], problems: list[str]) -> None:
    """Each stage's ``criteria`` in the verdict are the rows recomputed from the record's numbers and its ``accept``
    table: the same criteria, thresholds, values (to 1e-9) and whether each was met (a tampered threshold or value
    shows here)."""
    stages = rec["verdict"].get("stages", {})
    for name in STAGES:
        stated = stages.get(name, {}).get("criteria", [])
        if not isinstance(stated, list):
            problems.append(f"verdict.stages.{name}.criteria is not an array of tables")
            continue
        if stages.get(name, {}).get("status") in (StageStatus.NOT_RUN, StageStatus.CANCELLED, StageStatus.ERROR) \
                and not stated:
            continue
        want = [clean(r.to_row()) for r in rows[name]]
        if len(stated) != len(want):
            problems.append(f"verdict.stages.{name} lists {len(stated)} criteria row(s); its data and the accept "
                            f"table give {len(want)}: " + "; ".join(r.words() for r in rows[name])[:300])
            continue
        for i, (got, row) in enumerate(zip(stated, want)):
            if not isinstance(got, dict) or not _same_row(got, row):
                problems.append(f"verdict.stages.{name}.criteria[{i}] says {_row_words(got)}; the record's data and "
                                f"accept table give {_row_words(row)}")


def _same_row(got: dict[str, Any], want: dict[str, Any]) -> bool:
    if set(got) != set(want):
        return False
    for key, value in want.items():
        other = got[key]
        if key in ("value", "threshold") and not isinstance(value, str) and not isinstance(other, (str, bool)):
            if isinstance(other, bool) or not isinstance(other, (int, float)) or \
                    not math.isclose(float(other), float(value), rel_tol=1e-9, abs_tol=1e-12):
                return False
        elif other != value:
            return False
    return True


def _row_words(row: Any) -> str:
    if not isinstance(row, dict):
        return repr(row)[:80]
    return ", ".join(f"{k} {row[k]!r}" for k in ("criterion", "threshold", "on", "value", "met") if k in row)
