"""The Back / Next buttons every wizard screen has."""

from __future__ import annotations

from textual.widgets import Button


class NavButtons:
    """Mixin for screens with ``#back`` and ``#next`` buttons: Next runs ``action_next``, Back goes back."""

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "next":
            self.action_next()
        elif event.button.id == "back":
            self.app.action_back()
