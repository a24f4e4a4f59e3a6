"""Screen 3: the memory plan, per device and per component, with what-if keys for batch size and sequence length."""

from __future__ import annotations

from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Header, LoadingIndicator, Static

from tui.screens.nav import NavButtons
from tui.widgets.bars import SHORT, PlanBar, gib
from tui.widgets.tables import ReadTable


class PlanScreen(NavButtons, Screen):
    """Estimated bytes per component on each device, against that device's capacity. Nothing runs yet."""

    BINDINGS = [
        Binding("b", "batch(0.5)", "batch ÷2"), Binding("B", "batch(2)", "batch ×2"),
        Binding("s", "seq(0.5)", "seq ÷2"), Binding("S", "seq(2)", "seq ×2"),
        Binding("ctrl+n", "next", "Probe"),
    ]

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("Step 3/7 · Plan (estimates)", classes="title")
        yield Static("Each device must hold its own share: a server's total memory is not a placement. These are "
                     "ESTIMATES from formulas (each line says which); the probe measures next. ↑↓ PgDn scroll.", classes="intro")
        yield LoadingIndicator(id="loading")
        yield VerticalScroll(classes="body", id="plan-body")
        yield Static("", classes="error", id="plan-error")
        with Horizontal(classes="nav"):
            yield Button("← Back", id="back")
            yield Button("Run the probe →", id="next", variant="primary", disabled=True)
        yield Footer()

    def on_mount(self) -> None:
        self.replan(self.app.state.spec)

    @work(thread=True, exclusive=True, group="plan")
    def replan(self, spec: Any) -> None:
        from core.errors import GpuAcceptError
        from core.pipeline import make_plan

        try:
            ctx = make_plan(spec, self.app.state.devices_override)
        except GpuAcceptError as exc:
            self.app.call_from_thread(self.show_error, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - one line on screen, never a traceback
            self.app.call_from_thread(self.show_error, f"{type(exc).__name__}: {exc}")
            return
        self.app.call_from_thread(self.show_plan, spec, ctx)

    def show_error(self, message: str) -> None:
        self.query_one("#loading").display = False
        self.query_one("#plan-error", Static).update(f"cannot plan: {message}  (Esc: back to the setup)")
        self.query_one("#next", Button).disabled = True

    def show_plan(self, spec: Any, ctx: Any) -> None:
        state = self.app.state
        state.spec, state.ctx = spec, ctx
        self.query_one("#loading").display = False
        self.query_one("#plan-error", Static).update("")
        body = self.query_one("#plan-body", VerticalScroll)
        body.remove_children()
        plan = ctx.plan
        widgets: list[Any] = [Static(
            f"{spec.model} · {spec.mode} · {spec.dtype} · micro-batch {spec.batch_size} × {spec.seq_len} tokens · "
            f"parameters {plan.parameters.total:,} ({plan.parameters.trainable:,} trainable)")]
        for d in plan.devices:
            verdict = {True: "fits", False: "DOES NOT FIT", None: "fit unknown"}[d.fits]
            cap = gib(d.device.capacity_bytes) if d.device.capacity_bytes else "unknown capacity"
            widgets.append(Static(f"[b]{d.device.name}[/b] {d.device.label}: {gib(d.total_bytes)} of {cap} → "
                                  f"[{'green' if d.fits is not False else 'red'}]{verdict}[/]"))
            widgets.append(PlanBar({k: line.bytes for k, line in d.lines.items()}, d.device.capacity_bytes))
            table = ReadTable()
            table.add_columns("component", "GiB", "how it is estimated")
            for name, line in d.lines.items():
                table.add_row(f"{SHORT[name]} {name}", f"{line.bytes / 2**30:.3f}", line.method)
            widgets.append(table)
        if len(plan.devices) > 1:
            total = sum(d.total_bytes for d in plan.devices)
            capacity = sum(d.device.capacity_bytes or 0 for d in plan.devices)
            if all(d.device.kind == "cpu" for d in plan.devices):  # torchrun's ranks on the CPU: one host's memory
                widgets.append(Static(
                    f"[yellow]Note:[/] the {len(plan.devices)} CPU ranks are processes sharing one host's memory "
                    f"({gib(capacity)} available): each is planned against an equal share of it."))
            else:
                widgets.append(Static(
                    f"[yellow]Note:[/] the sum over {len(plan.devices)} devices ({gib(total)} of {gib(capacity)}) is "
                    "not a placement: CUDA does not pool GPU memory, so each device above must fit on its own."))
        widgets.append(Static(f"[dim]convention: {plan.convention}[/]"))
        # no ids inside the body: its old children are still being removed when the new ones mount
        self._traced_slot = Static("[dim]traced plan: tracing one step on fake tensors (torch MemTracker) in a child "
                                   "process…[/]", classes="traced")
        widgets.append(self._traced_slot)
        body.mount_all(widgets)
        if not getattr(self, "_focused_once", False):
            self._focused_once = True
            body.focus()  # ↑/↓/PgUp/PgDn scroll the plan (the traced plan and the convention are below the fold)
        self.app.state.traced = None
        self.trace(spec, ctx)
        runnable = ctx.source.runnable and all(d.fits is not False for d in plan.devices)
        self.query_one("#next", Button).disabled = not runnable
        if not ctx.source.runnable:
            self.query_one("#plan-error", Static).update("this model is a config without weights: planned, not run")

    @work(thread=True, exclusive=True, group="trace")
    def trace(self, spec: Any, ctx: Any) -> None:
        """The traced plan in a child process (core.traced), shown beside the analytic one when it arrives."""
        from textual.worker import get_current_worker

        from core.traced import traced_table

        worker = get_current_worker()
        tracer = self.app.tracer or traced_table
        traced = tracer(spec, ctx, cancelled=lambda: worker.is_cancelled)
        if not worker.is_cancelled:
            self.app.call_from_thread(self.show_traced, spec, traced)

    def show_traced(self, spec: Any, traced: dict[str, Any]) -> None:
        state = self.app.state
        if spec != state.spec:
            return  # a what-if change made this trace stale; its own trace follows
        state.traced = traced
        if state.run is not None and state.run.spec == spec and state.run.traced is None:
            state.run.traced = traced  # the probe started before the trace finished: the record still gets it
        slot = getattr(self, "_traced_slot", None)
        if slot is None or not slot.is_attached:
            return  # the plan was redrawn meanwhile
        from core.pipeline import traced_summary
        from core.traced import relative_text

        if traced.get("status") != "estimated":
            slot.update(f"[dim]{traced_summary(traced)}[/]")
            return
        slot.update(f"[b]Traced plan, ESTIMATE[/b]: one step on fake tensors ({traced['seconds']:.1f} s) for "
                    f"{traced['compared_with']}; differs most from the analytic plan: {traced['most_different']}")
        table = ReadTable(classes="traced-table")
        table.add_columns("component", "analytic GiB", "traced GiB", "difference")
        for name, row in traced["lines"].items():
            a, t = row["analytic_bytes"], row["traced_bytes"]
            rel = relative_text(a, t)
            table.add_row(f"{SHORT[name]} {name}", f"{a / 2**30:.3f}", f"{t / 2**30:.3f}", rel)
        a, t = traced["analytic_tensor_bytes"], traced["peak_bytes"]
        table.add_row("tensors total", f"{a / 2**30:.3f}", f"{t / 2**30:.3f}", relative_text(a, t))
        note = Static(f"[dim]{traced['note']} Method: {traced['method']}.[/]")
        self.query_one("#plan-body", VerticalScroll).mount(table, note, after=slot)

    def _what_if(self, **change: Any) -> None:
        from core.errors import SpecError
        from core.spec import RunSpec

        spec = self.app.state.spec
        if spec is None:
            return
        try:
            new = RunSpec.from_dict({**spec.to_dict(), **change})
        except SpecError as exc:
            self.notify(str(exc), severity="warning")
            return
        self.replan(new)

    def action_batch(self, factor: float) -> None:
        spec = self.app.state.spec
        self._what_if(batch_size=max(1, int(spec.batch_size * factor)))

    def action_seq(self, factor: float) -> None:
        spec = self.app.state.spec
        self._what_if(seq_len=max(2, int(spec.seq_len * factor)))

    def action_next(self) -> None:
        if self.query_one("#next", Button).disabled:
            return
        from tui.screens.stages import ProbeScreen

        run = self.app.state.run
        if run is not None and run.spec != self.app.state.spec:
            self.app.finish_run()  # a changed setup is a new run: never show the old run's results as this one's

        self.app.push_screen(ProbeScreen())
