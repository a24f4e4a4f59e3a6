"""Command mode in the wizard: your own training command (Mode 5, or Setup's "Your own command").

- :class:`CommandSetupScreen`: the command, how it resumes, where its checkpoints and metrics are, what evaluates it;
  every field validated as it is typed (:class:`core.commandspec.CommandSpec`), each error under its field.
- :class:`CommandRunScreen`: every stage in one worker (:func:`core.command.pipeline.every_stage`): the uninterrupted
  run with live memory bars, the plan of what ran against what was measured, the held-out evaluation, the kill and
  resume; then Next to the sign-off (:class:`tui.screens.export.ExportScreen`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import MISSING
from typing import Any

from rich.markup import escape
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Footer, Header, Input, Label, ProgressBar, Static

from tui.screens.base import WizardScreen
from tui.screens.messages import StageDone, StageEvent
from tui.screens.nav import NavButtons
from tui.screens.registry import screen_named
from tui.widgets.bars import LiveBar, gib
from tui.widgets.inputs import OrderedInput
from tui.widgets.tables import wrapped_table


def _form_fields() -> list[tuple[str, str, str, str, str]]:
    """The form's fields, made from the [command] settings declared with a label (core/commandspec.py), in their
    ``form_order``: ([command] key, label, default shown, placeholder, kind)."""
    from core.api import COMMAND_SETTINGS

    def shown(default: Any) -> str:
        return "" if default is MISSING else ",".join(default) if isinstance(default, tuple) else str(default)

    return [(s.name, s.form.label, shown(s.default), s.placeholder or "", s.kind)
            for s in sorted(COMMAND_SETTINGS, key=lambda s: s.form_order or 0) if s.form is not None]


#: ([command] key, label, default shown, placeholder, kind)
FIELDS: list[tuple[str, str, str, str, str]] = _form_fields()
INTRO = ("Run as you would (no shell), measured, killed after a checkpoint, resumed. {out}: each run's own output "
         "folder (or your trainer config's output key); {checkpoint}: what to resume from; {command}: the training "
         "command; {train_data}: gpuaccept's training split; {model}: the base model.")


def _criteria_fields() -> list[tuple[str, str, str]]:
    """The criteria command mode applies (core/criteria.py ``COMMAND_CRITERIA``) as the form shows them: (criterion,
    label, placeholder), labelled as on Setup (their declarations, core/criteria.py)."""
    from core.api import COMMAND_CRITERIA, AcceptCriteria
    from core.spec import spec_settings

    labels = {s.name: s.form.label for s in spec_settings() if s.table == "accept" and s.form is not None}
    defaults = AcceptCriteria()

    def placeholder(name: str) -> str:
        default = getattr(defaults, name)
        choice = " (or exact)" if name == "resume_tier" else ""
        return "not set" if default is None else f"{default:g}{choice}" if isinstance(default, float) else \
            f"{default}{choice}"

    return [(name, labels[name], placeholder(name)) for name in COMMAND_CRITERIA]


#: (criterion, label, placeholder): the [accept] table of a command, on the same form
CRITERIA: list[tuple[str, str, str]] = _criteria_fields()


def criteria_table(values: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The criteria fields' text (by criterion) as an ``[accept]`` table (blank: not set), and per-field errors of
    conversion."""
    table: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name, text in values.items():
        text = text.strip()
        if not text:
            continue
        if name == "resume_tier":
            table[name] = text
            continue
        try:
            table[name] = float(text)
        except ValueError:
            errors[f"accept_{name}"] = f"a number, e.g. 0.9 (got {text!r}); blank: not set"
    return table, errors


def raw_values(values: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The form's text as a ``[command]`` table (empty fields left to their defaults), and per-field errors of
    conversion."""
    kinds = {key: kind for key, *_, kind in FIELDS}
    raw: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for key, text in values.items():
        text = text.strip()
        if not text and key != "train":
            continue
        kind = kinds.get(key, "str")
        if kind == "list":
            raw[key] = [t.strip() for t in text.split(",") if t.strip()]
        elif kind in ("int", "float"):
            try:
                raw[key] = int(text) if kind == "int" else float(text)
            except ValueError:
                errors[key] = f"a {'whole ' if kind == 'int' else ''}number, e.g. 1 (got {text!r})"
        else:
            raw[key] = text
    return raw, errors


class CommandSetupScreen(NavButtons, WizardScreen):
    """Your command and how gpuaccept runs, kills, resumes and evaluates it; Next only when it is valid."""

    BINDINGS = [Binding("ctrl+n", "next", "Next"), Binding("ctrl+q", "app.quit_typed", "Quit")]
    q_types = True

    def compose(self) -> ComposeResult:
        given = self.app.state.command_fields
        yield Header()
        yield Static("Step 2/4 · Your own command", classes="title")
        yield Static(INTRO, classes="intro")
        with VerticalScroll(classes="body", id="form"):
            for key, label, default, placeholder, _kind in FIELDS:
                value = given.get(key, default)
                value = ",".join(value) if isinstance(value, (list, tuple)) else str(value)
                with Horizontal(classes="field"):
                    yield Label(label)
                    yield OrderedInput(value=value, placeholder=placeholder, id=f"c-{key}", compact=True)
                yield Static("", classes="field-error", id=f"cerr-{key}")
            yield Static(escape("Acceptance criteria ([accept]): what your command must meet to pass (blank: the "
                                "default shown)"), classes="dim", id="criteria-heading")
            given_criteria = self.app.state.command_criteria
            for name, label, placeholder in CRITERIA:
                value = getattr(given_criteria, name, None) if given_criteria is not None else None
                with Horizontal(classes="field"):
                    yield Label(label)
                    yield OrderedInput(value="" if value is None else f"{value:g}" if isinstance(value, float)
                                       else str(value), placeholder=placeholder, id=f"c-accept_{name}", compact=True)
                yield Static("", classes="field-error", id=f"cerr-accept_{name}")
        yield Static("", classes="error", id="form-error")
        with Horizontal(classes="nav"):
            yield Button("← Back", id="back")
            yield Button("Run it →", id="next", variant="primary", disabled=True)
        yield Footer(show_command_palette=False)

    def on_mount(self) -> None:
        self.app.state.mode = "command"
        self.validate()
        self.query_one("#c-train", Input).focus()

    def values(self) -> dict[str, str]:
        return {key: self.query_one(f"#c-{key}", Input).value for key, *_ in FIELDS}

    def criteria(self, errors: dict[str, str]) -> Any:
        """The criteria of the form (``command_criteria``), or None with the error under its field in ``errors``."""
        from core.api import command_criteria
        from core.errors import SpecError

        table, bad = criteria_table({name: self.query_one(f"#c-accept_{name}", Input).value for name, *_ in CRITERIA})
        errors.update(bad)
        if bad:
            return None
        try:
            return command_criteria(table)
        except SpecError as exc:
            errors[exc.field.replace("accept.", "accept_")] = exc.message
            return None

    def validate(self) -> Any:
        """Build the spec and the criteria from the form; show the error under its field; Next only when both are
        valid."""
        from core.api import CommandSpec
        from core.errors import SpecError

        values = self.values()
        self.app.state.command_fields = {**self.app.state.command_fields, **values}
        raw, errors = raw_values(values)
        spec = None
        if not errors:
            try:
                spec = CommandSpec.from_dict({**{k: v for k, v in self.app.state.command_fields.items()
                                                 if k not in values}, **raw})
            except SpecError as exc:
                if values["train"].strip():  # an empty form is not an error yet: Next says what to type
                    errors[exc.field.removeprefix("command.")] = exc.message
        criteria = self.criteria(errors)
        self.app.state.command_criteria = criteria
        if criteria is None:
            spec = None
        for key in [key for key, *_ in FIELDS] + [f"accept_{name}" for name, *_ in CRITERIA]:
            err = self.query_one(f"#cerr-{key}", Static)
            text = errors.pop(key, "")
            err.update(escape(text))
            err.display = bool(text)
        self.query_one("#form-error", Static).update(escape("; ".join(errors.values())))
        self.app.state.command_spec = spec
        self.query_one("#next", Button).disabled = spec is None
        self.refresh_bindings()
        return spec

    def on_input_changed(self, event: Input.Changed) -> None:
        self.validate()

    def next_blocked(self) -> str | None:
        if self.app.state.command_spec is not None:
            return None
        at_fault = [label for key, label, *_ in FIELDS + [(f"accept_{n}", label) for n, label, _ in CRITERIA]
                    if self.query_one(f"#cerr-{key}", Static).display]
        return "fix what is marked ↑ first: " + ", ".join(at_fault) if at_fault else "give the training command"

    def action_next(self) -> None:
        if self.validate() is not None:
            self.app.push_screen(CommandRunScreen())


STAGE_NAMES = {"probe": "uninterrupted run (probe)", "plan": "plan of what ran", "train_eval": "evaluation",
               "resume": "kill and resume", "pipeline": "stopped"}
MARKS = {"pass": "[green]✓[/]", "not_applicable": "[dim]–[/]", "fail": "[red]✗[/]"}


class CommandRunScreen(NavButtons, WizardScreen):
    """Every stage of your command, live; the evidence of each as it ends."""

    BINDINGS = [Binding("ctrl+n", "next", "Next")]

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("Step 3/4 · Your command: measured, planned, evaluated, killed and resumed", classes="title")
        yield Static("The bars show your command's processes (every rank) against everything else on each device. "
                     "Each stage's verdict and evidence appear as it ends; the run folder, under "
                     f"{escape(str(self.app.state.runs_root))}/, keeps every log.", classes="intro")
        with VerticalScroll(classes="body", id="stage-body"):
            yield ProgressBar(id="progress", show_eta=False)
            yield Static("", id="status")
            yield Static("", id="backend-note", classes="dim")
            yield Vertical(id="live")
            yield Static("", id="stages")
            yield Static("", id="details")
        yield Static("", classes="error", id="stage-error")
        with Horizontal(classes="nav"):
            yield Button("← Back", id="back")
            yield Button("Sign off →", id="next", variant="primary", disabled=True)
        yield Footer(show_command_palette=False)

    def on_mount(self) -> None:
        self._bars: dict[str, LiveBar] = {}
        self._lines: dict[str, str] = {}
        self.sampler = self.app.start_sampler()
        self.query_one("#backend-note", Static).update(f"[dim]memory from: {self.app.backend_note}[/]")
        self._timer = self.set_interval(0.25, self.refresh_bars)
        self._status: tuple[str, float] | None = None  # the status line and when it was said (its seconds shown)
        self._clock = self.set_interval(1.0, self._tick)
        self.query_one("#stage-body").focus()
        state = self.app.state
        run = state.run
        if run is not None and getattr(run, "spec", None) == state.command_spec and run.results.get("probe"):
            self.show_all(run)  # back from the sign-off: nothing runs again
            self.query_one("#progress", ProgressBar).update(total=1, progress=1)
            self.query_one("#next", Button).disabled = False
            return
        state.running = "probe"
        self.run_stages()
        self.app.refresh_bindings()

    def stages(self, cancelled: Callable[[], bool]) -> Generator[Any, None, None]:
        from core.api import CommandRun, every_stage

        state = self.app.state
        if state.run is not None:
            self.app.finish_run()  # a run of another setup: its record is written, unsigned
        assert state.command_spec is not None  # the run screen follows a valid command setup (its Next)
        state.run = CommandRun(state.command_spec, state.runs_root, criteria=state.command_criteria)
        return every_stage(state.run, cancelled)

    @work(thread=True, exclusive=True, group="stage")
    def run_stages(self) -> None:
        from core.errors import GpuAcceptError
        from core.events import ChildStarted, StageStarted

        state = self.app.state
        state.cancel.clear()
        error = None
        try:
            for event in self.stages(state.cancel.is_set):
                if isinstance(event, ChildStarted):
                    state.children.add(event.pid)
                elif isinstance(event, StageStarted):
                    state.running = event.stage
                self.post_message(StageEvent(event))
        except GpuAcceptError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - shown on screen; the run folder keeps the logs
            error = f"{type(exc).__name__}: {exc}"
        finally:
            state.running = None
        self.post_message(StageDone(None, error))

    def _say(self, text: str, waiting: bool) -> None:
        """The status line; a wait (a process started, a message: no step to show) gets its seconds, every second,
        until the next status (issue 51: the reference run and the evaluation sat at "--%" with no sign of life)."""
        import time

        self._status = (text, time.monotonic()) if waiting else None
        self.query_one("#status", Static).update(text)

    def _tick(self) -> None:
        import time

        if self._status is not None and self.app.state.running is not None:
            text, since = self._status
            self.query_one("#status", Static).update(f"{text} · {time.monotonic() - since:.0f} s")

    def on_stage_event(self, message: StageEvent) -> None:
        from core.events import ChildStarted, Message, Progress, StageFinished, StageStarted

        event = message.event
        if isinstance(event, Progress):
            if event.total:
                self.query_one("#progress", ProgressBar).update(total=event.total, progress=event.step)
            loss = f", loss {event.loss:.4f}" if event.loss is not None else ""
            of = f" of {event.total}" if event.total else ""
            self._say(f"{event.run} run: step {event.step}{of}{loss}", waiting=False)
        elif isinstance(event, ChildStarted):
            self.sampler.follow({event.pid})
            self._follows = event.run  # the bars' red share is this run's (issue 51: the resumed run's read "probe")
            self._say(f"{event.run}: process {event.pid} (log {event.log_path})", waiting=True)
        elif isinstance(event, StageStarted):
            self._lines[event.stage] = f"[yellow]…[/] {STAGE_NAMES.get(event.stage, event.stage)}: running"
            self._show_lines()
        elif isinstance(event, StageFinished):
            mark = MARKS.get(event.status, "[red]✗[/]")
            self._lines[event.stage] = (f"{mark} {STAGE_NAMES.get(event.stage, event.stage)} {event.status}: "
                                        f"{escape(event.summary)}")
            self._show_lines()
            self.show_all(self.app.state.run)
        elif isinstance(event, Message):
            if event.stage == "pipeline":
                self._lines["pipeline"] = f"[red]■[/] {escape(event.text)}"
                self._show_lines()
            self._say(escape(event.text), waiting=False)  # a message is said, not timed (a result is no wait)

    def _show_lines(self) -> None:
        self.query_one("#stages", Static).update("\n".join(self._lines.values()))

    def on_stage_done(self, message: StageDone) -> None:
        self.refresh_bars()
        self._timer.stop()
        bar = self.query_one("#progress", ProgressBar)
        bar.update(total=bar.total or 1, progress=bar.total or 1)
        if message.error is not None:
            self.query_one("#stage-error", Static).update(f"stopped: {escape(message.error)}")
        run = self.app.state.run
        if run is not None:
            self.show_all(run)
        self.query_one("#next", Button).disabled = False
        self.app.refresh_bindings()

    def refresh_bars(self) -> None:
        live = self.query_one("#live", Vertical)
        running = self.app.state.running is not None
        for sample in self.sampler.latest():
            bar = self._bars.get(sample.device)
            if bar is None:
                bar = self._bars[sample.device] = LiveBar(f"{sample.device} {sample.name}")
                live.mount(bar)
            bar.follows = getattr(self, "_follows", "probe")
            bar.show(ours=sample.ours_bytes.value if running else None, others=sample.others_bytes.value,
                     total=sample.total_bytes.value, peak=self.sampler.peak_ours(sample.device),
                     note=sample.note or "", ended=not running)

    def show_all(self, run: Any) -> None:
        """What each finished stage found, as tables: devices, the plan against the measurement, the evaluation, the
        resume checks."""
        if run is None:
            return
        if not self._lines:
            for key, name in (("probe", "probe"), ("plan", "plan"), ("train_eval", "train_eval"), ("resume", "resume")):
                res = run.results.get(key)
                if res is not None:
                    self._lines[key] = (f"{MARKS.get(res.status, '[red]✗[/]')} {STAGE_NAMES[name]} {res.status}: "
                                        f"{escape(res.summary)}")
            self._show_lines()
        from rich.console import Group

        parts: list[Any] = []
        probe, plan, ev, res = (run.results.get(k) for k in ("probe", "plan", "train_eval", "resume"))
        if probe is not None:
            rows = [[d.device, gib(d.measured_bytes), gib(d.capacity_bytes) if d.capacity_bytes else "unknown",
                     {True: "fits", False: "DOES NOT FIT", None: "?"}[d.fits], d.method] for d in probe.devices]
            parts += ["", f"[b]measured per device[/b] ({probe.view.split(' (')[0]}):",
                      wrapped_table(["device", "peak", "capacity", "fit", "how measured"], rows)]
            parts += [f"[yellow]! {escape(f)}[/]" for f in probe.findings]
            parts += health_parts(probe)
        if plan is not None and plan.comparisons:
            rows = [[c.device, gib(c.planned_bytes), gib(c.measured_bytes), f"{c.error_pct:+.1f} %", c.compared]
                    for c in plan.comparisons]
            parts += ["", "[b]plan of what ran vs measured[/b] (estimate; + means the plan is above):",
                      wrapped_table(["device", "planned", "measured", "error", "compared"], rows)]
        if ev is not None and ev.after is not None:
            before = f"{ev.before['value']:.4g}" if ev.before else "not measured"
            parts += ["", f"[b]evaluation[/b]: {escape(ev.metric)} {before} → {ev.after['value']:.4g} on "
                          f"{escape(ev.checkpoint)}; held-out independence: {escape(ev.independence)}"]
        if res is not None and res.checks:
            rows = [[c.name, c.status, c.evidence] for c in res.checks]
            parts += ["", f"[b]kill and resume[/b] ({res.tier.name if res.tier else ''}):",
                      wrapped_table(["check", "status", "evidence"], rows)]
            parts += [f"[dim]not compared: {escape(n)}[/]" for n in res.not_compared]
        self.query_one("#details", Static).update(Group(*parts))

    def next_blocked(self) -> str | None:
        try:
            disabled = self.query_one("#next", Button).disabled
        except Exception:  # noqa: BLE001 - before compose
            disabled = True
        return "your command is running: Next when every stage has ended (q stops it and quits)" if disabled else None

    def action_next(self) -> None:
        if not self.query_one("#next", Button).disabled:
            self.app.push_screen(screen_named("export"))


def health_parts(probe: Any) -> list[Any]:
    """The health preflight NVML read before the command started: a table of the GPUs (the criteria judged those the
    command used), or why it did not run."""
    from core.api import HEALTH_COLUMNS, health_table

    report = getattr(probe, "health", None)
    if report is None:
        return []
    if not report.ran:
        return ["", f"[dim]health preflight not run: {escape(report.reason)}[/]"]
    return ["", f"[b]health preflight[/b] (NVML, before the command; driver {report.driver_version or '?'}):",
            wrapped_table(list(HEALTH_COLUMNS), health_table(report, getattr(probe, "criteria", [])))]
