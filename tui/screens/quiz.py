"""The onboarding check: questions from one record's own numbers (core.quiz), answered with the keyboard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Button, Footer, Header, Input, Label, OptionList, Static

from tui.widgets.inputs import OrderedInput

#: how a choice is labelled: by the key that answers it (keys 1-4; A-D answer too)
LETTERS = "1234"



def choice_prompt(mark: str, letter: str, text: str) -> Any:
    """One answer as the list shows it: the mark and the letter in a column of their own, the text beside them, so a
    long answer wraps under its own first word, not under the letter (issue 51)."""
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True)
    grid.add_column(ratio=1)
    grid.add_row(f"{mark}{letter}", text)
    return grid

class QuizScreen(Screen):
    """One question at a time: 1-4 (or ↑↓ Enter) answers, the explanation points at the record's evidence, n goes on.
    At the end the score, and the answers can be added to the (unsigned) record as its ``onboarding`` table."""

    BINDINGS = [
        Binding("1", "answer(0)", "A", show=False),
        Binding("2", "answer(1)", "B", show=False),
        Binding("3", "answer(2)", "C", show=False),
        Binding("4", "answer(3)", "D", show=False),
        Binding("a", "answer(0)", "A", show=False), Binding("b", "answer(1)", "B", show=False),
        Binding("c", "answer(2)", "C", show=False), Binding("d", "answer(3)", "D", show=False),
        Binding("n", "next", "Next question"),
        Binding("ctrl+n", "next", "Next", show=False),
        # the score: ^s adds the answers to an unsigned record (Enter in the operator field does too); Esc closes
        Binding("ctrl+s", "add", "Add to record"),
        Binding("escape", "close", "Close"),
    ]

    def __init__(self, record_path: Path, operator: str = "") -> None:
        super().__init__()

        from core.api import build_quiz, read_record

        self.record_path = Path(record_path)
        self.record = read_record(self.record_path)
        self.questions = build_quiz(self.record)
        self.chosen: list[int] = []
        self.index = 0
        self.operator = operator or str(self.record.get("signoff", {}).get("operator", ""))

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", classes="title", id="quiz-title")
        yield Static("From this run's own record: each right answer follows from its numbers. Keys 1-4 (or ↑↓ and "
                     "Enter) answer; n goes on.", classes="intro", id="quiz-intro")
        with VerticalScroll(classes="body", id="quiz-body"):
            yield Static("", id="prompt")
            yield OptionList(id="choices", compact=True)
            yield Static("", id="feedback")
            yield Static("", id="summary")
            with Horizontal(classes="field", id="operator-field"):
                yield Label("Operator")
                yield OrderedInput(value=self.operator, placeholder="who answered", id="operator", compact=True)
            yield Static("", id="added")
        with Horizontal(classes="nav"):
            yield Button("Next →", id="next", variant="primary", disabled=True)
            yield Button("Add to record", id="add", disabled=True)
            yield Button("Close", id="close")
        yield Footer(show_command_palette=False)  # no ^p palette key: at 80 columns every key shows

    def on_mount(self) -> None:
        self.query_one("#operator-field").display = False
        self.query_one("#add").display = False
        self.show_question()

    # ------------------------------------------------------------------ questions
    def show_question(self) -> None:
        q = self.questions[self.index]
        self.query_one("#quiz-title", Static).update(
            f"Onboarding check · question {self.index + 1} of {len(self.questions)}")
        self.query_one("#prompt", Static).update(Content(q.prompt))
        choices = self.query_one("#choices", OptionList)
        choices.clear_options()
        choices.add_options([choice_prompt("", LETTERS[i], c) for i, c in enumerate(q.choices)])
        choices.disabled = False
        choices.highlighted = 0
        choices.focus()
        self.query_one("#feedback", Static).update("")
        self.query_one("#next", Button).disabled = True

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.action_answer(event.option_index)

    def action_answer(self, i: int) -> None:
        if len(self.chosen) > self.index or self.index >= len(self.questions):
            return  # answered already: the first answer counts
        q = self.questions[self.index]
        if i >= len(q.choices):
            return
        self.chosen.append(i)
        right = i == q.answer
        verdict = "[green]✓ Right.[/]" if right else f"[red]✗ Not this one: the answer is {LETTERS[q.answer]}.[/]"
        self.query_one("#feedback", Static).update(
            Content.from_markup(verdict) + Content("\n" + q.explanation + "\nEvidence: " + ", ".join(q.evidence)))
        choices = self.query_one("#choices", OptionList)
        choices.clear_options()  # mark the answer given and the right one (not by colour alone)
        choices.add_options([choice_prompt('✓ ' if k == q.answer else '✗ ' if k == i else '  ', LETTERS[k], c)
                             for k, c in enumerate(q.choices)])
        choices.disabled = True
        nxt = self.query_one("#next", Button)
        nxt.label = "Next →" if self.index + 1 < len(self.questions) else "Score →"
        nxt.disabled = False
        nxt.focus()
        self.query_one("#feedback", Static).scroll_visible()

    def action_next(self) -> None:
        if len(self.chosen) <= self.index:
            return
        self.index += 1
        if self.index < len(self.questions):
            self.show_question()
        else:
            self.show_summary()

    # ------------------------------------------------------------------ the end
    @property
    def score(self) -> int:
        return sum(c == q.answer for q, c in zip(self.questions, self.chosen))

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action in ("next", "answer") and self.index >= len(self.questions):
            return False  # the score screen: nothing left to answer (and the footer stops offering it)
        if action == "add":
            try:
                add = self.query_one("#add", Button)
            except Exception:  # noqa: BLE001 - before compose
                return False
            return True if add.display and not add.disabled else False
        return True

    def action_add(self) -> None:
        if self.check_action("add", ()):
            self.add_to_record()

    def action_close(self) -> None:
        if isinstance(self.app, QuizApp):  # `gpuaccept quiz`: the quiz is the whole app
            self.app.exit(0)
        else:  # from the wizard's export screen: back to it
            self.dismiss(self.score)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "operator" and not self.query_one("#add", Button).disabled:
            self.add_to_record()

    def show_summary(self) -> None:
        self.query_one("#quiz-title", Static).update("Onboarding check · score")
        self.query_one("#quiz-intro", Static).update("Every question and whether it was answered right; the "
                                                     "explanations were shown with each answer.")
        self.refresh_bindings()
        for wid in ("#prompt", "#choices", "#feedback"):
            self.query_one(wid).display = False
        lines = [f"[b]{self.score} of {len(self.questions)}[/b] right."]
        for q, c in zip(self.questions, self.chosen):
            mark = "[green]✓[/]" if c == q.answer else f"[red]✗[/] (answer {LETTERS[q.answer]})"
            lines.append(f"{mark} {q.id.replace('_', ' ')}")
        from core.api import signature_path

        signed = signature_path(self.record_path).exists()
        lines.append("The record is signed, so it is never rewritten: the score stays here." if signed else
                     "Add the answers to the record as its onboarding table (optional), with who answered:")
        self.query_one("#summary", Static).update(Content.from_markup("\n".join(lines)))
        self.query_one("#next").display = False
        add = self.query_one("#add", Button)
        add.display = not signed  # a signed record is never rewritten: no button that cannot act
        add.disabled = signed
        self.query_one("#operator-field").display = not signed
        self.refresh_bindings()
        (self.query_one("#operator", Input) if not signed else self.query_one("#close", Button)).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "next":
            self.action_next()
        elif event.button.id == "add":
            self.add_to_record()
        elif event.button.id == "close":
            self.action_close()

    def add_to_record(self) -> None:
        from core.api import add_quiz_answers
        from core.errors import GpuAcceptError

        try:
            table, path = add_quiz_answers(self.record_path, self.questions, self.chosen,
                                           self.query_one("#operator", Input).value)
        except GpuAcceptError as exc:
            self.query_one("#added", Static).update(Content(f"not added: {exc}"))
            return
        self.query_one("#added", Static).update(Content(f"added to {path} as [onboarding] ({table['score']} of "
                                                        f"{table['questions_asked']}, {table['operator']})"))
        self.query_one("#add", Button).disabled = True
        self.refresh_bindings()
        self.query_one("#added", Static).scroll_visible()


class QuizApp(App[int]):
    """``gpuaccept quiz RECORD``: the quiz screen alone."""

    CSS_PATH = "../app.tcss"
    TITLE = "gpuaccept"
    SUB_TITLE = "onboarding check"
    BINDINGS = [Binding("q", "quit", "Quit")]

    def __init__(self, record_path: Path, operator: str = "") -> None:
        super().__init__()
        self.record_path, self.operator = Path(record_path), operator

    def on_mount(self) -> None:
        self.push_screen(QuizScreen(self.record_path, self.operator))

