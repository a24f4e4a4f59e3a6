"""``gpuaccept monitor``: the live per-device memory bars alone (is this box free?), or one sample as text or JSON."""

from __future__ import annotations

import json
from typing import Any

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import Footer, Header, Static

from tui.widgets.bars import LiveBar


def sample_json(backend: Any, note: str) -> dict[str, Any]:
    """One sample of every device: backend, note, and per device name, uuid, total / used / reserved / free bytes,
    utilisation, with the reason wherever a figure is N/A."""
    samples = backend.sample(set())
    return {"backend": backend.name, "note": note, "devices": [s.to_json() for s in samples]}


def sample_text(data: dict[str, Any]) -> str:
    """The same sample for people (GiB = 2^30 bytes; N/A with its reason)."""
    def fig(reading: dict[str, Any], unit: str = "GiB") -> str:
        value = reading.get("value")
        text = "N/A" if value is None else (f"{value / 2**30:.2f} GiB" if unit == "GiB" else f"{value} %")
        return text + (f" ({reading['reason']})" if reading.get("reason") else "")

    lines = [f"backend: {data['backend']} · {data['note']}"]
    for d in data["devices"]:
        head = f"{d['device']} {d['name']}" + (f" {d['uuid']}" if d.get("uuid") else "") + \
            (f" [{d['note']}]" if d.get("note") else "")
        lines.append(head)
        lines.append(f"  total {fig(d['total_bytes'])} · used {fig(d['used_bytes'])} · reserved "
                     f"{fig(d['reserved_bytes'])} · free {fig(d['free_bytes'])} · utilisation "
                     f"{fig(d['utilization_pct'], '%')}")
    return "\n".join(lines)


class MonitorApp(App):
    """Every device's memory, live: used by all processes against capacity, with the peak since start."""

    CSS_PATH = "app.tcss"
    TITLE = "gpuaccept monitor"
    BINDINGS = [Binding("q", "quit", "Quit")]

    def __init__(self, backend: Any, note: str, interval_s: float = 0.1, record: str | None = None) -> None:
        super().__init__()
        from core.api import Sampler

        self.note = note
        self.sampler = Sampler(backend, interval_s=interval_s)
        if record:
            self.sampler.record(record)
        self._bars: dict[str, LiveBar] = {}

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(f"[dim]memory from: {self.note}. Used = every process on the device; peak since this view "
                     "opened.[/]", classes="intro")
        yield Vertical(id="bars", classes="body")
        yield Footer(show_command_palette=False)  # no ^p palette key: at 80 columns every key shows

    def on_mount(self) -> None:
        from tui.app import watch_terminal

        watch_terminal(self, self.sampler.stop)  # closes a recording; the process then exits 129
        self.sampler.start()
        self.set_interval(0.25, self.refresh_bars)

    def on_unmount(self) -> None:
        self.sampler.stop()

    def refresh_bars(self) -> None:
        box = self.query_one("#bars", Vertical)
        for sample in self.sampler.latest():
            bar = self._bars.get(sample.device)
            if bar is None:
                bar = self._bars[sample.device] = LiveBar(f"{sample.device} {sample.name}", whole_device=True)
                box.mount(bar)
            reasons = [sample.note] if sample.note else []
            reasons += [r.reason for r in (sample.used_bytes, sample.total_bytes) if r.reason]
            if sample.utilization_pct.ok:
                reasons.append(f"util {sample.utilization_pct.value} %")
            reserved = sample.reserved_bytes.value
            if sample.reserved_bytes.ok and reserved is not None:  # ok: a value (not None) and no reason
                reasons.append(f"driver-reserved {reserved / 2**30:.2f} GiB")
            bar.show(ours=None, others=sample.used_bytes.value, total=sample.total_bytes.value,
                     peak=self.sampler.peak_used(sample.device), note="; ".join(dict.fromkeys(reasons)))


def main(args: Any) -> int:
    from core.api import default_backend

    backend, note = default_backend()
    if args.once:
        data = sample_json(backend, note)
        print(json.dumps(data, indent=2) if args.json else sample_text(data))
        return 0
    MonitorApp(backend, note, interval_s=args.interval, record=args.record).run()
    return 0
