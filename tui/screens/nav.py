"""The Back / Next buttons every wizard screen has, and what ^n and Esc say when they cannot act."""

from __future__ import annotations

from typing import Any

from textual.widgets import Button


class NavButtons:
    """Mixin for screens with ``#back`` and ``#next`` buttons: Next runs ``action_next``, Back goes back.

    ^n is dimmed in the footer while :meth:`next_blocked` gives a reason, and pressing it then says that reason
    (a key that silently does nothing teaches nothing). Esc while a stage runs says why it cannot go back."""

    def next_blocked(self) -> str | None:
        """Why Next cannot act now, in words for the user; None when it can. Screens say more than this default."""
        try:
            disabled = self.query_one("#next", Button).disabled  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - before compose
            return "not ready yet"
        return "Next is not available yet" if disabled else None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "next":
            return None if self.next_blocked() else True
        return True

    def on_key(self, event: Any) -> None:
        app = self.app  # type: ignore[attr-defined]
        if event.key == "ctrl+n":
            why = self.next_blocked()
            if why:
                event.stop()
                app.bell()
                app.notify(why, severity="warning", timeout=4)
        elif event.key == "escape" and app.state.running:
            event.stop()
            app.go_back()  # says which stage runs and how to stop it

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "next":
            self.action_next()  # type: ignore[attr-defined]
        elif event.button.id == "back":
            self.app.go_back()  # type: ignore[attr-defined]
