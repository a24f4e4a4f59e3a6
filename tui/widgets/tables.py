"""A table to read, not to navigate: no cursor, not focusable (Tab goes to the inputs and buttons)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.widgets import DataTable

if TYPE_CHECKING:
    from rich.table import Table


class ReadTable(DataTable, can_focus=False):
    """DataTable without a cursor that never takes focus."""

    def __init__(self, **kw) -> None:
        kw.setdefault("show_cursor", False)
        kw.setdefault("zebra_stripes", True)
        super().__init__(**kw)


def wrapped_table(columns: list[str], rows: list[list[str]], wrap: int = -1) -> Table:
    """A rich Table whose column ``wrap`` (default: the last) wraps instead of being cut: for long text such as how
    each plan line is estimated, which an 80-column DataTable cut mid-word. Shown in a Static."""
    from rich.table import Table

    table = Table(box=None, show_edge=False, pad_edge=False, expand=True, header_style="bold")
    wrap_at = wrap % len(columns)
    for i, name in enumerate(columns):
        if i == wrap_at:
            table.add_column(name, ratio=1, overflow="fold")
        else:
            table.add_column(name, no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table
