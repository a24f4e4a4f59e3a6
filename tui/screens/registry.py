"""The wizard's screens by name. A screen opens the next by its name (:func:`screen_named`), so no screen module
imports another and tui/app.py imports none: a screen's module is imported when it is first opened (the first screen
appears before the rest are loaded), and the screens form no import cycle (tests/unit/test_rules.py checks)."""

from __future__ import annotations

import importlib
from typing import Any

from textual.screen import Screen

#: each screen the wizard opens by name: (its module, its class); every one is made with no arguments (what it shows
#: comes from the app's state, tui/state.py)
SCREENS: dict[str, tuple[str, str]] = {
    "mode": ("tui.screens.mode", "ModeScreen"),
    "setup": ("tui.screens.setup", "SetupScreen"),
    "command": ("tui.screens.command", "CommandSetupScreen"),
    "plan": ("tui.screens.plan", "PlanScreen"),
    "probe": ("tui.screens.stages", "ProbeScreen"),
    "export": ("tui.screens.export", "ExportScreen"),
}


def screen_named(name: str) -> Screen[Any]:
    """A new screen of :data:`SCREENS` ``name``.

    Raises:
        KeyError: ``name`` is not in :data:`SCREENS`.
    """
    module, cls = SCREENS[name]
    made: Screen[Any] = getattr(importlib.import_module(module), cls)()
    return made
