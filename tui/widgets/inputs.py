"""Inputs and menus whose keys take effect in the order they were typed.

Textual inserts printable characters as soon as the focused widget gets them, but resolves bound keys (Tab, Enter,
Ctrl+U, ...) only when the key has bubbled up to the App, a few messages later, against the focus of that moment; and
the App hands every key of a burst to the widget that had the focus when the key arrived. Typed fast (a paste over SSH
without bracketed paste, tmux ``send-keys``, a keyboard macro) keys then landed in a field already left, or were lost.
This is Textual issue 6605 (open; PR 6631 runs the Input's own bindings inline). The widgets here resolve each bound key
inline, as the App would resolve it, and pass a key that reached them after an earlier key moved the focus on to the
widget that has the focus now.
"""

from __future__ import annotations

from typing import Any

from textual import events
from textual.css.query import NoMatches
from textual.widget import Widget
from textual.widgets import Input, Select
from textual.widgets._select import SelectCurrent, SelectOverlay

#: the longest the App waits for the keys before a new one to be handled (a handler that waits on the App itself
#: would otherwise hold every key after it)
SETTLE_S = 1.0


async def keys_settled(app: Any, limit_s: float = SETTLE_S) -> None:
    """Return once no widget of the current screen has a message waiting (the keys before this one handled, and the
    keys they passed on), or after ``limit_s``. Message queues are Textual's own (``MessagePump._message_queue``).
    Raises nothing."""
    import asyncio
    import time

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            screen = app.screen
            pumps = [screen, *screen.walk_children(with_self=False)]
        except Exception:  # noqa: BLE001 - no screen yet, or one being replaced: nothing to wait for
            return
        if all(p._message_queue.empty() for p in pumps):  # noqa: SLF001 - see the docstring
            return
        await asyncio.sleep(0)


async def _ordered_key(widget: Widget, event: events.Key) -> bool:
    """Handle ``event`` at ``widget`` in typing order; True where it was handled here (and stopped).

    A key that reaches ``widget`` after an earlier key moved the focus away (the App had already handed it over) goes
    on to the focused widget: printable keys and keys for an ordered widget as the key itself, other keys as the
    bindings seen from the focused widget. A bound key for ``widget`` itself runs its binding now. Raises nothing.
    """
    focused = widget.screen.focused
    if focused is not None and focused is not widget and widget not in focused.ancestors:
        event.stop()
        event.prevent_default()
        if isinstance(focused, ORDERED) or event.is_printable:
            focused.post_message(events.Key(event.key, event.character))  # after what it was already sent
        else:
            await widget.app._check_bindings(event.key)  # noqa: SLF001 - resolved from the focused widget, now
        return True
    if focused is widget and not event.is_printable and await widget.app._check_bindings(event.key):  # noqa: SLF001
        event.stop()
        event.prevent_default()
        return True
    return False


class OrderedInput(Input):
    """:class:`textual.widgets.Input` whose keys take effect in the order they were typed (see the module).

    "Ctrl+U then a path" typed at once cleared the path typed after it, and characters typed after Tab landed in the
    field being left. Shape: a drop-in for ``Input``; raises nothing of its own.
    """

    async def _on_key(self, event: events.Key) -> None:
        if await _ordered_key(self, event):
            return
        await super()._on_key(event)


class _OrderedOverlay(SelectOverlay):
    """The open menu of an :class:`OrderedSelect`: Enter chooses and Escape closes at once, so the keys typed after
    them go where the focus is then, not into the closing menu."""

    async def _on_key(self, event: events.Key) -> None:
        if await _ordered_key(self, event):
            return
        await super()._on_key(event)

    def action_select(self) -> None:
        index = self.highlighted
        if index is None or self._options[index].disabled or not isinstance(self.parent, OrderedSelect):
            super().action_select()
            return
        self.parent.choose(index)

    def action_dismiss(self) -> None:
        if isinstance(self.parent, OrderedSelect):
            self.parent.close_menu()
        else:
            super().action_dismiss()


class OrderedSelect(Select[Any]):
    """:class:`textual.widgets.Select` whose keys take effect in the order they were typed (see the module).

    Walked in tmux: the keys sent right after Enter chose an entry went to the closing menu and were lost, so a signing
    key typed after them stayed empty. Here the menu opens, chooses and closes within the key that asks for it, and
    the focus moves with it. Shape: a drop-in for ``Select``; raises nothing of its own.
    """

    def compose(self) -> Any:
        yield SelectCurrent(self.prompt)
        yield _OrderedOverlay(type_to_search=self._type_to_search).data_bind(compact=Select.compact)

    async def _on_key(self, event: events.Key) -> None:
        if await _ordered_key(self, event):
            return
        await super()._on_key(event)

    def _watch_expanded(self, expanded: bool) -> None:
        """Textual's ``Select._watch_expanded`` but for the focus: the menu is focused now, within this key, not by a
        deferred ``focus()`` that would land after the keys typed next (and take the focus back from where they
        moved it)."""
        try:
            overlay = self.query_one(_OrderedOverlay)
        except NoMatches:  # the widget is being removed
            return
        self.set_class(expanded, "-expanded")
        if not expanded:
            return
        self.screen.set_focus(overlay, scroll_visible=False)  # focused now: the keys after Enter move in the menu
        current = self.query_one(SelectCurrent)
        if self.value is self.NULL:
            overlay.select(None)
            current.has_value = False
            return
        for index, (_prompt, value) in enumerate(self._options):
            if value == self.value:
                overlay.select(index)
                break
        current.has_value = True

    def choose(self, index: int) -> None:
        """Set the value to the option at ``index`` (of the menu), close the menu and focus this Select now."""
        value = self._options[index][1]
        if value != self.value:
            self.value = value
        self.close_menu()

    def close_menu(self) -> None:
        """Close the menu and give the focus back to this Select now."""
        self.expanded = False
        self.screen.set_focus(self, scroll_visible=False)


ORDERED = (OrderedInput, OrderedSelect, _OrderedOverlay)
