"""The records of the runs folder side by side (``gpuaccept diff``, core/record/diff.py), opened from the export screen.

Pick two or more records (the first picked is the baseline); the comparison says whether they are comparable (the same
spec hash) and what changed, with the size of each change.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, SelectionList, Static

from core.api import read_record


def record_choices(runs_root: Path, current: Path | None) -> list[tuple[str, str, bool]]:
    """(label, path, selected) for every record below ``runs_root``, newest first: ``current`` (the record just
    written) is selected, with the newest other record of the same spec when there is one, else the newest other."""
    from core.api import records_below

    try:
        paths = sorted(records_below(runs_root), key=lambda p: p.stat().st_mtime, reverse=True)
    except (NotADirectoryError, OSError):
        return []
    info: list[tuple[Path, str, str]] = []
    for path in paths:
        try:
            rec = read_record(path)
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
            continue
        spec = rec.get("spec", {}) if isinstance(rec.get("spec"), dict) else {}
        verdict = rec.get("verdict", {}).get("status", "?") if isinstance(rec.get("verdict"), dict) else "?"
        info.append((path, str(spec.get("hash", ""))[:8], f"{path.parent.name} · {verdict} · spec {str(spec.get('hash', ''))[:8]}"))
    current = Path(current).resolve() if current else None
    chosen: set[Path] = set()
    if current is not None and any(p.resolve() == current for p, _, _ in info):
        chosen.add(current)
        mine = next(h for p, h, _ in info if p.resolve() == current)
        other = next((p for p, h, _ in info if h == mine and p.resolve() != current), None) or \
            next((p for p, _, _ in info if p.resolve() != current), None)
        if other is not None:
            chosen.add(other.resolve())
    else:
        chosen.update(p.resolve() for p, _, _ in info[:2])
    return [(label, str(p), p.resolve() in chosen) for p, _, label in info]


class CompareScreen(Screen):
    """Records of the runs folder: pick two or more; their comparison below."""

    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]

    def __init__(self, runs_root: Path, current: Path | None = None) -> None:
        super().__init__()
        self.runs_root = Path(runs_root)
        self.current = current
        self.order: list[str] = []  # the picked records, in the order picked: the first is the baseline

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("Compare runs · the first picked is the baseline", classes="title")
        choices = record_choices(self.runs_root, self.current)
        self.order = [p for _, p, on in choices if on]
        if self.current is not None and str(self.current) in self.order:  # the run just written last: what changed
            self.order.remove(str(self.current))
            self.order.append(str(self.current))
        self.count = len(choices)
        yield SelectionList[str](*choices, id="records")
        with VerticalScroll(classes="body"):
            yield Static("", id="comparison")
        yield Footer(show_command_palette=False)

    def on_mount(self) -> None:
        self.query_one("#records", SelectionList).styles.height = min(8, 2 + max(1, self.count))
        self.show()

    def on_selection_list_selected_changed(self, event: SelectionList.SelectedChanged) -> None:
        picked = set(event.selection_list.selected)
        self.order = [p for p in self.order if p in picked] + [p for p in event.selection_list.selected
                                                              if p not in self.order]
        self.show()

    def show(self) -> None:
        from core.api import diff, format_comparison

        out = self.query_one("#comparison", Static)
        if len(self.order) < 2:
            out.update(f"pick two or more records to compare ({self.count} in {escape(str(self.runs_root))})")
            return
        try:
            text = format_comparison(diff([Path(p) for p in self.order]))
        except (OSError, ValueError) as exc:  # shown, never a traceback
            text = f"cannot compare: {exc}"
        out.update(escape(text))

    def comparison_text(self) -> Any:
        """What the comparison shows now (for the tests)."""
        return self.query_one("#comparison", Static).content
