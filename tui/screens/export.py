"""Screen 7: the verdicts with their evidence, the sign-off, and the record."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.content import Content
from textual.markup import escape
from textual.widgets import Button, Footer, Header, Input, Label, Select, Static

from tui.screens.base import WizardScreen
from tui.widgets.inputs import OrderedInput, OrderedSelect

if TYPE_CHECKING:
    from core.api import StagedRun

#: said before anyone signs: a signed record is never rewritten (core.record.build), so what is not in it then never will be
SIGNING_FREEZES = ("Signing freezes record.toml: nothing is added after, not even the quiz's score (for that: "
                   "write it unsigned, take the quiz, then gpuaccept sign).")


#: the export form's fields, kept in WizardState.signoff_draft
DRAFT_FIELDS = ("operator", "role", "decision", "comment", "key")


class ExportScreen(WizardScreen):
    """Every stage's status and evidence; operator, decision and comment; write record.toml."""

    # letters type into the fields here, so every action is a control key, each named in the footer; ^n is the
    # next thing to do: write the record, then take the quiz (the footer shows the one that applies)
    BINDINGS = [
        Binding("ctrl+n", "write", "Write record"),
        Binding("ctrl+n", "quiz", "Quiz"),
        Binding("ctrl+o", "compare", "Compare runs"),
        Binding("ctrl+q", "quit_export", "Quit"),
    ]
    DEFAULT_CSS = "ExportScreen .nav Button { min-width: 12; }"  # five buttons in 80 columns
    q_types = True  # the app's q Quit is not offered here (tui.app.GpuAcceptApp.check_action)
    #: what the error line says about the override while it says it (Comment becomes the reason), else None
    _override_said: str | None = None
    _missing_said: str | None = None  # the error that says what the sign-off lacks, while it is shown

    def compose(self) -> ComposeResult:
        draft = self.app.state.signoff_draft
        yield Header()
        command = self.app.state.mode == "command" and self.app.state.command_run()
        yield Static(f"Step {'4/4' if command else '7/7'} · Sign off and write the record", classes="title")
        yield Static("The record keeps every number with where it comes from: measured, estimated (how) or not run. "
                     "Your decision is yours: the verdict says what passed on this box, nothing more.", classes="intro")
        yield Static(SIGNING_FREEZES, id="sign-note", classes="intro")  # above the fold at 80x24: before you sign
        with VerticalScroll(classes="body", id="export-body"):
            yield Static("", id="overall")
            yield Static("", id="verdicts")
            with Horizontal(classes="field"):
                yield Label("Operator")
                yield OrderedInput(draft.get("operator", ""), placeholder="your name", id="operator", compact=True)
            with Horizontal(classes="field"):
                yield Label("Role")
                yield OrderedInput(draft.get("role", ""), placeholder="e.g. ML infra on-call (optional)", id="role",
                                   compact=True)
            with Horizontal(classes="field"):
                yield Label("Decision")
                yield OrderedSelect([("accept", "accept"), ("reject", "reject")], prompt="choose", id="decision", compact=True,
                             value=draft.get("decision", Select.NULL))
            with Horizontal(classes="field"):
                yield Label("Comment")
                yield OrderedInput(draft.get("comment", ""), placeholder="why (optional)", id="comment", compact=True)
            with Horizontal(classes="field"):
                yield Label("Signing key")
                yield OrderedInput(draft.get("key", ""), id="key", compact=True,
                                   placeholder="key file, or an agent key's .pub; empty: unsigned")
            yield Static(self._key_hint(), id="key-info")
            yield Static("", id="written")
        yield Static("", classes="error", id="export-error")
        with Horizontal(classes="nav"):
            yield Button("← Back", id="back")
            yield Button("Write record", id="write")  # no variant: the focused button is the one highlighted
            yield Button("Quiz →", id="quiz", disabled=True)
            yield Button("Compare…", id="compare")
            yield Button("Quit", id="quit")
        yield Footer(show_command_palette=False)  # no ^p palette key: at 80 columns every key shows

    def on_mount(self) -> None:
        run = self.app.state.run
        if run is None:
            self.query_one("#overall", Static).update("nothing has run yet")
            self.query_one("#write", Button).disabled = True
            return
        from core.spec import RunSpec

        v = run.current_verdict()  # what the record will say: the traced plan and stopped stages included
        spec = run.spec
        what = f"{spec.mode} on {spec.model}" if isinstance(spec, RunSpec) else f"your command {spec.label}"
        self.query_one("#quiz", Button).display = isinstance(spec, RunSpec)  # its questions need the recipe's ledger
        self.query_one("#overall", Static).update(
            f"overall: [b]{v['status'].upper()}[/b] · {what} · run directory {run.run_dir}")
        marks = {"pass": "[$success]✓[/]", "not_applicable": "[$text-muted]–[/]"}
        self.query_one("#verdicts", Static).update(Content("\n").join(
            Content.from_markup(marks.get(item["status"], "[$error]✗[/]"))
            + Content(f" {stage} {item['status']}: {item['evidence']}") for stage, item in v["stages"].items()))
        self.query_one("#operator", Input).focus()

    @staticmethod
    def _key_hint() -> str:
        from core.api import agent_keys

        held = agent_keys()
        agent = f"the ssh-agent holds {len(held)} key(s); give the .pub of one" if held else "no ssh-agent key"
        return f"signed with ssh-keygen -Y sign, namespace gpuaccept-record, into record.toml.sig ({agent})"

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id in DRAFT_FIELDS:
            self.app.state.signoff_draft[event.input.id] = event.value
        if event.input.id == "key":
            self.show_fingerprint(event.value.strip())
        self._clear_fixed()

    def _clear_fixed(self) -> None:
        """An error that said what was missing goes as soon as it is given (issue 51: "name the operator who signs
        off" stayed after the name was typed)."""
        if self._missing_said is None:
            return
        error = self.query_one("#export-error", Static)
        if str(error.content) != self._missing_said:
            self._missing_said = None
            return
        if self._missing() != self._missing_said:  # what it asked for is given (the next gap is said at the next write)
            error.update("")
            self._missing_said = None

    def _missing(self) -> str | None:
        """What the sign-off still lacks, in the error's words; None when the operator and a decision are given and an
        accept that needs an override has its reason."""
        if not self.query_one("#operator", Input).value.strip():
            return "name the operator who signs off"
        decision = str(self.query_one("#decision", Select).value)
        if decision not in ("accept", "reject"):
            return "choose a decision: accept or reject"
        override_said = self._override_needed(decision)
        if override_said is not None and not self.query_one("#comment", Input).value.strip():
            return f"not written: {override_said}"
        return None

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "decision":
            if event.value in ("accept", "reject"):
                self.app.state.signoff_draft["decision"] = str(event.value)
            else:
                self.app.state.signoff_draft.pop("decision", None)
            self._say_override(str(event.value))
            self._clear_fixed()

    def _run(self) -> StagedRun:
        """The run this screen signs off (it is only reached once a run exists; RuntimeError otherwise)."""
        if self.app.state.run is None:
            raise RuntimeError("the sign-off screen was shown before any run started")
        return self.app.state.run

    def _override_needed(self, decision: str) -> str | None:
        """What to say when ``decision`` would accept a run whose verdict is not pass (the rule of
        :func:`core.record.signoff.checked_signoff`, which ``gpuaccept sign`` applies too); None when it would not."""
        from core.api import needs_override, verdict_in_words

        run = self.app.state.run
        if run is None:
            return None
        verdict = run.current_verdict()
        if not needs_override(verdict, decision):
            return None
        return (f"the verdict is {verdict_in_words(verdict)}: to accept it anyway, type your reason in Comment; it is "
                "kept in the record as the override (as gpuaccept sign --override), or choose reject")

    def _say_override(self, decision: str) -> None:
        """Choosing accept on a run that did not pass says at once that the Comment becomes the override's reason."""
        error = self.query_one("#export-error", Static)
        said = self._override_needed(decision)
        if said is not None:
            error.update(Content(said))
            self._override_said = said
        elif self._override_said is not None and str(error.content) == self._override_said:
            error.update("")
            self._override_said = None

    @work(thread=True, exclusive=True, group="fingerprint")
    def show_fingerprint(self, key: str) -> None:
        from core.api import SigningError, fingerprint

        if not key:
            text = self._key_hint()
        else:
            try:
                text = f"key: {fingerprint(Path(key).expanduser())}"
            except SigningError as exc:
                text = str(exc)
        self.app.call_from_thread(self.query_one("#key-info", Static).update, Content(text))
        # at 80x24 the key's fingerprint sits below the fold: bring it into view as it appears
        self.app.call_from_thread(self.query_one("#key-info", Static).scroll_visible)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """^n writes the record until it is written, then opens the quiz (where there is one)."""
        written = self.app.state.record_path is not None and self._button("write").disabled
        if action == "write":
            return False if written or self.app.state.run is None else True
        if action == "quiz":
            return True if written and self._button("quiz").display else False
        return True

    def _button(self, name: str) -> Button:
        return self.query_one(f"#{name}", Button)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        actions = {"write": self.action_write, "back": self.app.go_back, "quit": self.action_quit_export,
                   "compare": self.action_compare, "quiz": self.action_quiz}
        if event.button.id in actions:
            actions[event.button.id]()

    def action_write(self) -> None:
        if not self._button("write").disabled:
            self.write()

    def action_compare(self) -> None:
        """This run beside the others of the runs folder (gpuaccept diff)."""
        from tui.screens.compare import CompareScreen

        self.app.push_screen(CompareScreen(self.app.state.runs_root, self.app.state.record_path))

    def action_quiz(self) -> None:
        if self.app.state.record_path is None or self._button("quiz").disabled:
            return
        from core.errors import GpuAcceptError
        from tui.screens.quiz import QuizScreen

        try:
            screen = QuizScreen(self.app.state.record_path)
        except (GpuAcceptError, OSError, ValueError) as exc:  # shown, never a traceback
            self.query_one("#export-error", Static).update(Content(f"no quiz: {exc}"))
            return
        self.app.push_screen(screen)

    def unwritten_signoff(self) -> str | None:
        """The sign-off typed here but not in a written record, in words; None when nothing would be dropped."""
        if self.app.state.run is None or self._button("write").disabled:
            return None
        operator = self.query_one("#operator", Input).value.strip()
        decision = self.query_one("#decision", Select).value
        if not operator and decision not in ("accept", "reject"):
            return None
        said = ", ".join(part for part in (f"operator {operator}" if operator else "",
                                           f"decision {decision}" if decision in ("accept", "reject") else "") if part)
        return said

    def action_quit_export(self) -> None:
        """^q: quit, but never drop a typed sign-off without a word: ask whether to write it first."""
        typed = self.unwritten_signoff()
        if typed is None:
            self.app.action_quit_app()  # an unwritten record is still written, unsigned (GpuAcceptApp.finish_run)
            return
        from tui.screens.dialogs import ConfirmDropSignoff

        complete = self.signoff_complete()

        def answer(choice: str | None) -> None:
            if choice == "write":
                self._quit_after_write = True
                self.write()
            elif choice == "drop":
                self.app.action_quit_app()

        self.app.push_screen(ConfirmDropSignoff(typed, complete), answer)

    def signoff_complete(self) -> bool:
        return bool(self.query_one("#operator", Input).value.strip()) and \
            self.query_one("#decision", Select).value in ("accept", "reject")

    def signoff(self) -> dict | None:
        """The sign-off typed here, or None (the error line says what is missing). An accept of a run whose verdict is
        not pass needs a reason: the Comment, kept as the override (:func:`core.record.signoff.checked_signoff`)."""
        from core.api import SignoffRefused, checked_signoff, make_signoff

        operator = self.query_one("#operator", Input).value.strip()
        decision = self.query_one("#decision", Select).value
        error = self.query_one("#export-error", Static)
        missing = self._missing()
        if missing is not None:
            error.update(Content(missing))
            self._missing_said = missing
            return None
        comment = self.query_one("#comment", Input).value
        error.update("")
        override = comment if self._override_needed(str(decision)) is not None else None
        signoff = make_signoff(operator, str(decision), self.query_one("#role", Input).value, comment, override)
        try:
            return checked_signoff(self._run().current_verdict(), signoff)
        except SignoffRefused as exc:  # shown, never a traceback
            error.update(Content(f"not written: {exc}"))
            return None

    @work(thread=True, exclusive=True, group="record")
    def write(self) -> None:
        from core.api import SigningError, can_sign

        quit_after, self._quit_after_write = getattr(self, "_quit_after_write", False), False
        signoff = self.app.call_from_thread(self.signoff)
        if signoff is None:
            return
        key = self.app.call_from_thread(lambda: self.query_one("#key", Input).value.strip())
        if key:  # a key that cannot sign stops here, before the record is written with this sign-off
            try:
                can_sign(Path(key).expanduser())
            except SigningError as exc:
                self.app.call_from_thread(self.query_one("#export-error", Static).update,
                                          Content(f"not written: {exc}"))
                return
        try:
            path = self._run().write_record(signoff)
        except Exception as exc:  # noqa: BLE001 - shown, never a traceback
            self.app.call_from_thread(self.query_one("#export-error", Static).update, f"not written: {exc}")
            return
        signed = self.sign(path)
        self.app.call_from_thread(self._show_written, path, signoff, signed)
        if quit_after:  # ^q, then "write it and quit"
            self.app.call_from_thread(self.app.exit, 0)

    def _show_written(self, path: Path, signoff: dict, signed: str) -> None:
        """The record is written: say where and how signed, and make ^n the quiz (on the event loop, at once)."""
        self.app.state.record_path = path  # with the screen's change, in one turn of the event loop
        if not self.is_attached:
            return  # the screen was left meanwhile; the record is written all the same
        self.query_one("#write", Button).disabled = True
        # the quiz is built from gpuaccept's own recipe records (core.quiz); a command record has no such ledger
        self.query_one("#quiz", Button).disabled = self.app.state.command_run()
        how = "signed" if signed.startswith("signed into") else "UNSIGNED"
        written = self.query_one("#written", Static)
        override = (f"; OVERRIDE of {', '.join(signoff.get('overridden', []))}: {escape(signoff['override'])}"
                    if signoff.get("override") else "")
        written.update(f"[b]record written, {how}:[/b] {path}\n(verdict {self._run().verdict}; "
                       f"decision {signoff['decision']} by {signoff['operator']}{override}; {signed})")
        # at 80x24 the confirmation sits below the form: shown once its lines are laid out (issue 51: scrolled to
        # before, command mode's longer table left the path below the visible area)
        body = self.query_one("#export-body", VerticalScroll)
        self.call_after_refresh(body.scroll_end, animate=False)
        self.refresh_bindings()  # ^n now opens the quiz

    def sign(self, path: Path) -> str:
        """Sign the written record with the key given, if any; what happened, in words (never raises)."""
        from core.api import SigningError, fingerprint, sign

        key = self.app.call_from_thread(lambda: self.query_one("#key", Input).value.strip())
        if not key:
            return "unsigned: no key given; sign later with gpuaccept sign RECORD --key KEY"
        try:
            fp = fingerprint(Path(key).expanduser())
            sig = sign(path, Path(key).expanduser())
        except SigningError as exc:
            self.app.call_from_thread(self.query_one("#export-error", Static).update,
                                      Content(f"record written, not signed: {exc}"))
            return "not signed"
        self.app.state.signature_path = sig
        return f"signed into {sig.name} with {fp}"
