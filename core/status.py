"""A stage's status, carried by its result or by why it stopped: never read back from a message's words.

The values are the record's (``verdict.stages.<stage>.status``, docs/record.md): ``pass``, ``fail``,
``not_applicable``, ``cancelled`` (stopped on purpose: the operator quit, a signal, a hang-up), ``error`` (its child
or its files failed) and ``not_run``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class StageStatus(enum.StrEnum):
    """How a stage ended; each value is the string the record holds."""

    PASS = "pass"
    FAIL = "fail"
    NOT_APPLICABLE = "not_applicable"
    CANCELLED = "cancelled"
    ERROR = "error"
    NOT_RUN = "not_run"

    @property
    def passing(self) -> bool:
        """pass or not_applicable: what an overall pass allows (:data:`PASSING`)."""
        return self in PASSING

    @classmethod
    def judged(cls, ok: bool) -> StageStatus:
        """``pass`` when ``ok``, else ``fail``: a stage (or a check) judged by its rule."""
        return cls.PASS if ok else cls.FAIL


#: The statuses an overall pass allows; any other (fail, error, cancelled, not_run) is a stage that did not pass.
PASSING: frozenset[StageStatus] = frozenset({StageStatus.PASS, StageStatus.NOT_APPLICABLE})


class RecordStatus(enum.StrEnum):
    """Whether the record was written: the status of the headless pipeline's last stage, ``record``
    (:func:`core.pipeline.record_stage`), which writes what the other stages judged and judges nothing itself."""

    WRITTEN = "written"
    NOT_WRITTEN = "not_written"


@dataclass(frozen=True)
class Stopped:
    """Why a stage ended without a result: its status (``cancelled``, ``error`` or ``not_run``) and the reason, in
    words for the record's evidence."""

    status: StageStatus
    why: str

    @classmethod
    def of(cls, exc: BaseException) -> Stopped:
        """The stop an exception of a stage means: :class:`core.errors.StageCancelled` is ``cancelled``, any other an
        ``error``."""
        from core.errors import StageCancelled

        return cls(StageStatus.CANCELLED if isinstance(exc, StageCancelled) else StageStatus.ERROR, str(exc))
