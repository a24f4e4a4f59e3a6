"""The messages a stage's worker thread posts to its screen (the recipe's stages, tui/screens/stages.py, and command
mode's, tui/screens/command.py)."""

from __future__ import annotations

from typing import Any

from textual.message import Message


class StageEvent(Message):
    """A core event from the stage's worker thread."""

    def __init__(self, event: Any) -> None:
        super().__init__()
        self.event = event


class StageDone(Message):
    """The stage's worker ended: its result, or the error that stopped it."""

    def __init__(self, result: Any, error: str | None) -> None:
        super().__init__()
        self.result = result
        self.error = error
