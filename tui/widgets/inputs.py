"""Text inputs whose keys take effect in the order they were typed."""

from __future__ import annotations

from textual import events
from textual.widgets import Input


class OrderedInput(Input):
    """:class:`textual.widgets.Input` that runs a bound key (Ctrl+U, Backspace, Tab, Ctrl+N) when it arrives.

    Textual inserts printable characters as soon as the focused Input gets them, but resolves bound keys only when the
    key has bubbled up to the App, a few messages later. Typed fast (a paste over SSH without bracketed paste, tmux
    ``send-keys``, a keyboard macro) "Ctrl+U then a path" cleared the path typed after it, and characters typed after
    Tab landed in the field being left. This is Textual issue 6605 (open; PR 6631 runs the Input's own bindings
    inline). Here every binding of the chain is resolved inline, as the App would resolve it, and the key is then
    stopped so it is not handled twice; a key that reaches this input after a key before it moved the focus (the App
    had already forwarded it here) goes on to the widget that has the focus now. Shape: a drop-in for ``Input``;
    raises nothing of its own.
    """

    async def _on_key(self, event: events.Key) -> None:
        focused = self.screen.focused
        if focused is not None and focused is not self:  # a key before this one (Tab, Enter) moved the focus
            event.stop()
            event.prevent_default()
            if isinstance(focused, OrderedInput) or event.is_printable:
                focused.post_message(events.Key(event.key, event.character))  # after what it was already sent
            else:
                await self.app._check_bindings(event.key)  # noqa: SLF001 - resolved from the focused widget, now
            return
        if not event.is_printable and await self.app._check_bindings(event.key):  # noqa: SLF001 - see the docstring
            event.stop()
            event.prevent_default()
            return
        await super()._on_key(event)
