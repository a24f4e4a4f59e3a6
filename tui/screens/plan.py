"""Screen 3: the memory plan, per device and per component, with what-if keys for batch size and sequence length."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Button, Footer, Header, LoadingIndicator, Static

from core.api import component_label
from tui.screens.base import WizardScreen
from tui.screens.nav import NavButtons
from tui.screens.registry import screen_named
from tui.widgets.bars import PlanBar, gib, short_name
from tui.widgets.tables import ReadTable, wrapped_table

BATCH = Binding.Group("batch ÷2 ×2")
SEQ = Binding.Group("seq ÷2 ×2")


class PlanScreen(NavButtons, WizardScreen):
    """Estimated bytes per component on each device, against that device's capacity. Nothing runs yet."""

    BINDINGS = [
        # grouped: the footer shows "b B batch ÷2 ×2" in the room of one key, so ? Terms is not cut at 80 columns
        Binding("b", "batch(0.5)", "batch ÷2", group=BATCH), Binding("B", "batch(2)", "batch ×2", group=BATCH),
        Binding("s", "seq(0.5)", "seq ÷2", group=SEQ), Binding("S", "seq(2)", "seq ×2", group=SEQ),
        Binding("ctrl+n", "next", "Probe"),
        Binding("f", "use_largest", "fits"),
        Binding("p", "probe_anyway", "probe anyway"),
    ]
    DEFAULT_CSS = "PlanScreen #plan-body.stale { opacity: 50%; }"  # the old plan while the new one is made

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Footer keys follow the plan: ^n Probe is dimmed while it cannot run or does not fit (the "Probe anyway"
        button is the deliberate way on; ^n then says so), f shows only when a smaller micro-batch would fit."""
        if action == "use_largest":
            return True if getattr(self, "_largest_batch", None) else False
        if action == "probe_anyway":  # the key of the "Probe anyway" button, offered only where ^n is not
            return True if getattr(self, "_unfit", False) else False
        return super().check_action(action, parameters)

    def action_probe_anyway(self) -> None:
        if getattr(self, "_unfit", False) and not self.query_one("#next", Button).disabled:
            self.app.state.probe_anyway = True  # the deliberate choice: probe to learn what the step really needs
            self._start_probe()

    def next_blocked(self) -> str | None:
        """Why ^n does not probe: the plan is being made, cannot run here, or does not fit (then what does)."""
        try:
            button = self.query_one("#next", Button)
        except Exception:  # noqa: BLE001 - before compose
            return "the plan is being made"
        if getattr(self, "_unfit", False):
            largest = getattr(self, "_largest_batch", None)
            fits = f"f takes micro-batch {largest}, which fits; " if largest else "b / s lower the micro-batch / sequence; "
            return f"^n probes only a plan that fits: {fits}p (Probe anyway) measures this one"
        if button.disabled:
            error = str(self.query_one("#plan-error", Static).content)
            return error or "the plan is being made"
        return None

    def _probe_ready(self) -> bool:
        return self.next_blocked() is None

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
            yield Button("Use the largest that fits", id="use-largest", variant="success")
            yield Button("Run the probe →", id="next", variant="primary", disabled=True)
        yield Footer(show_command_palette=False)  # no ^p palette key: at 80 columns every key shows

    def on_mount(self) -> None:
        self.query_one("#use-largest").display = False
        self.replan(self.app.state.spec)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "use-largest":
            self.action_use_largest()
        elif event.button.id == "next" and getattr(self, "_unfit", False):
            self.action_probe_anyway()
        else:
            super().on_button_pressed(event)

    def set_fit(self, unfit: bool, refusal: str | None, largest_batch: int | None) -> None:
        """The nav buttons and footer keys for a plan that fits, does not fit, or cannot run here.

        A plan that does not fit is not a dead end: "Probe anyway" runs the probe all the same (the plan stage stays
        failed; the measurement says whether the plan was too pessimistic), and the largest micro-batch that fits is
        offered (f)."""
        spec = self.app.state.spec
        assert spec is not None  # the plan screen shows the plan of a valid spec (setup's Next)
        self._unfit = unfit and refusal is None
        self._largest_batch = largest_batch if unfit and largest_batch and largest_batch != spec.batch_size else None
        nxt = self.query_one("#next", Button)
        nxt.disabled = refusal is not None
        nxt.label = "p: Probe anyway →" if self._unfit else "Run the probe →"
        nxt.variant = "warning" if self._unfit else "primary"
        use = self.query_one("#use-largest", Button)
        use.display = self._largest_batch is not None
        if self._largest_batch is not None:
            use.label = f"f: micro-batch {self._largest_batch} fits"
        if refusal is not None:  # planned, but it cannot run here: say why before Next (the probe would refuse it)
            self.query_one("#plan-error", Static).update(f"planned, not runnable here: {refusal}")
        elif self._unfit:
            thin = (" with under 5 % of the device left: a little less free memory and it does not"
                    if getattr(self, "_thin", False) else "")
            hint = (f"micro-batch {self._largest_batch} fits (f){thin}" if self._largest_batch else
                    "lower the micro-batch (b) or the sequence length (s)")
            self.query_one("#plan-error", Static).update(
                f"the plan does not fit: {hint}; or probe anyway (p) to measure what the step really needs")
        self.refresh_bindings()

    def action_use_largest(self) -> None:
        if getattr(self, "_largest_batch", None):
            self._what_if(batch_size=self._largest_batch)

    @work(thread=True, exclusive=True, group="plan")
    def replan(self, spec: Any) -> None:
        """The plan of ``spec`` with the largest micro-batch that fits (:func:`core.api.plan_report`, as ``gpuaccept
        plan --max-batch``; the traced plan follows from :meth:`trace`), and why it cannot run here, if it cannot."""
        from core.api import plan_report, runnable_reason
        from core.errors import GpuAcceptError

        try:
            report = plan_report(spec, max_batch=True, devices_override=self._devices_for(spec))
            # the capacity is read once for this screen: b / B / s / S replan against the same reading, so the
            # largest micro-batch that fits does not move with free memory between key presses
            self._devices_read = (_devices_key(spec), report.ctx.devices)
            refusal = runnable_reason(spec, report.ctx, allow_unfit=True)  # a plan that does not fit: probe anyway
        except GpuAcceptError as exc:
            self.app.call_from_thread(self.show_error, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - one line on screen, never a traceback
            self.app.call_from_thread(self.show_error, f"{type(exc).__name__}: {exc}")
            return
        self.app.call_from_thread(self.show_plan, report, refusal)

    def _devices_for(self, spec: Any) -> list[Any] | None:
        """The devices to plan ``spec`` for: the app's override, else those this screen read for the same devices
        setting (their capacity read once, its time shown beside it), else None: the plan reads them now."""
        if self.app.state.devices_override is not None:
            return self.app.state.devices_override
        read = getattr(self, "_devices_read", None)
        return read[1] if read is not None and read[0] == _devices_key(spec) else None

    def show_error(self, message: str) -> None:
        self.query_one("#loading").display = False
        self.query_one("#plan-body", VerticalScroll).set_class(False, "stale")
        self.query_one("#plan-error", Static).update(f"cannot plan: {message}  (Esc: back to the setup)")
        self.query_one("#next", Button).disabled = True

    def show_plan(self, report: Any, refusal: str | None = None) -> None:
        """Draw ``report`` (:class:`core.api.PlanReport`): per device its fit, bar, phases, largest micro-batch and
        components; then start its trace (or show the one made before for the same setting)."""
        spec, ctx = report.spec, report.ctx
        largest = report.largest.get("batch_size")
        state = self.app.state
        state.spec, state.ctx = spec, ctx
        self.query_one("#loading").display = False
        self.query_one("#plan-error", Static).update("")
        body = self.query_one("#plan-body", VerticalScroll)
        body.set_class(False, "stale")
        body.remove_children()
        plan = ctx.plan
        precision = f"{spec.precision} {spec.dtype}" if spec.training and spec.dtype != "fp32" else spec.dtype
        widgets: list[Any] = [Static(
            f"{spec.model} · {spec.mode} · {precision} · {spec.attn_implementation} · micro-batch {spec.batch_size} × "
            f"{spec.seq_len} tokens · parameters {plan.parameters.total:,} ({plan.parameters.trainable:,} trainable)"
            + (f" · {spec.recipe_text()}" if spec.training and spec.beyond_own_recipe() is not None else ""))]
        by_device = {x.device: x for x in largest or []}
        for d in plan.devices:
            widgets.extend(self._device_widgets(d, plan, by_device.get(d.device.name)))
        widgets.extend(_several_devices_note(plan))
        widgets.append(Static(f"[dim]convention: {plan.convention}[/]"))
        # no ids inside the body: its old children are still being removed when the new ones mount
        self._traced_slot = Static(f"[dim]{TRACING}…[/]", classes="traced")
        widgets.append(self._traced_slot)
        body.mount_all(widgets)
        body.scroll_home(animate=False)  # after b/B/s/S the new total is the first thing seen, not scrolled away
        if not getattr(self, "_focused_once", False):
            self._focused_once = True
            body.focus()  # ↑/↓/PgUp/PgDn scroll the plan (the traced plan and the convention are below the fold)
        self.app.state.traced = None
        cached = self.app.state.traced_cache.get(traced_key(spec, ctx))
        if cached is not None:  # b / B / s / S back to a setting traced before: the same trace, at once
            self.show_traced(spec, cached)
        else:
            self._start_trace_timer()
            self.trace(spec, ctx)
        values = [x.value for x in largest or [] if x.value is not None]
        self._thin = any(x.thin for x in largest or [] if x.value == min(values or [0]))
        self.set_fit(not report.all_fit, refusal, min(values) if values else None)


    def _device_widgets(self, d: Any, plan: Any, most: Any) -> list[Any]:
        """One device's part of the plan: its verdict against its capacity, the bar of what is alive at the peak, the
        phases, the largest micro-batch that fits (``most``), the components with how each is estimated, and what is
        alive at each phase's peak."""
        widgets: list[Any] = []
        verdict = {True: "fits", False: "DOES NOT FIT", None: "fit unknown"}[d.fits]
        # which capacity, said once per device on every screen: total, available, a cgroup limit, given
        # (core/plan/devices.py DeviceInfo.capacity_short: "23.04 GiB available (read at 14:02:11)")
        cap = d.device.capacity_short()
        kind = d.device.kind
        peak = d.peak_phase
        widgets.append(Static(f"[b]{d.device.name}[/b] {d.device.label}: peak {gib(d.total_bytes)} of {cap} → "
                              f"[{'green' if d.fits is not False else 'red'}]{verdict}[/]"))
        alive = peak.components if peak else {k: line.bytes for k, line in d.lines.items()}
        widgets.append(PlanBar(alive, d.device.capacity_bytes, lines={k: line.bytes for k, line in d.lines.items()},
                               kind=kind))
        if len(d.phases) > 1:
            widgets.append(Static("phases: " + " · ".join(
                f"{p.name.replace('_', ' ')} {p.total_bytes / 2**30:.2f}"
                + (f" [b]◀ peak[/b] ({p.at})" if p is peak else "") for p in d.phases.values()) + " GiB"))
        if most is not None and most.value is not None:
            approximate = "" if plan.activation_model == "op-by-op" else (
                " [yellow]· analytic, Korthikanti's approximation for this model: see the traced plan below[/]")
            widgets.append(Static(largest_text(most) + approximate))
        # the amounts first, one row each (above the fold at 80x24); then how each is estimated, wrapped, not cut
        table = ReadTable()
        table.add_columns("component", "GiB", "share of the sum")
        total = sum(line.bytes for line in d.lines.values()) or 1
        for name, line in d.lines.items():
            table.add_row(f"{short_name(name, kind)} {component_label(name, kind)}", f"{line.bytes / 2**30:.3f}",
                          f"{100 * line.bytes / total:.0f} %")
        widgets.append(table)
        widgets.append(Static(wrapped_table(
            ["", "how each is estimated (its largest value in the step)"],
            [[short_name(name, kind), line.method] for name, line in d.lines.items()]), classes="methods"))
        if len(d.phases) > 1:
            rows = []
            for p in d.phases.values():
                parts = ", ".join(f"{short_name(k, kind)} {v / 2**30:.2f}" for k, v in p.components.items() if v)
                rows.append([p.name.replace("_", " ") + (" ◀ peak" if p is peak else ""),
                             f"{p.total_bytes / 2**30:.3f}", f"{parts} (at {p.at})"])
            # wrapped: what is alive at each phase's peak was cut at 80 columns
            widgets.append(Static(wrapped_table(["phase of the step", "GiB", "alive at its peak"], rows),
                                  classes="phases"))
            widgets.append(Static(f"[dim]The components' largest values sum to {gib(d.sum_of_lines)}; no moment "
                                  f"of the step holds them all: the plan is the peak phase, {gib(d.total_bytes)}.[/]"))
        return widgets

    @work(thread=True, exclusive=True, group="trace")
    def trace(self, spec: Any, ctx: Any) -> None:
        """The traced plan in a child process (core.plan.traced), shown beside the analytic one when it arrives."""
        from textual.worker import get_current_worker

        from core.api import traced_table

        worker = get_current_worker()
        tracer = self.app.tracer or traced_table
        traced = tracer(spec, ctx, cancelled=lambda: worker.is_cancelled)
        if traced.get("status") == "estimated":  # a failed or cancelled trace is tried again next time
            self.app.state.traced_cache[traced_key(spec, ctx)] = traced
        if not worker.is_cancelled:
            self.app.call_from_thread(self.show_traced, spec, traced)

    def _start_trace_timer(self) -> None:
        """The traced plan takes seconds to minutes (a child imports torch, then traces the step): say so, with a
        clock, until it arrives."""
        import time

        old = getattr(self, "_trace_timer", None)
        if old is not None:
            old.stop()
        started = time.monotonic()

        def tick() -> None:
            slot = getattr(self, "_traced_slot", None)
            if slot is not None and slot.is_attached and self.app.state.traced is None:
                slot.update(f"[dim]{TRACING}… {time.monotonic() - started:.0f} s[/]")

        self._trace_timer = self.set_interval(1.0, tick)

    def show_traced(self, spec: Any, traced: dict[str, Any]) -> None:
        state = self.app.state
        if spec != state.spec:
            return  # a what-if change made this trace stale; its own trace follows
        timer = getattr(self, "_trace_timer", None)
        if timer is not None:
            timer.stop()
        state.traced = traced
        recipe = None if state.run is None or state.command_run() else state.recipe_run()
        if recipe is not None and recipe.spec == spec and recipe.traced is None:
            recipe.traced = traced  # the probe started before the trace finished: the record still gets it
        slot = getattr(self, "_traced_slot", None)
        if slot is None or not slot.is_attached:
            return  # the plan was redrawn meanwhile
        from core.api import relative_text, traced_summary

        if traced.get("status") != "estimated":
            slot.update(f"[dim]{traced_summary(traced)}[/]")
            return
        most = traced["most_different"]
        row = traced["lines"].get(most)
        by = (f" ({(row['traced_bytes'] - row['analytic_bytes']) / 2**30:+.2f} GiB traced − analytic: the largest "
              "difference in bytes, not in per cent)") if row else ""
        slot.update(f"[b]Traced plan, ESTIMATE[/b]: one step on fake tensors ({traced['seconds']:.1f} s) for "
                    f"{traced['compared_with']}; differs most from the analytic plan: {most}{by}")
        table = ReadTable(classes="traced-table")
        table.add_columns("component", "analytic GiB", "traced GiB", "difference")
        for name, row in traced["lines"].items():
            a, t = row["analytic_bytes"], row["traced_bytes"]
            rel = relative_text(a, t)
            kind = state.ctx.devices[0].kind if state.ctx is not None and state.ctx.devices else "cuda"
            table.add_row(f"{short_name(name, kind)} {component_label(name, kind)}", f"{a / 2**30:.3f}",
                          f"{t / 2**30:.3f}", rel)
        for name, row in traced.get("phase_totals", {}).items():
            a, t = row["analytic_bytes"], row["traced_bytes"]
            table.add_row(f"phase {name.replace('_', ' ')}", f"{a / 2**30:.3f}", f"{t / 2**30:.3f}", relative_text(a, t))
        a, t = traced["analytic_tensor_bytes"], traced["peak_bytes"]
        table.add_row("peak of tensors", f"{a / 2**30:.3f}", f"{t / 2**30:.3f}", relative_text(a, t))
        widgets = [table, Static(self.untraced_text()), *self.device_memory_widgets(traced),
                   Static(self.fit_text(traced)), Static(f"[dim]{traced['note']} Method: {traced['method']}.[/]")]
        self.query_one("#plan-body", VerticalScroll).mount(*widgets, after=slot)

    @staticmethod
    def device_memory_widgets(traced: dict[str, Any]) -> list[Any]:
        """The steady-state step as the device's counters will show it: peak allocated, peak reserved (the caching
        allocator's replay) and NVML used side by side, each with its method; the reserved slack line by line; what
        expandable segments would change. Nothing on a CPU device (no caching allocator)."""
        memory = traced.get("device_memory")
        if not memory:
            return []
        table = ReadTable(classes="traced-table")
        table.add_columns("as the GPU counts it", "GiB", "how (ESTIMATE)")
        for key, label in (("allocated", "peak allocated"), ("reserved", "peak reserved"), ("nvml_used", "NVML used")):
            table.add_row(label, f"{memory[key + '_bytes'] / 2**30:.3f}", memory["methods"][key])
        for row in memory["slack"]:
            table.add_row("  slack", f"{row['bytes'] / 2**30:.3f}", row["what"])
        grown = memory.get("expandable_segments_reserved_bytes")
        saves = None if grown is None else memory["reserved_bytes"] - grown
        what_if = "" if saves is None else (
            " With expandable_segments:True (--alloc-conf) the peak reserved would be "
            + (f"{saves / 2**20:.0f} MiB lower." if saves > 0 else f"{-saves / 2**20:.0f} MiB higher." if saves < 0
               else "the same."))
        return [table, Static("[dim]Reserved is what the caching allocator holds from the driver (cached free blocks "
                              "included); NVML used adds what lies outside it (the CUDA context). The fit is judged "
                              f"on the largest.{escape(what_if)}[/]")]

    def untraced_text(self) -> str:
        """Why the table's phase rows are below the phases line above: they hold tensors only."""
        ctx = self.app.state.ctx
        assert ctx is not None  # a traced table is shown for the plan shown
        plan = ctx.plan
        untraced = plan.devices[0].untraced_bytes if plan.devices else 0
        return (f"[dim]The rows are tensor bytes: the phases line above also holds the {gib(untraced)} a trace "
                "cannot see (the overhead line, DDP's buckets).[/]" if untraced else
                "[dim]The rows are tensor bytes, as the phases line above.[/]")

    def fit_text(self, traced: dict[str, Any]) -> str:
        """The fit verdict judged by the larger of the analytic and traced peaks (core/plan/fit.py); a plan that fits only
        by the smaller one is not a fit: Next is disabled and the reason shown."""
        from core.api import all_fit, fit_verdicts

        ctx = self.app.state.ctx
        assert ctx is not None  # a traced table is shown for the plan shown
        fits = fit_verdicts(ctx.plan, traced)
        parts = []
        for f in fits:
            verdict = {True: "[green]fits[/]", False: "[red]DOES NOT FIT[/]", None: "fit unknown"}[f.fits]
            parts.append(f"{f.device} {gib(f.bytes)} → {verdict}")
        if not all_fit(fits) and not getattr(self, "_unfit", False):
            # the traced peak decides it; the analytic search's largest batch fits only by the analytic peak, so
            # none is offered: lower it by hand (b), or probe anyway
            self.set_fit(True, None, None)
        heading = ("Fit, judged by the largest of the analytic and traced peaks and the predicted NVML used: "
                   if any(f.device_bytes is not None for f in fits) else
                   "Fit, judged by the larger of the analytic and traced peaks: ")
        return heading + "; ".join(parts + [f.untraced_note for f in fits[:1]])

    def _what_if(self, **change: Any) -> None:
        from core.errors import SpecError
        from core.spec import RunSpec

        spec = self.app.state.spec
        if spec is None:
            return
        try:
            new = RunSpec.from_dict({**spec.to_file_dict(), **change})
        except SpecError as exc:
            self.notify(str(exc), severity="warning")
            return
        self.show_replanning(spec, new)
        self.replan(new)

    def show_replanning(self, old: Any, new: Any) -> None:
        """At once, before the new plan: the old numbers are dimmed under a line naming the setting being planned
        (issue 51: after b the old plan stayed for seconds with no word, and the first b seemed to do nothing)."""
        body = self.query_one("#plan-body", VerticalScroll)
        body.set_class(True, "stale")
        self.query_one("#plan-error", Static).update(
            f"replanning for micro-batch {new.batch_size} × {new.seq_len} tokens (was {old.batch_size} × "
            f"{old.seq_len}); the numbers above are the old plan's…")
        self.query_one("#next", Button).disabled = True  # no probe of the old plan while the new one is made
        self.refresh_bindings()

    def action_batch(self, factor: float) -> None:
        spec = self.app.state.spec
        assert spec is not None  # the plan screen shows the plan of a valid spec (setup's Next)
        self._what_if(batch_size=max(1, int(spec.batch_size * factor)))

    def action_seq(self, factor: float) -> None:
        spec = self.app.state.spec
        assert spec is not None  # the plan screen shows the plan of a valid spec (setup's Next)
        self._what_if(seq_len=max(2, int(spec.seq_len * factor)))

    def action_next(self) -> None:
        if not self._probe_ready():
            return  # a plan that does not fit is probed only by the "Probe anyway" button
        self.app.state.probe_anyway = False
        self._start_probe()

    def _start_probe(self) -> None:
        run = self.app.state.run
        if run is not None and run.spec != self.app.state.spec:
            self.app.finish_run()  # a changed setup is a new run: never show the old run's results as this one's

        self.app.push_screen(screen_named("probe"))


#: what the traced plan's slot says while the trace runs (a clock follows)
TRACING = ("traced plan: tracing one step on fake tensors (torch MemTracker) in a child process; the plan above "
           "is usable meanwhile")


def traced_key(spec: Any, ctx: Any) -> str:
    """What a traced plan depends on: the whole spec and the devices planned for (a trace of an equal key is equal)."""
    import json

    return json.dumps([spec.to_dict(), [d.name for d in ctx.devices]], sort_keys=True, default=str)


def _devices_key(spec: Any) -> tuple[str, int]:
    """What the devices planned for depend on: the devices setting and the CPU ranks (not batch or sequence)."""
    return spec.devices, spec.local_world_size(1)


def largest_text(largest: Any) -> str:
    """One line on the fit search: the largest micro-batch whose plan leaves the headroom (core.plan.search's
    headroom_rule), then the largest that fits at all, each with its headroom (in MiB below 0.1 GiB: never 0.00)."""
    from core.api import headroom_text

    if largest.value == 0:
        return "[red]not even a micro-batch of 1 fits[/]"
    if largest.recommended is None:  # a search without a headroom rule
        return (f"largest micro-batch that fits: [b]{largest.value}[/b] (plan {gib(largest.plan_bytes)}, headroom "
                f"{headroom_text(largest.headroom_bytes)}; {largest.limit})")
    keep = f"{100 * (1 - largest.share):g} % headroom"
    first = (f"largest micro-batch that leaves {keep}: [b]{largest.recommended}[/b] (plan "
             f"{gib(largest.recommended_bytes)}, headroom {headroom_text(largest.recommended_headroom_bytes)})"
             if largest.recommended else f"no micro-batch leaves {keep}")
    return (f"{first}; that fits at all: {largest.value} (headroom {headroom_text(largest.headroom_bytes)}; "
            f"{largest.limit})")



def _several_devices_note(plan: Any) -> list[Any]:
    """Under a plan of several devices: CPU ranks share one host's memory; a GPU box's total is not a placement."""
    if len(plan.devices) < 2:
        return []
    total = sum(d.total_bytes for d in plan.devices)
    capacity = sum(d.device.capacity_bytes or 0 for d in plan.devices)
    if all(d.device.kind == "cpu" for d in plan.devices):  # torchrun's ranks on the CPU: one host's memory
        return [Static(f"[yellow]Note:[/] the {len(plan.devices)} CPU ranks are processes sharing one host's memory "
                       f"({gib(capacity)} available): each is planned against an equal share of it.")]
    of = gib(capacity) if all(d.device.capacity_bytes for d in plan.devices) else "an unknown capacity"
    return [Static(f"[yellow]Note:[/] the sum over {len(plan.devices)} devices ({gib(total)} of {of}) is "
                   "not a placement: CUDA does not pool GPU memory, so each device above must fit on its own.")]
