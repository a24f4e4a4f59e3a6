"""Named errors of gpuaccept.

Every error a user can cause carries the field at fault and what to change, so the CLI and the UI show one line, never a
traceback.
"""

from __future__ import annotations


class GpuAcceptError(Exception):
    """Base class of every error gpuaccept reports to a user."""


class SpecError(GpuAcceptError):
    """A RunSpec value is invalid.

    Attributes:
        field: the RunSpec field at fault (e.g. ``"seq_len"``).
        message: what is wrong and what to change.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class ModelNotFoundError(GpuAcceptError):
    """The model named in the spec cannot be found offline."""


class DataError(GpuAcceptError):
    """The evaluation/training text cannot be read or is too small for the spec."""


class StageError(GpuAcceptError):
    """A pipeline stage could not run (its child process failed); the message names the log to read."""


class StageCancelled(StageError):
    """A stage was stopped on purpose (the operator quit, a signal, a hang-up): its status is ``cancelled``, not
    ``error``; the message says what was stopped."""


class UnknownDtypeError(GpuAcceptError, ValueError):
    """A dtype name gpuaccept has no size for (:mod:`core.dtypes`): never counted as 4 bytes by default.

    A ``ValueError`` too, so code that skips malformed record data (the quiz) skips it as such.

    Attributes:
        dtype: the name given.
    """

    def __init__(self, dtype: object, known: tuple[str, ...]) -> None:
        self.dtype = dtype
        super().__init__(f"dtype {dtype!r} is not one gpuaccept plans or runs; known: {', '.join(known)}")
