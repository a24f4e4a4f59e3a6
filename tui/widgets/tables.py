"""A table to read, not to navigate: no cursor, not focusable (Tab goes to the inputs and buttons)."""

from __future__ import annotations

from textual.widgets import DataTable


class ReadTable(DataTable, can_focus=False):
    """DataTable without a cursor that never takes focus."""

    def __init__(self, **kw) -> None:
        kw.setdefault("show_cursor", False)
        kw.setdefault("zebra_stripes", True)
        super().__init__(**kw)
