"""What every record writer shares (the recipe's, core/record/build.py; command mode's, core/command/record.py; a
cluster's, core/record/cluster.py): the schema versions, the tool's name and version, the values TOML can hold
(:func:`clean`, :func:`plain_values`), the atomic write, the UTC time, and a stage's entry in the verdict
(:func:`stage_entry`)."""

from __future__ import annotations

import datetime as dt
import enum
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import tomli_w

from core.status import StageStatus, Stopped

SCHEMA_VERSION = 7
#: Versions ``gpuaccept verify`` reads: 1 (a plan's total is the sum of its components), 2 (the peak of the step's
#: phases; the fit judged by the larger of the analytic and traced peaks; probe findings), 3 (the resumed process
#: verifies the checkpoint's manifest itself: the resume check ``manifest_at_load``; every table checked recursively)
#: and 4 (the ``accept`` table of criteria; each stage's verdict lists the criteria it was judged by, with the numbers;
#: next-token accuracy beside perplexity) and 5 (the resume check's tolerance is a bound from measured noise: the tier
#: says its method, ``exact`` or ``twin``, and multiple; each tolerance check its distance, the twin's noise and the
#: bound; the ``reproducible`` check of the interrupted run; the environment's test jitter or planted fault, when set).
#: 6 (each tolerance check keeps what it is computed from, ``evidence_rows``: per tensor its distance, the twin's and the
#: reference's norm; per step and rank the losses, and the twin's losses the noise comes from; verify computes each
#: check again from them). 7 (the noise is the spread of several twins branched where the resumed run branches, one
#: nudged by one ulp: the tier says how many, ``twins``; each tolerance check's evidence keeps the noise family's
#: ``members`` and ``pairs`` and, per tensor, one distance per pair, per point each member's loss; the losses are judged
#: by the norm of their differences, pooled). A record before 4 is judged by the default criteria; before 5, by the relative tolerance
#: tier it was written under; before 6, a passing twin-tier check is not shown consistent (its bound cannot be computed
#: again).
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7)
#: The version of a command-mode record (core/command/record.py): from 4 its resume tier is a bound from measured
#: noise (core/stages/noise.py), before it a relative tolerance; from 5 it holds the ``accept`` table of criteria and
#: each stage's verdict lists the criteria it was judged by (before 5: judged by the default criteria); from 6 its
#: tolerance checks keep their evidence, as the recipe's record does; from 7 several twins' spread is the noise, as in
#: the recipe's record of schema 7.
COMMAND_SCHEMA_VERSION = 7
TOOL = "gpuaccept"


def tool_version() -> str:
    try:
        return metadata.version("gpuaccept")
    except metadata.PackageNotFoundError:  # running from a source tree
        return "0+unknown"


def clean(value: Any) -> Any:
    """Drop None (TOML has no null), make tuples lists, keys strings and enums their values (a stage's
    :class:`~core.status.StageStatus`), keep UTC-aware datetimes."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value if v is not None]
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)  # TOML allows inf/nan, but readers of the record should see them spelled out
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return value.item()
    return value


def plain_values(value: Any, where: str = "record") -> None:
    """Refuse what must never reach the TOML writer: None, numpy (or torch) scalars, naive or non-UTC date-times.

    Raises:
        TypeError: naming the key path of the first such value.
    """
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} is not a string")
            plain_values(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            plain_values(v, f"{where}[{i}]")
    elif value is None:
        raise TypeError(f"{where} is None: TOML has no null; omit it and say why in its table")
    elif isinstance(value, dt.datetime):
        if value.utcoffset() != dt.timedelta(0):
            raise TypeError(f"{where} = {value!r} is not a UTC-aware date-time")
    elif type(value) not in (str, int, float, bool, dt.date, dt.time):
        raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__name__}, not a plain TOML value")


def write_record(record: dict[str, Any], path: Path) -> Path:
    """Write ``record`` as TOML atomically: temp file in the same directory, fsync, rename.

    Raises:
        TypeError: a value that must not be written (:func:`plain_values`), naming where it is.
    """
    plain_values(record)
    text = tomli_w.dumps(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".record-", suffix=".toml", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def utc_now() -> dt.datetime:
    """The current time, UTC-aware, to the second (naive datetimes read back as local time)."""
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


class Judged(Protocol):
    """The verdict engine's verdict of a stage (:class:`core.record.verdicts.StageVerdict`), as a record writer reads
    it."""

    @property
    def status(self) -> StageStatus: ...

    @property
    def reasons(self) -> tuple[str, ...]: ...

    @property
    def criteria(self) -> tuple[Any, ...]: ...


def stage_entry(result: Any, engine: Judged | None, stopped: Stopped | None, not_run: str = "not run",
                unjudged: str = "") -> dict[str, Any]:
    """A stage's entry in a record's ``verdict.stages`` (both kinds of record): with a ``result`` judged by the
    verdict engine (``engine``), the engine's status, the result's summary as its evidence (where the result's own
    status differs, what the record's rules said) and the criteria rows; a result the engine could not judge, its own
    status and rows, ``unjudged`` saying why; without one, the status it stopped with and why (``stopped``), else
    not_run (``not_run``: the words)."""
    if result is None:
        if stopped is not None:
            return {"status": StageStatus(stopped.status).value, "evidence": stopped.why}
        return {"status": StageStatus.NOT_RUN.value, "evidence": not_run}
    words = str(result.summary)
    if engine is None:
        return {"status": StageStatus(result.status).value, "evidence": words + unjudged,
                "criteria": [r.to_row() for r in getattr(result, "criteria", [])]}
    if engine.status != result.status:  # the stage's own word differs from the record's rule: say why
        words += f"; {engine.status.value} by the record's rules: " + "; ".join(engine.reasons)
    return {"status": engine.status.value, "evidence": words, "criteria": [r.to_row() for r in engine.criteria]}
