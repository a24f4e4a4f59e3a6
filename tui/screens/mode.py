"""Screen 1: the mode. It drives everything after it."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Button, Footer, Header, RadioButton, RadioSet, Static

MODES = {
    "inference": ("Inference",
                  "Fixed weights: forward passes only. No backward, no gradients, no optimizer, no update. "
                  "Memory: weights + KV cache + one layer's working set. Evaluated once on held-out text."),
    "full": ("Full fine-tuning",
             "Every parameter is trained: backward through the whole model, a gradient and optimizer states "
             "for every parameter (AdamW: 16 B per parameter in mixed precision), plus activations."),
    "lora": ("LoRA",
             "The base is frozen; small low-rank matrices are trained. Gradients and optimizer states only for "
             "the adapters - but activations shrink little (SmolLM2, LoRA on q/v: ~0.75x of full fine-tuning's): "
             "backward still flows through the frozen base."),
}


class ModeScreen(Screen):
    """Choose inference, full fine-tuning or LoRA."""

    BINDINGS = [Binding("enter", "next", "Next", priority=True), Binding("1", "pick('inference')", show=False),
                Binding("2", "pick('full')", show=False), Binding("3", "pick('lora')", show=False)]

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("Step 1/7 · Mode", classes="title")
        yield Static("What will this setup do on the GPU? The mode decides which memory exists at all: "
                     "gradients and optimizer states only when training, and what is trained.", classes="intro")
        with Vertical(classes="body"):
            with RadioSet(id="mode"):
                for key, (label, _) in MODES.items():
                    yield RadioButton(f"{list(MODES).index(key) + 1}  {label}", value=key == self.app.state.mode,
                                      id=key)
            yield Static(MODES[self.app.state.mode][1], id="mode-help")
        with Horizontal(classes="nav"):
            yield Button("Next →", id="next", variant="primary")
        yield Footer()

    def on_radio_set_changed(self, event: RadioSet.Changed) -> None:
        self.app.state.mode = event.pressed.id
        self.query_one("#mode-help", Static).update(MODES[event.pressed.id][1])

    def action_pick(self, mode: str) -> None:
        self.query_one(f"#{mode}", RadioButton).value = True

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "next":
            self.action_next()

    def action_next(self) -> None:
        from tui.screens.setup import SetupScreen

        self.app.push_screen(SetupScreen())
