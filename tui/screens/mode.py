"""Screen 1: the mode. It drives everything after it."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.widgets import Button, Footer, Header, RadioButton, RadioSet, Static

from core.methods import METHODS
from tui.screens.base import WizardScreen
from tui.screens.registry import screen_named

#: what the Mode screen lists: every method gpuaccept's recipe runs (core/methods/: its label and help), then your own
#: command (a method planned only, LoRA over an 8-bit base, is for `gpuaccept plan` and a trainer's config)
MODES = {
    **{name: (method.label, method.summary) for name, method in METHODS.items() if method.runs},
    "command": ("Your own command",
                "Your training script as you run it (python or torchrun, Trainer-based or a plain loop): measured on "
                "each device (inside a transformers Trainer, from outside otherwise), planned from what it ran, its "
                "final checkpoint evaluated, killed after a checkpoint and resumed with your resume command."),
}


def mode_help(mode: str) -> str:
    """What ``mode`` is, in the Mode screen's words; a method the recipe does not run (LoRA over an 8-bit base, BAdam:
    opened from a trainer's config) says that it is planned only."""
    if mode in MODES:
        return MODES[mode][1]
    method = METHODS[mode]
    return (f"{method.label}, from the trainer's config: planned (Plan), not run by gpuaccept's own recipe; choose "
            f"another mode to run one. {method.summary}")


class ModeButton(RadioButton):
    """A radio button whose state shows without colour too: ● chosen, ○ not (plain-text terminals, screen readers)."""

    def render(self) -> Content:
        # Textual draws BUTTON_INNER (a class attribute) inside the button: made to follow the value before each drawing
        self.BUTTON_INNER = "●" if self.value else "○"
        return super().render()


class ModeChoice(RadioSet):
    """The mode list: the cursor *is* the choice (Textual's RadioSet only moves a highlight, which Enter then ignored:
    ↓ to "Full fine-tuning" and Enter ran LoRA), and the highlight starts on the chosen mode. The keys are bound on
    :class:`ModeScreen`, which calls :meth:`step`."""

    def on_mount(self) -> None:
        self.call_after_refresh(self._highlight_chosen)  # after RadioSet's own mount put it on the first button

    def _highlight_chosen(self) -> None:
        chosen = [i for i, b in enumerate(self.query(RadioButton)) if b.value]
        if chosen:
            self._selected = chosen[0]

    def step(self, direction: int) -> str | None:
        """Move the highlight by one (↓: +1, ↑: -1) and choose the mode under it; returns that mode's id when it
        changed, else None."""
        if direction > 0:
            self.action_next_button()
        else:
            self.action_previous_button()
        if self._selected is not None:
            button = self._nodes[self._selected]
            if isinstance(button, RadioButton) and not button.value:
                button.value = True
                return str(button.id)
        return None


def mode_title(mode: str) -> str:
    """The first screen's title, counted as the screens that follow count (your own command has four steps)."""
    return f"Step 1/{4 if mode == 'command' else 7} · Mode"


class ModeScreen(WizardScreen):
    """Choose inference, full fine-tuning, LoRA or its 4-bit variant QLoRA, or your own training command."""

    # Every key of this screen is a priority binding, handled in the order typed: Enter is one (RadioSet would take it
    # otherwise), and a plain binding is handled after the key reaches the screen, so "4" and Enter typed together
    # (or ↓ and Enter) ran the mode chosen before the first key.
    BINDINGS = [Binding("enter", "next", "Next", priority=True), Binding("ctrl+n", "next", "Next", show=False),
                *(Binding(str(i), f"pick('{mode}')", show=False, priority=True) for i, mode in enumerate(MODES, 1)),
                Binding("down,right", "move(1)", show=False, priority=True),
                Binding("up,left", "move(-1)", show=False, priority=True)]

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(mode_title(self.app.state.mode), classes="title", id="mode-title")
        yield Static("What will this setup do on the GPU? The mode decides which memory exists at all: "
                     "gradients and optimizer states only when training, and what is trained.", classes="intro")
        with Vertical(classes="body"):
            with ModeChoice(id="mode"):
                for key, (label, _) in MODES.items():
                    yield ModeButton(f"{list(MODES).index(key) + 1}  {label}", value=key == self.app.state.mode,
                                     id=key)
            yield Static(mode_help(self.app.state.mode), id="mode-help")
        with Horizontal(classes="nav"):
            yield Button("Next →", id="next", variant="primary")
        yield Footer(show_command_palette=False)  # no ^p palette key: at 80 columns every key shows

    def choose(self, mode: str) -> None:
        """Make ``mode`` the run's mode at once and say what it is. The radio's Changed message comes later, after
        keys already queued: "4" then Enter typed together ran the mode chosen before "4"."""
        self.app.state.mode = mode
        self.query_one("#mode-help", Static).update(mode_help(mode))
        self.query_one("#mode-title", Static).update(mode_title(mode))

    def on_radio_set_changed(self, event: RadioSet.Changed) -> None:
        self.choose(str(event.pressed.id))

    def action_move(self, direction: int) -> None:
        mode = self.query_one(ModeChoice).step(direction)
        if mode is not None:  # now: an Enter already queued must run this mode
            self.choose(mode)

    def action_pick(self, mode: str) -> None:
        self.query_one(f"#{mode}", RadioButton).value = True
        choice = self.query_one(ModeChoice)
        choice._selected = list(MODES).index(mode)  # the highlight follows a choice made by number
        self.choose(mode)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "next":
            self.action_next()

    def action_next(self) -> None:
        self.app.push_screen(screen_named("command" if self.app.state.mode == "command" else "setup"))
