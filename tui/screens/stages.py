"""Screens 4-6: the stages that run real work in child processes — probe, train + evaluate, kill and resume.

Each screen runs its stage generator (core.pipeline.AcceptanceRun) in a thread worker, receives the stage's events as
messages, and draws them. A stage already finished (its result is in the run) is shown without running again.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Button, Footer, Header, ProgressBar, Sparkline, Static

from tui.screens.base import WizardScreen
from tui.screens.messages import StageDone, StageEvent
from tui.screens.nav import NavButtons
from tui.screens.registry import screen_named
from tui.widgets.bars import LiveBar, gib
from tui.widgets.tables import ReadTable

#: a resume check's mark: ✓ pass, – a check this run cannot make (its evidence says why), ✗ anything else
CHECK_MARKS = {"pass": "[$success]✓[/]", "not_applicable": "[$text-muted]–[/]"}


class StageScreen(NavButtons, WizardScreen):
    """Base of the running screens: a worker, a progress bar, a log line, and Next once the stage has ended."""

    stage = ""
    step = ""
    intro = ""
    BINDINGS = [Binding("ctrl+n", "next", "Next")]
    #: what the stage's child is doing before its first step (core.events.Waiting), shown with the seconds elapsed
    _waiting: Any = None
    _wait_timer: Any = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(self.step, classes="title")
        yield Static(self.intro, classes="intro")
        with VerticalScroll(classes="body", id="stage-body"):
            yield ProgressBar(id="progress", show_eta=False)
            yield Static("", id="status")
            yield from self.compose_body()
        yield Static("", classes="error", id="stage-error")
        with Horizontal(classes="nav"):
            yield Button("← Back", id="back")
            yield Button("Next →", id="next", variant="primary", disabled=True)
        yield Footer(show_command_palette=False)  # no ^p palette key: at 80 columns every key shows

    def compose_body(self) -> ComposeResult:
        yield from ()

    def on_mount(self) -> None:
        self.query_one("#stage-body").focus()  # ↑↓ PgUp PgDn scroll what does not fit
        run = self.app.state.run
        result = run.results.get(self.stage) if run is not None else None
        if result is not None:
            self.query_one("#progress", ProgressBar).update(total=1, progress=1)
            self.show_result(result)
            self.query_one("#next", Button).disabled = False
            self.refresh_bindings()
        else:
            self.app.state.running = self.stage  # now, not when the worker starts: the footer dims ^n and Esc
            self.run_stage()
            self.app.refresh_bindings()

    def stage_generator(self, cancelled: Callable[[], bool]) -> Generator[Any, None, Any]:
        raise NotImplementedError

    @work(thread=True, exclusive=True, group="stage")
    def run_stage(self) -> None:
        from core.errors import GpuAcceptError
        from core.events import ChildStarted

        state = self.app.state
        state.cancel.clear()
        state.running = self.stage
        result, error = None, None
        try:
            gen = self.stage_generator(state.cancel.is_set)
            while True:
                event = next(gen)
                if isinstance(event, ChildStarted):
                    state.children.add(event.pid)  # so a hang-up can kill it without the event loop
                self.post_message(StageEvent(event))
        except StopIteration as stop:
            result = stop.value
        except GpuAcceptError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - shown on screen; the run directory keeps the logs
            error = f"{type(exc).__name__}: {exc}"
        finally:
            state.running = None
        self.post_message(StageDone(result, error))

    def on_stage_event(self, message: StageEvent) -> None:
        from core.events import ChildStarted, Progress, Waiting
        from core.events import Message as CoreMessage

        event = message.event
        if isinstance(event, Waiting):
            self._waiting = event
            self.show_wait()
            if self._wait_timer is None:
                self._wait_timer = self.set_interval(1.0, self.show_wait)
        elif isinstance(event, Progress):
            self._waiting = None  # the first step came: the wait is over
            total, done = self.bar_progress(event)
            self.query_one("#progress", ProgressBar).update(total=total, progress=done)
            run = self.app.state.run
            self.query_one("#status", Static).update(progress_text(event, run.spec if run is not None else None))
        elif isinstance(event, CoreMessage):
            self.query_one("#status", Static).update(event.text)
        elif isinstance(event, ChildStarted):
            self.query_one("#status", Static).update(f"{event.run}: child process {event.pid} (log {event.log_path})")
        self.on_core_event(event)

    def on_core_event(self, event: Any) -> None:
        """Subclasses draw what they need from each event."""

    def show_wait(self) -> None:
        """The status line while a child works towards its first step: ``probe: loading the model in child 1234…
        12 s``, every second (nothing once the step came, or the stage ended)."""
        import time

        if self._waiting is not None:
            self.query_one("#status", Static).update(self._waiting.line(time.time()))

    def stop_wait(self) -> None:
        self._waiting = None
        if self._wait_timer is not None:
            self._wait_timer.stop()
            self._wait_timer = None

    def bar_progress(self, event: Any) -> tuple[float, float]:
        """(total, done) of the progress bar for a Progress event: the stage's work over all its runs when it says
        (``work_done`` of ``work_total``: the resume check), else the event's steps."""
        if event.work_total:
            return float(event.work_total), float(event.work_done or 0)
        return event.total, event.step

    def on_stage_done(self, message: StageDone) -> None:
        self.stop_wait()
        bar = self.query_one("#progress", ProgressBar)
        if bar.total is None:  # never got a step (inference, or stopped early): no spinner forever
            bar.update(total=1, progress=1 if message.error is None else 0)
        if message.error is not None:
            self.query_one("#stage-error", Static).update(f"stopped: {message.error}")
        if message.result is not None:
            self.show_result(message.result)
        self.query_one("#next", Button).disabled = False
        self.app.refresh_bindings()  # Esc (the app's) and ^n (this screen's) come back

    def show_result(self, result: Any) -> None:
        raise NotImplementedError

    def next_screen(self) -> Screen:
        raise NotImplementedError

    def action_next(self) -> None:
        if not self.query_one("#next", Button).disabled:
            self.app.push_screen(self.next_screen())

    def next_blocked(self) -> str | None:
        """^n Next is dimmed in the footer while the stage runs (its Next button is disabled until it ends)."""
        try:
            disabled = self.query_one("#next", Button).disabled
        except Exception:  # noqa: BLE001 - before compose
            disabled = True
        if not disabled:
            return None
        from tui.state import stage_words

        return f"the {stage_words(self.stage)} stage is running: Next when it ends (q stops it and quits)"


def _export() -> Screen:
    return screen_named("export")


class ProbeScreen(StageScreen):
    """Real steps in a child process with live memory bars; then measured vs plan."""

    stage = "probe"
    step = "Step 4/7 · Probe (measured)"
    intro = ("Real steps run in a separate process. The bars show this probe's memory against everything else on "
             "each device, live. At the end: measured per component vs the plan, with the error.")

    def compose_body(self) -> ComposeResult:
        yield Static("", id="backend-note", classes="dim")
        yield Vertical(id="live")
        yield Static("", id="plan-capacity", classes="dim")
        yield Static("", id="measured-title")
        yield ReadTable(id="measured")
        yield Static("", id="placement")
        yield Static("", id="health-title").set_styles("display: none;")
        yield ReadTable(id="health").set_styles("display: none;")

    def on_mount(self) -> None:
        self._bars: dict[str, LiveBar] = {}
        self.sampler = self.app.start_sampler()
        self.query_one("#backend-note", Static).update(f"[dim]memory from: {self.app.backend_note}[/]")
        self._timer = self.set_interval(0.25, self.refresh_bars)
        self.query_one("#plan-capacity", Static).update(capacity_note(self.app.state.ctx))
        super().on_mount()

    def on_stage_done(self, message: StageDone) -> None:
        self.refresh_bars()
        self._timer.stop()  # keep the last reading and the probe's peak on screen
        # the bars' peaks as the probe left them: a later stage follows other processes (and resets the sampler's)
        self.app.state.probe_bar_peaks = {d: self.sampler.peak_ours(d) for d in self._bars}
        super().on_stage_done(message)

    def stage_generator(self, cancelled):
        from core.api import AcceptanceRun

        state = self.app.state
        if state.run is None or state.run.spec != state.spec:
            state.run = run = AcceptanceRun(state.spec, state.runs_root, ctx=state.ctx, traced=state.traced,
                                            probe_unfit=state.probe_anyway)
            # the plan screen's trace may have finished while the run was made: PlanScreen.show_traced sets
            # state.traced, then looks for state.run; this sets state.run, then looks for state.traced, so one of the
            # two sees the other whatever the order (a record once said "the trace did not run before the probe")
            if run.traced is None and state.traced is not None:
                run.traced = state.traced
        return state.run.probe_stage(cancelled)

    def on_core_event(self, event: Any) -> None:
        from core.events import ChildStarted, DeviceBound

        if isinstance(event, ChildStarted):
            self.sampler.follow({event.pid})
        elif isinstance(event, DeviceBound) and hasattr(self.sampler.backend, "bind_uuid"):
            line = self.sampler.backend.bind_uuid(event.device, event.uuid)  # NVML mapping checked by torch's UUID
            self.query_one("#backend-note", Static).update(f"[dim]memory from: {self.app.backend_note}; {line}[/]")

    def refresh_bars(self) -> None:
        live = self.query_one("#live", Vertical)
        for sample in self.sampler.latest():
            bar = self._bars.get(sample.device)
            if bar is None:
                bar = self._bars[sample.device] = LiveBar(f"{sample.device} {sample.name}")
                live.mount(bar)
            ended = self.app.state.running != "probe" and self.stage_result() is not None
            kept = self.app.state.probe_bar_peaks or {}
            peak = kept.get(sample.device) if ended and sample.device in kept else self.sampler.peak_ours(sample.device)
            reasons = [r.reason for r in (sample.ours_bytes, sample.total_bytes) if r.reason and not ended]
            note = "; ".join(([sample.note] if sample.note else []) + reasons)
            # the bar is drawn against the device's total; beside it, the capacity the plan was judged by
            from core.api import judged_capacity

            ctx = self.app.state.ctx
            judged = judged_capacity(ctx.devices, sample.device) if ctx is not None else ""
            bar.show(ours=None if ended else sample.ours_bytes.value, others=sample.others_bytes.value,
                     total=sample.total_bytes.value, peak=peak, note=note, ended=ended, judged=judged)

    def stage_result(self) -> Any:
        run = self.app.state.run
        return run.results.get(self.stage) if run is not None else None

    def show_result(self, result: Any) -> None:
        table = self.query_one("#measured", ReadTable)
        table.clear(columns=True)
        table.add_columns("device · component", "planned", "measured", "plan error")
        ranks = len(result.devices) > 1
        rss = {(d.device, d.rank): d.peak_rss_bytes for d in result.devices if d.peak_reserved_bytes is None}
        for c in result.comparisons:  # the total first: it is what decides the fit
            where = f"r{c.rank} {c.device}" if ranks else c.device
            table.add_row(f"{where} tensors vs peak", gib(c.planned_bytes), gib(c.measured_bytes), f"{c.error_pct:+.1f} %")
            whole = rss.get((c.device, c.rank))
            if whole and "overhead" in c.components:  # the CPU: the process as the bar shows it, with the overhead line
                planned_whole = c.planned_bytes + c.components.get("overhead", (0, None))[0]
                table.add_row(f"{where} process vs peak RSS", gib(planned_whole), gib(whole),
                              _err(planned_whole, whole))
            for name, (planned, measured) in c.components.items():
                if name == "kv_cache" and not planned and measured is None:
                    continue  # training keeps no KV cache: a line of zeros says nothing
                table.add_row(f"{where} {name}", gib(planned), gib(measured) if measured is not None
                              else measured_cell(c.how.get(name, "")), _err(planned, measured))
        d = result.devices[0]
        if ranks:
            kind = "peak allocated" if d.peak_reserved_bytes is not None else "peak of live tensors"
            peak = (f"{len(result.devices)} ranks under torchrun, wrapped in {d.wrapper.split(' (')[0]}; {kind} "
                    + ", ".join(f"r{m.rank} {gib(m.peak_bytes)}" for m in result.devices))
        elif d.peak_reserved_bytes is not None:
            peak = f"peak allocated {gib(d.peak_bytes)}, reserved {gib(d.peak_reserved_bytes)}"
        else:
            peak = (f"peak of live tensors {gib(d.peak_bytes)} (tracked in the step); process peak RSS "
                    f"{gib(d.peak_rss_bytes)} (its own high-water mark; the bar samples every 0.1 s) "
                    + rss_note(d.peak_bytes, d.peak_rss_bytes))
        problems = "".join(f"\n[red]✗ {p}[/]" for p in getattr(result, "problems", []))
        problems += "".join(f"\n[yellow]! {f}[/]" for f in getattr(result, "findings", []))
        timing = getattr(result, "timing", None)
        speed = timing.words(result.step_time_s) if timing is not None else f"{result.step_time_s:.2f} s/step"
        self.query_one("#measured-title", Static).update(
            f"[b]{result.status.upper()}[/b] · {result.steps} steps, {speed}, "
            f"{result.tokens_per_s:.0f} tokens/s · {peak}. Plan error = (planned − measured) / measured: "
            "+ means the plan is above what was measured." + problems)
        layers = getattr(result, "layers", {}) or {}
        self.query_one("#placement", Static).update("placement: " + "; ".join(
            f"{dev}: {p['parameters']:,} parameters, {gib(p['bytes'])}"
            + (f" ({', '.join(layers[dev])})" if dev in layers else "") for dev, p in result.placement.items()))
        self.show_health(result)

    def show_health(self, result: Any) -> None:
        """The health preflight NVML read before the probe: a row per GPU and the criteria it missed, or why it did
        not run."""
        from core.api import HEALTH_COLUMNS, health_table

        report = getattr(result, "health", None)
        title = self.query_one("#health-title", Static)
        if report is None:
            return
        title.display = True
        if not report.ran:
            title.update(f"[dim]health preflight not run: {report.reason}[/]")
            return
        title.update(f"[b]health preflight[/b] (NVML, before the probe; driver {report.driver_version or '?'}, "
                     f"CUDA {report.cuda_driver_version or '?'}; the PCIe generation drops at idle: not judged)")
        table = self.query_one("#health", ReadTable)
        table.display = True
        table.clear(columns=True)
        table.add_columns(*HEALTH_COLUMNS)
        for row in health_table(report, getattr(result, "judgements", [])):
            table.add_row(*row)

    def next_screen(self) -> Screen:
        probe = self.app.state.run.results.get("probe") if self.app.state.run else None
        return EvaluateScreen() if probe is not None and probe.status == "pass" else _export()


def progress_text(event: Any, spec: Any) -> str:
    """A stage's progress line: the step done of the run's last; the interrupted run's planned kill apart from it,
    in the words the resume check uses (:func:`core.killpoints.planned`): "interrupted run (1 of 2): step 11
    of 26 (to be SIGKILLed inside step 26, after micro-batch 1 of 1, before its optimizer step)"."""
    from core.killpoints import planned

    loss = f", loss {event.loss:.4f}" if event.loss is not None else ""
    part = getattr(event, "part", None)
    which = (f" run ({part[0]} of {part[1]})" if part else
             {"interrupted": " run (1 of 2)", "resumed": " run (2 of 2)"}.get(event.run, ""))
    if event.run == "interrupted" and spec is not None:
        kill = planned(spec.resume.kill_at, spec.resume.kill_step(), spec.grad_accum)
        return f"{event.run}{which}: step {event.step} of {event.total} (to be SIGKILLed {kill}){loss}"
    return f"{event.run}{which}: step {event.step} (of {event.total}){loss}"


def capacity_note(ctx: Any) -> str:
    """Under the live bars: each device's planned peak against the capacity the plan judged it by, saying which that
    is, since the bar's scale is the device's whole memory (the two differ on a host, or under a cgroup limit)."""
    plan = getattr(ctx, "plan", None)
    if plan is None:
        return ""
    parts = [f"{d.device.name} plan {gib(d.total_bytes)} of {d.device.capacity_text()}" for d in plan.devices]
    return "[dim]the bars are each device's total memory; the plan was judged by: " + "; ".join(parts) + "[/]"


def loss_title(losses: list[float]) -> str:
    """``loss per step: 3.473 → 3.182 (min 2.335, max 3.473)``: the sparkline's scale, first to latest."""
    return (f"loss per step: {losses[0]:.3f} → {losses[-1]:.3f} (min {min(losses):.3f}, max {max(losses):.3f})"
            if losses else "loss per step:")


def rss_note(tensors: int, rss: int | None) -> str:
    """Why a CPU probe's peak RSS differs from its peak of live tensors, in words that hold for the two numbers."""
    if not rss:
        return ""
    if rss >= tensors:
        return f"(+{gib(rss - tensors)}: the Python/torch runtime, libraries and allocator caches)"
    return (f"({gib(tensors - rss)} below the tensors: RSS counts only pages resident in RAM, and pages of a tensor "
            "not yet written are not)")


def measured_cell(how: str) -> str:
    """A component the probe did not measure apart, in a table cell: "in peak" (inside the measured peak) or "not
    read" (outside it, e.g. the CUDA context outside peak allocated); the record keeps the full words."""
    return "not read" if how.startswith("not measured:") else "in peak"


def _err(planned: int, measured: int | None) -> str:
    if measured is None or measured == 0:
        return ""
    return f"{100.0 * (planned - measured) / measured:+.1f} %"


class EvaluateScreen(StageScreen):
    """Held-out perplexity before and after training; training time; the loss curve."""

    stage = "train_eval"
    step = "Step 5/7 · Train + evaluate (measured)"
    intro = ("Held-out text the model never trains on. Metric: token-weighted perplexity exp(Σ NLL / Σ tokens), "
             "before and after training (inference: once). \"It ran\" is not \"it is good\": read the numbers.")

    def compose_body(self) -> ComposeResult:
        yield Static("loss per step:", id="loss-title")
        yield Sparkline([], id="loss")
        yield Static("", id="eval-result")

    def on_mount(self) -> None:
        self._losses: list[float] = []
        if self.app.state.spec is not None and not self.app.state.spec.training:
            self.query_one(".title", Static).update("Step 5/7 · Evaluate the fixed weights (measured)")
        super().on_mount()

    def stage_generator(self, cancelled):
        return self.app.state.run.train_eval_stage(cancelled)

    def on_core_event(self, event: Any) -> None:
        from core.events import Evaluated, Progress

        if isinstance(event, Progress) and event.loss is not None:
            self._losses.append(event.loss)
            self.query_one("#loss", Sparkline).data = list(self._losses)
            self.query_one("#loss-title", Static).update(loss_title(self._losses))  # the scale as it grows
        elif isinstance(event, Evaluated) and event.when == "before":  # kept on screen while the training runs
            self.query_one("#eval-result", Static).update(event.text)
            self.show_wait()  # the status line goes back to what the child does now, not the line said above

    def show_result(self, result: Any) -> None:
        losses = [s["loss"] for s in result.steps]
        if losses:
            self.query_one("#loss", Sparkline).data = losses
            self.query_one("#loss-title", Static).update(loss_title(losses))
        else:
            self.query_one("#loss-title", Static).update("no training (inference)")
        label = "perplexity before:" if result.after is not None else "perplexity:"
        lines = [f"[b]{result.status.upper()}[/b] · criterion: {result.criterion}",
                 f"{label} {result.before.perplexity:.3f} ({result.before.tokens:,} tokens in "
                 f"{result.before.blocks} held-out blocks, {result.before.seconds:.1f} s of evaluation)"]
        if result.after is not None:
            lines.append(f"perplexity after:  {result.after.perplexity:.3f} ({result.after.seconds:.1f} s of "
                         f"evaluation) after {len(losses)} steps trained in {result.training_time_s:.1f} s, "
                         f"{result.tokens_per_s:.0f} tokens/s")
        run = self.app.state.recipe_run()
        spec = run.spec
        if spec.training:
            ranks = run.launch.nproc * spec.torchrun.nnodes if run.launch.nproc > 1 else 1
            on = f" on each of {ranks} ranks ({spec.strategy})" if ranks > 1 else ""
            lines.append(f"settings: {spec.mode}, {spec.dtype}, micro-batch {spec.batch_size} × {spec.seq_len}{on}, "
                         f"accumulation {spec.grad_accum}, {spec.optimizer} lr {spec.learning_rate:g}, seed {spec.seed}")
        else:
            lines.append(f"settings: inference, {spec.dtype}, batch {spec.batch_size} × {spec.seq_len}, seed {spec.seed}")
        lines.append(f"[dim]{result.metric}[/]")
        self.query_one("#eval-result", Static).update("\n".join(lines))

    def next_screen(self) -> Screen:
        return ResumeScreen() if self.app.state.recipe_run().results.get("train_eval") is not None else _export()


class ResumeScreen(StageScreen):
    """Kill the training process after a checkpoint, resume, compare step by step with the uninterrupted run."""

    stage = "resume"
    step = "Step 6/7 · Kill and resume (measured)"
    intro = ("\"A checkpoint exists\" is not \"it resumes\". A second run is SIGKILLed after a checkpoint, resumed from "
             "it, and compared with the uninterrupted run: steps, learning rate, data order, loss, weights.")

    def compose_body(self) -> ComposeResult:
        yield Static("", id="timeline")
        yield Static("", id="resume-verdict")
        yield Static("", id="tolerance")
        yield Static("", id="checks")
        yield ReadTable(id="comparison")

    def stage_generator(self, cancelled):
        return self.app.state.run.resume_stage(cancelled)

    #: the check's runs with progress, in order, after the twins (``twin-1`` ..., which run first where the tier
    #: measures the noise): the bar goes through each, never back
    RUNS = ("interrupted", "resumed")

    def bar_progress(self, event: Any) -> tuple[float, float]:
        """The steps done over every run of the check (:class:`core.stages.resume.CheckWork`); for events that do not
        say (command mode), each run of the check fills its share of the bar: the twin (when one runs, it runs
        first), the interrupted run, the resumed run."""
        if event.work_total:
            return super().bar_progress(event)
        twins = getattr(self, "_twins", [])
        if event.run.startswith("twin") and event.run not in twins:
            twins.append(event.run)
            self._twins = twins
        runs = (*twins, *self.RUNS)
        index = runs.index(event.run) if event.run in runs else 0
        fraction = min(1.0, event.step / event.total) if event.total else 0.0
        return float(len(runs)), index + fraction

    def show_result(self, result: Any) -> None:
        spec = self.app.state.recipe_run().spec
        verdict = self.query_one("#resume-verdict", Static)
        self.query_one("#progress", ProgressBar).update(total=1, progress=1)
        if result.status == "not_applicable":
            verdict.update(f"[b]NOT APPLICABLE[/b] · {result.summary}")
            return
        c, k, n = result.checkpoint_step, result.kill_step, spec.steps
        start = result.interrupted_start
        end = result.compared_steps[1] if result.compared_steps else n
        origin = f"ckpt {start} (copy)" if start else "1"
        killed = f"interrupted  {origin} {'━' * 4}● ckpt {c} ━ ✕ SIGKILL"
        label = _kill_label(result.kill_at, k, spec.grad_accum)
        width = self.app.size.width - TIMELINE_MARGIN  # the timeline's columns: the terminal's, less the padding
        killed += f" {label}" if len(killed) + 1 + len(label) <= width else f"\n{' ' * 13}{label}"
        self.query_one("#timeline", Static).update(
            f"reference    1 {'━' * 20} {n}\n"
            f"{killed}\n"
            f"resumed                  ckpt {c} → {c + 1} {'━' * 8} {end}"
            + (f" (compared {c + 1}-{end} of {n})" if end < n else "")
            + (f"\ntwins ({tier_twins(result)})    {'ckpt ' if start else ''}{result.twin_steps[0] - 1 if start else 1} "
               f"{'━' * 8} {result.twin_steps[1]} (uninterrupted: their spread is the noise)"
               if result.twin_steps else ""))
        verdict.update(f"[b]{result.status.upper()}[/b] · {result.summary}")
        self.query_one("#tolerance", Static).update(Content(tolerance_line(result)))
        # evidence wraps: it is the point of each line
        self.query_one("#checks", Static).update(Content("\n").join(
            Content.from_markup(CHECK_MARKS.get(str(ch.status), "[$error]✗[/]"))
            + Content(f" {ch.name}: {ch.evidence}") for ch in result.checks))
        table = self.query_one("#comparison", ReadTable)
        table.clear(columns=True)
        twin = any("loss_twin" in row for row in result.comparison)
        table.add_columns("step", "lr", "loss reference", "loss resumed", "difference", *(("twin diff",) if twin else ()))
        for row in result.comparison:
            table.add_row(str(row["step"]), f"{row['learning_rate']:.3g}", f"{row['loss_reference']:.6f}",
                          f"{row['loss_resumed']:.6f}", f"{row['difference']:.2g}",
                          *((f"{abs(row['loss_twin'] - row['loss_reference']):.2g}" if "loss_twin" in row else "-",)
                            if twin else ()))

    def next_screen(self) -> Screen:
        return _export()


def tolerance_line(result: Any) -> str:
    """The Resume screen's one line on how loss, weights and optimizer states were judged: bit-exact (and why), or
    within the stated multiple of the noise a twin run measured (the loss bound, and the twin's steps)."""
    tier = result.tier
    if tier is None:
        return ""
    if tier.exact:
        return f"tolerance: bit-exact ({tier.why})"
    loss = next((ch for ch in result.checks if ch.name == "loss" and ch.noise is not None), None)
    steps = getattr(result, "twin_steps", None)
    where = f"{tier_twins(result)} twin runs" + (f" (steps {steps[0]}-{steps[1]})" if steps else "")
    said = (f"; loss bound {loss.bound:.2g} (noise {loss.noise:.2g})" if loss is not None and loss.bound is not None
            else "")
    losses = f"{tier.loss_multiple:g} x" if tier.loss_multiple else (  # a pooled tier: the family's t quantile
        f"{loss.bound / loss.noise:.3g} x" if loss is not None and loss.bound and loss.noise else "a t quantile x")
    return f"tolerance: {tier.multiple:g} x (per tensor) and {losses} (the losses' norm) the spread of {where}{said}"


def tier_twins(result: Any) -> int:
    """How many twin runs measured the noise of a resume result (its tier's; 1 for a tier written before several)."""
    return int(getattr(result.tier, "twins", 0) or 1)


#: the columns of the terminal a line of the resume timeline leaves to the screen's padding and scroll bar
TIMELINE_MARGIN = 6


def _kill_label(kill_at: str | None, k: int, micro_in_step: int | None = None) -> str:
    """Where the interrupted run was killed, in the check's words, short (:func:`core.killpoints.timeline_label`)."""
    from core.killpoints import timeline_label

    return timeline_label(kill_at, k, micro_in_step)
