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

        from core.fit import largest_fitting
        from core.pipeline import runnable_reason

        try:
            ctx = make_plan(spec, self.app.state.devices_override)
            largest = largest_fitting(spec, ctx.config, ctx.devices, "batch_size")
            refusal = runnable_reason(spec, ctx)
        except GpuAcceptError as exc:
            self.app.call_from_thread(self.show_error, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - one line on screen, never a traceback
            self.app.call_from_thread(self.show_error, f"{type(exc).__name__}: {exc}")
            return
        self.app.call_from_thread(self.show_plan, spec, ctx, largest, refusal)

    def show_error(self, message: str) -> None:
        self.query_one("#loading").display = False
        self.query_one("#plan-error", Static).update(f"cannot plan: {message}  (Esc: back to the setup)")
        self.query_one("#next", Button).disabled = True

    def show_plan(self, spec: Any, ctx: Any, largest: list[Any] | None = None, refusal: str | None = None) -> None:
        state = self.app.state
        state.spec, state.ctx = spec, ctx
        self.query_one("#loading").display = False
        self.query_one("#plan-error", Static).update("")
        body = self.query_one("#plan-body", VerticalScroll)
        body.remove_children()
        plan = ctx.plan
        precision = f"{spec.precision} {spec.dtype}" if spec.training and spec.dtype != "fp32" else spec.dtype
        widgets: list[Any] = [Static(
            f"{spec.model} · {spec.mode} · {precision} · {spec.attn_implementation} · micro-batch {spec.batch_size} × "
            f"{spec.seq_len} tokens · parameters {plan.parameters.total:,} ({plan.parameters.trainable:,} trainable)")]
        by_device = {x.device: x for x in largest or []}
        for d in plan.devices:
            verdict = {True: "fits", False: "DOES NOT FIT", None: "fit unknown"}[d.fits]
            cap = gib(d.device.capacity_bytes) if d.device.capacity_bytes else "unknown capacity"
            peak = d.peak_phase
            widgets.append(Static(f"[b]{d.device.name}[/b] {d.device.label}: peak {gib(d.total_bytes)} of {cap} → "
                                  f"[{'green' if d.fits is not False else 'red'}]{verdict}[/]"))
            alive = peak.components if peak else {k: line.bytes for k, line in d.lines.items()}
            widgets.append(PlanBar(alive, d.device.capacity_bytes))
            if len(d.phases) > 1:
                widgets.append(Static("phases: " + " · ".join(
                    f"{p.name.replace('_', ' ')} {p.total_bytes / 2**30:.2f}"
                    + (f" [b]◀ peak[/b] ({p.at})" if p is peak else "") for p in d.phases.values()) + " GiB"))
            most = by_device.get(d.device.name)
            if most is not None and most.value is not None:
                approximate = "" if plan.activation_model == "op-by-op" else (
                    " [yellow]· analytic, Korthikanti's approximation for this model: see the traced plan below[/]")
                widgets.append(Static(largest_text(most) + approximate))
            table = ReadTable()
            table.add_columns("component", "GiB", "how it is estimated (its largest value in the step)")
            for name, line in d.lines.items():
                table.add_row(f"{SHORT[name]} {name}", f"{line.bytes / 2**30:.3f}", line.method)
            widgets.append(table)
            if len(d.phases) > 1:
                phases = ReadTable()
                phases.add_columns("phase of the step", "GiB", "alive at its peak")
                for p in d.phases.values():
                    parts = ", ".join(f"{SHORT[k]} {v / 2**30:.2f}" for k, v in p.components.items() if v)
                    phases.add_row(p.name.replace("_", " ") + (" ◀ peak" if p is peak else ""),
                                   f"{p.total_bytes / 2**30:.3f}", f"{parts} (at {p.at})")
                widgets.append(phases)
                widgets.append(Static(f"[dim]The components' largest values sum to {gib(d.sum_of_lines)}; no moment "
                                      f"of the step holds them all: the plan is the peak phase, {gib(d.total_bytes)}.[/]"))
        if len(plan.devices) > 1:
            total = sum(d.total_bytes for d in plan.devices)
            capacity = sum(d.device.capacity_bytes or 0 for d in plan.devices)
            if all(d.device.kind == "cpu" for d in plan.devices):  # torchrun's ranks on the CPU: one host's memory
                widgets.append(Static(
                    f"[yellow]Note:[/] the {len(plan.devices)} CPU ranks are processes sharing one host's memory "
                    f"({gib(capacity)} available): each is planned against an equal share of it."))
            else:
                of = gib(capacity) if all(d.device.capacity_bytes for d in plan.devices) else "an unknown capacity"
                widgets.append(Static(
                    f"[yellow]Note:[/] the sum over {len(plan.devices)} devices ({gib(total)} of {of}) is "
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
        self.query_one("#next", Button).disabled = refusal is not None
        if refusal is not None:  # planned, but it cannot run here: say why before Next (the probe would refuse it)
            self.query_one("#plan-error", Static).update(f"planned, not runnable here: {refusal}")

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
        for name, row in traced.get("phase_totals", {}).items():
            a, t = row["analytic_bytes"], row["traced_bytes"]
            table.add_row(f"phase {name.replace('_', ' ')}", f"{a / 2**30:.3f}", f"{t / 2**30:.3f}", relative_text(a, t))
        a, t = traced["analytic_tensor_bytes"], traced["peak_bytes"]
        table.add_row("peak of tensors", f"{a / 2**30:.3f}", f"{t / 2**30:.3f}", relative_text(a, t))
        widgets = [table, Static(self.fit_text(traced)), Static(f"[dim]{traced['note']} Method: {traced['method']}.[/]")]
        self.query_one("#plan-body", VerticalScroll).mount(*widgets, after=slot)

    def fit_text(self, traced: dict[str, Any]) -> str:
        """The fit verdict judged by the larger of the analytic and traced peaks (core/fit.py); a plan that fits only
        by the smaller one is not a fit: Next is disabled and the reason shown."""
        from core.fit import fit_verdicts

        ctx = self.app.state.ctx
        fits = fit_verdicts(ctx.plan, traced)
        parts = []
        for f in fits:
            verdict = {True: "[green]fits[/]", False: "[red]DOES NOT FIT[/]", None: "fit unknown"}[f.fits]
            parts.append(f"{f.device} {gib(f.bytes)} → {verdict}")
        if any(f.fits is False for f in fits):
            self.query_one("#next", Button).disabled = True
            self.query_one("#plan-error", Static).update("the plan does not fit (judged by the larger of the analytic "
                                                         "and traced peaks): lower the micro-batch (b) or the "
                                                         "sequence length (s)")
        return "Fit, judged by the larger of the analytic and traced peaks: " + "; ".join(
            parts + [f.untraced_note for f in fits[:1]])

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


def largest_text(largest: Any) -> str:
    """One line on the fit search: the largest micro-batch whose plan fits the device, with its headroom."""
    if largest.value == 0:
        return "[red]not even a micro-batch of 1 fits[/]"
    return (f"largest micro-batch that fits: [b]{largest.value}[/b] (plan {gib(largest.plan_bytes)}, headroom "
            f"{gib(largest.headroom_bytes)}; {largest.limit})")
