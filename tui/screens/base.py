"""The base class of the wizard's screens: a Screen whose ``app`` is typed as the wizard (:class:`tui.app.GpuAcceptApp`),
so the screens reach ``self.app.state`` and the app's own methods with their types."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from textual.screen import Screen

if TYPE_CHECKING:
    from textual import getters

    from tui.app import GpuAcceptApp  # tui/app.py imports the screens (inside its functions): typing only


class WizardScreen(Screen[Any]):
    """A screen of the wizard. Only the type of ``app`` differs from Textual's Screen.

    Textual declares ``app`` for the type checker as ``getters.app(App)`` (``textual.message_pump.MessagePump``) and
    documents ``getters.app(MyApp)`` to narrow it; the narrowing is made for the type checker only, so at run time
    ``self.app`` is Textual's own (no import of tui.app here, no isinstance check added)."""

    if TYPE_CHECKING:
        app = getters.app(GpuAcceptApp)
