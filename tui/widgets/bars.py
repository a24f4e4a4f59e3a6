"""Memory bars: a stacked bar of planned components against a device's capacity, and a live bar of a device's memory.

Dumb widgets: they draw the bytes they are given (GiB = 2^30 bytes on screen) and compute nothing about memory.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from core.api import fits_in

GiB = 2**30

#: One colour per plan component, in stacking order.
COMPONENT_STYLES: dict[str, str] = {
    "weights": "#4e79a7",
    "gradients": "#f28e2b",
    "optimizer_states": "#e15759",
    "activations": "#76b7b2",
    "temporaries": "#59a14f",
    "overhead": "#b07aa1",
    "kv_cache": "#edc948",
}
SHORT = {"weights": "W", "gradients": "G", "optimizer_states": "OPT", "activations": "ACT", "temporaries": "TMP",
         "overhead": "CTX", "kv_cache": "KV"}


def short_name(name: str, kind: str = "cuda") -> str:
    """A component's short name on a device of ``kind``: the ``overhead`` line is ``CTX`` (CUDA context) on CUDA and
    ``RT`` (the process's runtime) on the CPU, which has no CUDA context (core.plan.memory.OVERHEAD_NAMES)."""
    if name == "overhead":
        from core.api import overhead_name

        return overhead_name(kind)[0]
    return SHORT[name]


def gib(n: int | float | None) -> str:
    """Bytes as GiB with two decimals, or N/A."""
    return "N/A" if n is None else f"{n / GiB:.2f} GiB"


def stacked_bar(segments: list[tuple[int, str]], capacity: int | None, width: int) -> Text:
    """A bar ``width`` cells wide: each (bytes, style) segment in proportion to ``capacity`` (or to their sum when the
    capacity is unknown or smaller: then a red marker shows where the capacity ends)."""
    total = sum(b for b, _ in segments)
    scale_to = max(capacity or 0, total, 1)
    text = Text()
    used_cells = 0
    for nbytes, style in segments:
        cells = round(nbytes / scale_to * width)
        if nbytes > 0:
            cells = max(cells, 1)
        cells = min(cells, width - used_cells)
        text.append("█" * cells, style=style)
        used_cells += cells
    if used_cells < width:
        text.append("░" * (width - used_cells), style="#555555")
    if capacity and not fits_in(total, capacity):
        cut = min(width - 1, round(capacity / scale_to * width))
        text = text[:cut] + Text("▏", style="bold red") + text[cut + 1:]
    return text


class PlanBar(Widget):
    """Planned components of one device stacked against its capacity, with a legend line."""

    DEFAULT_CSS = "PlanBar { height: 2; }"

    components: reactive[dict[str, int]] = reactive(dict, layout=True)
    capacity: reactive[int | None] = reactive(None)

    def __init__(self, components: dict[str, int] | None = None, capacity: int | None = None,
                 lines: dict[str, int] | None = None, kind: str = "cuda", **kw) -> None:
        """``components``: the bytes alive at the peak (the bar); ``lines``: each component's largest value (the
        plan's table), so the legend names every component the table lists, drawn or not; ``kind``: the device's
        (``cpu``: the overhead line is the process's runtime, RT, not a CUDA context)."""
        super().__init__(**kw)
        self.set_reactive(PlanBar.components, dict(components or {}))
        self.set_reactive(PlanBar.capacity, capacity)
        self.lines = dict(lines or {})
        self.kind = kind

    def legend_items(self, width: int) -> list[tuple[str, str, str]]:
        """(component, short name, note) for the legend: every component with bytes at the peak or in the table,
        in stacking order; note ``0 at peak`` for one the table lists but not alive at the bar's peak (gradients
        when the peak is the forward's), ``<1 col`` for one under half a cell (drawn one cell wide)."""
        alive = self.components
        scale_to = max(self.capacity or 0, sum(alive.values()), 1)
        out = []
        for name in COMPONENT_STYLES:
            now, largest = alive.get(name, 0), self.lines.get(name, 0)
            if now <= 0 and largest <= 0:
                continue
            note = "0 at peak" if now <= 0 else "<1 col" if now / scale_to * width < 0.5 else ""
            out.append((name, short_name(name, self.kind), note))
        return out

    def render(self) -> Text:
        width = max(10, self.size.width)
        segments = [(self.components.get(k, 0), style) for k, style in COMPONENT_STYLES.items()]
        bar = stacked_bar(segments, self.capacity, width)
        legend = Text()
        items = self.legend_items(width)
        for name, short, _note in items:
            legend.append("■ ", style=COMPONENT_STYLES[name])
            legend.append(f"{short} ")
        if self.capacity and not fits_in(sum(b for b, _ in segments), self.capacity):  # the red marker, said in the legend
            legend.append("▏", style="bold red")
            legend.append(f"capacity {self.capacity / GiB:.2f} GiB ")
        # what the bar cannot show, after the names (a narrow terminal cuts it, never a name)
        notes = [f"{' '.join(s for _, s, n in items if n == note)} {note}" for note in ("0 at peak", "<1 col")
                 if any(n == note for _, _, n in items)]
        if notes:
            legend.append("· " + "; ".join(notes), style="dim")
        if self.size.width:  # laid out: cut with an ellipsis at the widget's edge
            legend.truncate(self.size.width, overflow="ellipsis")
        return Text.assemble(bar, "\n", legend)


class LiveBar(Widget):
    """One device's memory now: this probe's share, other processes, free; with the peak of this probe so far."""

    DEFAULT_CSS = "LiveBar { height: auto; }"

    def __init__(self, label: str, whole_device: bool = False, follows: str = "probe", **kw) -> None:
        """``whole_device``: no probe is followed (``gpuaccept monitor``): one segment, used by all processes.
        ``follows``: what the red share is, in a word (``probe``; command mode: the run under way, ``resumed``)."""
        super().__init__(**kw)
        self.label = label
        self.whole_device = whole_device
        self.follows = follows
        self.ours: int | None = None
        self.others: int | None = None
        self.total: int | None = None
        self.peak: int | None = None
        self.note = ""
        self.ended = False
        self.judged = ""

    def show(self, *, ours: int | None, others: int | None, total: int | None, peak: int | None, note: str = "",
             ended: bool = False, judged: str = "") -> None:
        """``ended``: the probe has finished; its share is no longer read, its peak is kept. ``judged``: the capacity
        the plan was judged by, in words (``22.87 GiB available when planned (14:02:11)``, from
        core.plan.devices.judged_capacity), said beside the total the bar is drawn against so the two reconcile."""
        self.ours, self.others, self.total, self.peak, self.note = ours, others, total, peak, note
        self.ended = ended
        self.judged = judged
        self.refresh()

    def _label_apart(self, width: int) -> bool:
        """The device's name is longer than a third of the width: it gets a line of its own, never cut to fit."""
        return len(self.label) > max(10, width) // 3

    def get_content_height(self, container: Any, viewport: Any, width: int) -> int:
        return 3 if self._label_apart(width) else 2

    def render(self) -> Text:
        """Line 1: the device and its bar (a long device name on a line of its own above them, issue 51: it was cut
        at 80 columns); line 2: the numbers, the peak first, so a narrow terminal cuts the others and the note, never
        the peak. ``total`` is the device's whole memory (the plan's capacity may be what was available, or a
        cgroup's limit: the plan screen says which)."""
        width = max(10, self.size.width)
        apart = self._label_apart(width)
        label = "" if apart else self.label
        segments = [(self.ours or 0, "#e15759"), (self.others or 0, "#7f7f7f")]
        bar = stacked_bar(segments, self.total, max(4, width - len(label) - (1 if label else 0)))

        def n(v: int | None) -> str:  # every number with its unit
            return "N/A" if v is None else f"{v / GiB:.2f} GiB"

        note = (f" · {self.note}" if self.note else "", "italic")
        if self.whole_device:
            head: tuple = (("■ ", "#7f7f7f"), f"used {n(self.others)} (peak {n(self.peak)}) ")
        else:  # the peak first: a narrow terminal cuts the end of the line, never the peak
            probe = "ended" if getattr(self, "ended", False) else n(self.ours)
            head = (("■ ", "#e15759"), f"{getattr(self, 'follows', 'probe')} {probe} (peak {n(self.peak)}) ",
                    ("■ ", "#7f7f7f"),
                    f"others {n(self.others)} ")
        judged = getattr(self, "judged", "")
        # the longest words that fit (a note too long is cut with an ellipsis): the total with the capacity the plan
        # was judged by beside it; the total; the compact "/ total"; last the probe's share and peak with "/ total"
        # (other processes left to the bar): a narrow terminal never cuts a number or a word ("GiB tot")
        tails = ([(head, f"of {n(self.total)} total ({judged})")] if judged else []) + [
            (head, f"of {n(self.total)} total"), (head, f"/ {n(self.total)}"), (head[:2], f"/ {n(self.total)}")]
        for words, tail in tails:
            full = Text.assemble(*words, tail)
            if full.cell_len <= width:
                line = Text.assemble(full, note)
                break
        else:
            line = Text.assemble(*tails[-1][0], tails[-1][1])
        line.truncate(width, overflow="ellipsis")
        if apart:
            title = Text(self.label, style="bold")
            title.truncate(width, overflow="ellipsis")
            return Text.assemble(title, "\n", bar, "\n", line)
        return Text.assemble((label, "bold"), " ", bar, "\n", line)
