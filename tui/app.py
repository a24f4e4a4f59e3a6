"""The gpuaccept wizard: seven screens from mode to record, over core's pipeline.

This file only wires screens, bindings and the device sampler; each screen is a file in ``screens/`` and each widget a
dumb drawing in ``widgets/``. torch and transformers are never imported here: the first screen must appear at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.app import App
from textual.binding import Binding

from tui.state import WizardState


class GpuAcceptApp(App[int]):
    """Mode → Setup → Plan → Probe → Evaluate → Resume → Export; for your own command Mode → Command setup → its
    run (every stage) → Export.

    Args:
        runs_root: where run directories are created.
        backend: the device-memory backend the live bars sample (``core.monitor.sampler``); by default NVML's, else the
            host's (:func:`core.api.default_backend`).
        devices_override: plan for these devices instead of detecting them (tests, planning another box).
        fields: initial setup values (flag names of ``RunSpec.build``), e.g. ``{"model": ...}``.
        command_fields: command mode's initial values (``[command]`` keys), with ``mode="command"``.
    """

    CSS_PATH = "app.tcss"
    TITLE = "gpuaccept"
    SUB_TITLE = "accept a training setup"
    BINDINGS = [
        Binding("q", "quit_app", "Quit"),
        # where q types into a field, Ctrl+Q (Textual's own quit key, here asking first while a stage runs)
        Binding("ctrl+q", "quit_app", "Quit", show=False),
        # Ctrl+C, the key everyone presses first: the same quit (Textual's own only names Ctrl+Q); in a field it copies
        Binding("ctrl+c", "quit_app", "Quit", show=False),
        Binding("question_mark", "help", "Terms"),
        Binding("escape", "back", "Back"),
    ]

    def __init__(self, *, runs_root: Path = Path("runs"), backend: Any = None,
                 devices_override: list[Any] | None = None, fields: dict[str, Any] | None = None,
                 mode: str = "lora", tracer: Any = None, command_fields: dict[str, Any] | None = None) -> None:
        super().__init__()
        #: makes the traced plan: (spec, ctx, cancelled) -> dict as core.plan.traced.traced_table (tests pass a constructed one)
        self.tracer = tracer
        self.state = WizardState(runs_root=Path(runs_root), devices_override=devices_override,
                                 fields=dict(fields or {}), mode=mode, command_fields=dict(command_fields or {}))
        self._backend = backend
        #: which memory backend the bars use and why (NVML, or CPU mode with NVML's reason)
        self.backend_note = ""
        self.sampler: Any = None

    async def on_event(self, event: Any) -> None:
        """A key from the terminal is handed on only once the keys before it have been handled
        (:func:`tui.widgets.inputs.keys_settled`): the App hands a key to the widget focused when it arrives, and a
        burst read in two chunks (a paste, tmux send-keys, a macro) otherwise sent the second chunk to the widget the
        first chunk was still leaving, out of order."""
        from textual import events

        if isinstance(event, events.Key) and not event.is_forwarded:
            from tui.widgets.inputs import keys_settled

            await keys_settled(self)
        await super().on_event(event)

    def on_mount(self) -> None:
        from tui.screens.registry import screen_named

        watch_terminal(self, self.hang_up)  # SIGHUP or a dead terminal: hang_up() on a thread, then exit 129

        self.push_screen(screen_named("mode"))

    def start_sampler(self) -> Any:
        """The device sampler (started on first use, stopped on exit)."""
        if self.sampler is None:
            from core.api import Sampler

            backend, self.backend_note = (self._backend, f"{self._backend.name} backend") if self._backend else \
                _default_backend()
            self.sampler = Sampler(backend, interval_s=0.1)
            self.sampler.start()
        return self.sampler

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Esc is dimmed while a stage runs (pressing it says why) and not offered on the first screen, where it has
        nowhere to go back to; q is not offered on screens where q is a letter typed into a field (their own ^q Quit
        is: ``q_types``)."""
        if action == "back" and self.state.running:
            return None
        if action == "back" and not self.can_go_back():
            return False
        if action == "quit_app" and getattr(self.screen, "q_types", False):
            return False
        return True

    def action_quit_typed(self) -> None:
        """^q on the screens where q types: the same quit as q elsewhere."""
        self.action_quit_app()

    def action_help(self) -> None:
        from tui.screens.dialogs import HelpScreen

        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    async def action_back(self) -> None:
        """Esc (Textual's own back action is async: this one only calls :meth:`go_back`)."""
        self.go_back()

    def can_go_back(self) -> bool:
        """Esc has somewhere to go: the terms to close, or a screen before this one."""
        from tui.screens.dialogs import HelpScreen

        return isinstance(self.screen, HelpScreen) or len(self.screen_stack) > 2

    def go_back(self) -> None:
        """Back one screen: closes the terms; while a stage runs, says which stage runs and how to stop it instead;
        never back past the first screen."""
        from tui.screens.dialogs import HelpScreen

        if isinstance(self.screen, HelpScreen):
            self.pop_screen()
        elif self.state.running:
            from tui.state import stage_words

            self.notify(f"the {stage_words(self.state.running)} stage is running; q stops it and quits",
                        severity="warning")
        elif len(self.screen_stack) > 2:
            self.pop_screen()

    def action_quit_app(self) -> None:
        from tui.screens.dialogs import ConfirmQuit

        if not self.state.running:
            self.exit(0)
            return

        def answer(yes: bool | None) -> None:
            if yes:
                self.state.cancel.set()  # the stage's watch loop kills the child's process group
                self.set_interval(0.1, self._exit_when_stopped)

        self.push_screen(ConfirmQuit(self.state.running), answer)

    def _exit_when_stopped(self) -> None:
        if not self.state.running:
            self.exit(130)

    def hang_up(self) -> None:
        """The terminal went away (an SSH connection dropped). Runs on the watcher thread, not the event loop (which is
        stuck writing to the dead terminal): stop the running stage, kill every child's process group, write what was
        measured as an unsigned record, and leave with 129, as a shell's SIGHUP would."""
        import os
        import signal
        import time

        state = self.state
        state.cancel.set()
        for pid in list(state.children):
            try:
                os.killpg(pid, signal.SIGKILL)  # each child leads its own process group
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + 5.0
        while state.running and time.monotonic() < deadline:
            time.sleep(0.05)
        run = state.run
        if run is not None and run.record_path is None and not run.signed:
            if state.running:
                from core.status import StageStatus, Stopped

                run.stopped.setdefault(state.running, Stopped(StageStatus.CANCELLED,
                                                              f"{state.running}: cancelled (the terminal went away)"))
            try:
                run.write_record()
            except Exception:  # noqa: BLE001 - the run directory still holds every artefact
                pass
        if self.sampler is not None:
            self.sampler.stop()

    def on_unmount(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
        self.keep_what_was_measured()

    def keep_what_was_measured(self) -> None:
        """Quitting before the sign-off still writes record.toml (unsigned): nothing measured is lost."""
        self.finish_run()

    def finish_run(self) -> None:
        """Close the current run: write its record unsigned if none was written, and forget it."""
        run = self.state.run
        if run is None:
            return
        if run.record_path is None:
            try:
                self.state.record_path = run.write_record()
            except Exception:  # noqa: BLE001 - the run directory still holds every artefact
                pass
        run.close()
        self.state.run = None


def _default_backend() -> tuple[Any, str]:
    from core.api import default_backend

    return default_backend()


def watch_terminal(app: Any, hang_up: Any) -> None:
    """Run ``hang_up()`` and exit the process with 129 when the controlling terminal goes away: on SIGHUP, or when the
    terminal stops answering (checked every second; a closed pseudo-terminal makes ``tcgetpgrp`` fail).

    Without it a wizard whose SSH connection dropped kept running with its event loop stuck on the dead terminal, so
    nothing on the loop can clean up: the work runs on a daemon thread. Apps without a terminal (tests) are not
    watched."""
    import os
    import signal
    import sys
    import threading

    if getattr(app, "is_headless", False):
        return
    stdin = sys.__stdin__
    if stdin is None:
        return  # no terminal to watch (no stdin at all)
    try:
        fd = stdin.fileno()
        os.tcgetpgrp(fd)
    except (AttributeError, OSError, ValueError):
        return  # no terminal to watch
    gone = threading.Event()
    try:
        signal.signal(signal.SIGHUP, lambda signum, frame: gone.set())
    except ValueError:  # not the main thread
        pass

    def watch() -> None:
        while not gone.wait(1.0):
            try:
                os.tcgetpgrp(fd)
            except OSError:
                break
        try:
            hang_up()
        finally:
            os._exit(129)

    threading.Thread(target=watch, name="gpuaccept-terminal", daemon=True).start()
