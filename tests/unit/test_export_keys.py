"""The sign-off screen from the keyboard: every action has a key named in the footer, and quitting never drops a typed
sign-off without asking (issue 34: ^n did nothing, the footer offered only ^q and Esc, and ^q wrote the record
unsigned with the operator and decision typed lost)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path

import pytest

from tests.unit.test_snapshots import app_for, finished_run


@pytest.fixture(autouse=True)
def _in_a_folder_with_the_tiny_model(tmp_path, monkeypatch, tiny_model_dir):
    """The snapshot tests' run names its model "tiny-llama", a folder of the working directory."""
    shutil.copytree(tiny_model_dir, tmp_path / "tiny-llama")
    monkeypatch.chdir(tmp_path)


def _written_run(app, tmp_path: Path):
    """The snapshot tests' finished run, with a ``write_record`` that keeps what it was given."""
    run = finished_run(app)
    run.record_path = None
    run.signed = False
    run.written = []

    def write_record(signoff=None):
        run.written.append(signoff)
        run.record_path = tmp_path / "record.toml"
        run.record_path.write_text(f"# signoff {signoff}\n")
        return run.record_path

    run.write_record = write_record
    return run


def footer_keys(screen) -> dict[str, str]:
    """What the footer offers: key -> description (enabled keys only)."""
    return {key: b.binding.description for key, b in screen.active_bindings.items() if b.enabled and b.binding.show}


async def _type_signoff(pilot, operator: str, decision: str | None) -> None:
    from textual.widgets import Select

    await pilot.press(*operator)
    if decision is not None:
        pilot.app.screen.query_one("#decision", Select).value = decision
    await pilot.pause()


@contextlib.asynccontextmanager
async def export_screen(tmp_path: Path):
    """The wizard on the sign-off screen of a finished run: (app, pilot, run)."""
    from tui.screens.export import ExportScreen

    app = app_for()
    async with app.run_test(size=(80, 24)) as pilot:
        app.state.run = run = _written_run(app, tmp_path)
        await app.push_screen(ExportScreen())
        await pilot.pause()
        yield app, pilot, run


async def _press_and_let_it_quit(pilot, key: str) -> None:
    """Press a key that ends the app: Pilot.press waits for the app to be idle after the key, which an app that exited
    never is, so the press is not awaited; the app's exit is."""
    app = pilot.app
    press = asyncio.ensure_future(pilot.press(key))
    for _ in range(200):
        await asyncio.sleep(0.05)
        if app.return_code is not None:
            break
    press.cancel()


async def test_ctrl_n_writes_the_record_then_opens_the_quiz(tmp_path):

    async with export_screen(tmp_path) as (app, pilot, run):
        keys = footer_keys(app.screen)
        assert keys.get("ctrl+n") == "Write record" and keys.get("ctrl+o") == "Compare runs", keys
        await pilot.press("ctrl+n")  # nothing typed: says what is missing, writes nothing
        await pilot.pause()
        assert run.written == [] and "name the operator" in str(app.screen.query_one("#export-error").content)
        await _type_signoff(pilot, "ada", "accept")
        await pilot.press("ctrl+n")
        for _ in range(50):
            await pilot.pause(0.05)
            if run.written:
                break
        assert [s["operator"] for s in run.written] == ["ada"] and run.written[0]["decision"] == "accept", str(app.screen.query_one("#export-error").content)
        await pilot.pause(0.2)
        assert footer_keys(app.screen).get("ctrl+n") == "Quiz"  # the next thing to do, under the same key
        assert "record written, UNSIGNED" in str(app.screen.query_one("#written").content)


async def test_ctrl_q_with_a_typed_signoff_asks_and_w_writes_it_before_quitting(tmp_path):
    from tui.screens.dialogs import ConfirmDropSignoff
    from tui.screens.export import ExportScreen

    async with export_screen(tmp_path) as (app, pilot, run):
        await _type_signoff(pilot, "grace", "reject")
        await pilot.press("ctrl+q")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmDropSignoff)
        assert "operator grace, decision reject" in str(app.screen.query_one("#drop-text").content)
        await pilot.press("escape")  # stay: nothing written, still on the sign-off
        await pilot.pause()
        assert isinstance(app.screen, ExportScreen) and run.written == []
        await pilot.press("ctrl+q")
        await pilot.pause()
        await _press_and_let_it_quit(pilot, "w")
    assert [(s["operator"], s["decision"]) for s in run.written] == [("grace", "reject")]
    assert app.return_code == 0


async def test_ctrl_q_with_half_a_signoff_offers_no_write_and_d_quits_without_it(tmp_path):
    from tui.screens.dialogs import ConfirmDropSignoff

    async with export_screen(tmp_path) as (app, pilot, run):
        await _type_signoff(pilot, "lin", None)  # an operator, no decision: cannot be written as a sign-off
        await pilot.press("ctrl+q")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmDropSignoff) and not app.screen.query("#write")
        await pilot.press("w")  # not offered: nothing happens
        await pilot.pause()
        assert isinstance(app.screen, ConfirmDropSignoff) and run.written == []
        await _press_and_let_it_quit(pilot, "d")
    assert run.written == [None]  # the record is still written when the wizard ends, unsigned, with no decision


async def test_keys_typed_at_full_speed_through_the_decision_menu_land_where_they_were_meant(tmp_path):
    """Walked in tmux: keys sent in one burst right after Enter chose the decision were lost (the menu still had the
    focus when they came), so the signing key typed after them stayed empty and the record was written unsigned. All
    keys are queued here before the app handles any, as a burst from the terminal is."""
    from textual import events
    from textual.widgets import Input, Select

    from tests.wizard_helpers import wait_for

    async with export_screen(tmp_path) as (app, pilot, run):
        screen = app.screen
        burst = [*"ada", "tab", "tab", "enter", "down", "down", "enter", "tab", "tab", *"/k.pub"]
        for key in burst:
            app.post_message(events.Key(key, key if len(key) == 1 else None))
        await wait_for(pilot, lambda: screen.query_one("#key", Input).value == "/k.pub", 10)
        assert screen.query_one("#operator", Input).value == "ada"
        assert screen.query_one("#decision", Select).value == "reject"  # the menu opens on "choose"
        assert screen.query_one("#comment", Input).value == ""
        assert app.focused is screen.query_one("#key", Input)
