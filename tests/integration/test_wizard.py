"""Pilot walks through the whole wizard on a tiny model with a constructed device backend, for each mode."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from textual.widgets import Button, Input

from tests.wizard_helpers import make_app, text_of, wait_for, worker_processes
from tui.screens.export import ExportScreen
from tui.screens.mode import ModeScreen
from tui.screens.plan import PlanScreen
from tui.screens.setup import SetupScreen
from tui.screens.stages import EvaluateScreen, ProbeScreen, ResumeScreen


def next_enabled(app) -> bool:
    return not app.screen.query_one("#next", Button).disabled


async def walk_to_plan(pilot, app, mode_key: str) -> None:
    await pilot.press(mode_key, "enter")
    assert isinstance(app.screen, SetupScreen)
    await pilot.press("ctrl+n")
    assert isinstance(app.screen, PlanScreen)
    await wait_for(pilot, lambda: next_enabled(app), 60)


async def run_stage(pilot, app, screen_type) -> None:
    await pilot.press("ctrl+n")
    assert isinstance(app.screen, screen_type)
    await wait_for(pilot, lambda: next_enabled(app) and app.state.running is None)


# LoRA's whole walk is tests/integration/test_e2e_embedded.py's (the embedded model, every stage, the record compared
# with the headless run's); what this walk checks besides (Back keeps the sign-off typed, every verdict shown) is the
# same code for every mode
@pytest.mark.parametrize(("mode", "key"), [("full", "2"), ("inference", "1")])
async def test_walk_the_whole_wizard(tiny_model_dir, tmp_path, mode, key):
    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        assert isinstance(app.screen, ModeScreen)
        await walk_to_plan(pilot, app, key)
        assert app.state.spec.mode == mode
        await run_stage(pilot, app, ProbeScreen)
        assert "PASS" in text_of(app.screen.query_one("#measured-title"))
        await run_stage(pilot, app, EvaluateScreen)
        assert "PASS" in text_of(app.screen.query_one("#eval-result"))
        await run_stage(pilot, app, ResumeScreen)
        verdict = text_of(app.screen.query_one("#resume-verdict"))
        assert ("NOT APPLICABLE" in verdict) if mode == "inference" else ("PASS" in verdict), verdict
        await pilot.press("ctrl+n")
        assert isinstance(app.screen, ExportScreen)
        await pilot.press(*"Ada")
        app.screen.query_one("#decision").value = "accept"
        await pilot.press("escape", "ctrl+n")  # back and again: what was typed is kept (issue 17)
        assert isinstance(app.screen, ExportScreen)
        assert app.screen.query_one("#operator", Input).value == "Ada"
        assert app.screen.query_one("#decision").value == "accept"
        app.screen.query_one("#comment", Input).value = "tiny model walk"
        shown = text_of(app.screen.query_one("#verdicts"))
        await pilot.click("#write")
        await wait_for(pilot, lambda: app.state.record_path is not None
                       and "record written" in text_of(app.screen.query_one("#written")), 30)
        assert "record written, UNSIGNED:" in text_of(app.screen.query_one("#written"))
    record = tomllib.loads(Path(app.state.record_path).read_text())
    for stage, item in record["verdict"]["stages"].items():  # the screen said what the record says
        assert f"{stage} {item['status']}: {item['evidence']}" in shown, (stage, item, shown)
    assert record["spec"]["mode"] == mode
    assert record["signoff"]["operator"] == "Ada" and record["signoff"]["decision"] == "accept"
    assert record["verdict"]["status"] == "pass"
    assert record["resume"]["status"] == ("not_applicable" if mode == "inference" else "pass")
    # the plan screen's trace (a real child on the tiny model) reaches the record, even when it finished after the probe
    assert record["plan"]["traced"]["status"] == "estimated", record["plan"]["traced"]


async def test_bad_input_disables_next_and_names_the_field(tiny_model_dir, tmp_path):
    app = make_app(tiny_model_dir, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter")
        screen = app.screen
        screen.query_one("#batch_size", Input).value = "0"
        await pilot.pause()
        assert screen.query_one("#next", Button).disabled
        assert "at least 1" in text_of(screen.query_one("#err-batch_size"))
        screen.query_one("#batch_size", Input).value = "four"
        await pilot.pause()
        assert "whole number" in text_of(screen.query_one("#err-batch_size"))
        await pilot.press("ctrl+n")
        assert app.screen is screen  # refused: still on the setup
        screen.query_one("#batch_size", Input).value = "2"
        await pilot.pause()
        assert not screen.query_one("#next", Button).disabled
        assert not screen.query_one("#err-batch_size").display


async def test_a_sequence_longer_than_the_model_allows_is_named_on_the_setup(tiny_model_dir, tmp_path):
    """Issue 17: found on the next screen before; now beside the field, and Next stays here."""
    app = make_app(tiny_model_dir, tmp_path, seq_len=4096)  # the tiny model declares 256 positions
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter")
        screen = app.screen
        await wait_for(pilot, lambda: screen.query_one("#err-seq_len").display, 30)
        assert "max_position_embeddings (256)" in text_of(screen.query_one("#err-seq_len"))
        assert screen.query_one("#next", Button).disabled
        await pilot.press("ctrl+n")
        assert isinstance(app.screen, SetupScreen)


async def test_back_navigation_and_what_if_keys_replan(tiny_model_dir, tmp_path):
    app = make_app(tiny_model_dir, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await walk_to_plan(pilot, app, "3")
        before = app.state.ctx.plan.devices[0].lines["activations"].bytes
        await pilot.press("B")  # batch x2
        await wait_for(pilot, lambda: app.state.spec.batch_size == 8 and app.state.ctx.plan.devices[0].lines[
            "activations"].bytes > before, 30)
        assert app.state.ctx.plan.devices[0].lines["activations"].bytes > 1.9 * before
        await pilot.press("escape")
        assert isinstance(app.screen, SetupScreen)
        assert app.screen.query_one("#batch_size", Input).value == "8"  # the what-if is kept
        await pilot.press("escape")
        assert isinstance(app.screen, ModeScreen)
        await pilot.press("2", "enter")
        assert isinstance(app.screen, SetupScreen) and app.state.mode == "full"
        assert not app.screen.query("#lora_r")  # LoRA fields only in LoRA mode


async def test_quitting_during_the_probe_ends_its_process_group(tiny_model_dir, tmp_path):
    app = make_app(tiny_model_dir, tmp_path, probe_steps=400, mode="full")
    async with app.run_test(size=(80, 24)) as pilot:
        await walk_to_plan(pilot, app, "2")
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: worker_processes(tmp_path) != [] and app.state.running == "probe", 60)
        await pilot.press("q")
        assert type(app.screen).__name__ == "ConfirmQuit"
        await pilot.press("n")  # stay: the probe keeps running
        assert app.state.running == "probe"
        await pilot.press("q", "y")
        await wait_for(pilot, lambda: app.state.running is None, 30)
        await pilot.pause(0.3)
    assert app.return_value == 130
    assert worker_processes(tmp_path) == []
    record = tomllib.loads(Path(app.state.record_path).read_text())  # what was measured is kept, unsigned
    assert record["verdict"]["status"] == "fail" and record["signoff"]["status"] == "unsigned"
    assert record["verdict"]["stages"]["probe"]["status"] == "cancelled"  # the operator quit; nothing failed


async def test_help_shows_the_terms(tiny_model_dir, tmp_path):
    app = make_app(tiny_model_dir, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        assert type(app.screen).__name__ == "HelpScreen"
        await pilot.press("escape")
        assert isinstance(app.screen, ModeScreen)


async def test_setup_reads_a_trainers_config_file_into_the_form_by_keys(tiny_model_dir, tmp_path):
    """^l From config: a path that is no config is named in the dialog and nothing changes; TRL's QLoRA config turns
    the LoRA Setup into QLoRA's with the config's micro-batch, sequence length and LoRA settings, and says which file
    (its hash) they came from."""
    from tests.paths import TESTS
    from tui.screens.dialogs import ConfigDialog

    app = make_app(tiny_model_dir, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("3", "enter")  # LoRA
        assert isinstance(app.screen, SetupScreen) and "From config" in footer_of(app.screen).values()
        await pilot.press("ctrl+l")
        assert isinstance(app.screen, ConfigDialog)
        await pilot.press(*"README.md", "enter")
        assert isinstance(app.screen, ConfigDialog) and "README.md" in text_of(app.screen.query_one("#config-error"))
        app.screen.query_one("#config-path", Input).value = str(TESTS / "data" / "configs" / "trl_sft_qlora.yaml")
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, SetupScreen) and app.state.mode == "qlora"
        shown = {name: app.screen.query_one(f"#{name}", Input).value for name in ("batch_size", "seq_len", "lora_r")}
        assert shown == {"batch_size": "2", "seq_len": "512", "lora_r": "16"}, shown
        assert "imported from trl config" in text_of(app.screen.query_one("#imported"))


async def test_from_config_asks_for_a_value_the_file_leaves_to_the_data(tiny_model_dir, tmp_path):
    """torchtune's ``tokenizer.max_seq_len: null``: the dialog names the key and asks for the sequence length below
    the path (as --seq-len would give it); typed, Setup gets it and says it came from what was typed."""
    from tests.paths import TESTS
    from tui.screens.dialogs import ConfigDialog

    text = (TESTS / "data" / "configs" / "torchtune_lora.yaml").read_text(encoding="utf-8")
    config = tmp_path / "torchtune.yaml"
    config.write_text(text.replace("MODEL", str(tiny_model_dir)).replace("max_seq_len: 2048", "max_seq_len: null"),
                      encoding="utf-8")
    app = make_app(tiny_model_dir, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("3", "enter", "ctrl+l")
        app.screen.query_one("#config-path", Input).value = str(config)
        await pilot.press("enter")
        assert isinstance(app.screen, ConfigDialog)
        assert "tokenizer.max_seq_len" in text_of(app.screen.query_one("#config-error"))
        value = app.screen.query_one("#config-value", Input)
        assert app.screen.focused is value and "seq_len" in value.placeholder
        await pilot.press("enter")  # nothing typed: said so, the dialog stays
        assert isinstance(app.screen, ConfigDialog) and "type seq_len" in text_of(app.screen.query_one("#config-error"))
        await pilot.press(*"128", "enter")
        await pilot.pause()
        assert isinstance(app.screen, SetupScreen) and app.screen.query_one("#seq_len", Input).value == "128"


async def test_a_planned_only_mode_from_a_config_opens_the_wizard_and_plans(tiny_model_dir, tmp_path):
    """``gpuaccept run their.yaml`` on a config whose method the recipe does not run (axolotl's load_in_8bit: LoRA
    over an 8-bit base) opens on the Mode screen saying so (it raised a KeyError there), and Setup -> Plan plans it,
    with the refusal to run named."""
    from textual.widgets import Static

    def screen_text() -> str:
        return " ".join(text_of(w) for w in app.screen.query(Static))

    app = make_app(tiny_model_dir, tmp_path, mode="lora_int8", objective="dpo")
    async with app.run_test(size=(80, 24)) as pilot:
        assert "planned (Plan), not run by gpuaccept's own recipe" in text_of(app.screen.query_one("#mode-help"))
        await pilot.press("enter")
        assert isinstance(app.screen, SetupScreen)
        await pilot.press("ctrl+n")
        for _ in range(100):
            await pilot.pause(0.1)
            if isinstance(app.screen, PlanScreen) and "objective DPO" in screen_text():
                break
        shown = screen_text()
        assert "objective DPO (preference), reference the model with its adapters disabled" in shown, shown
        assert "not run by gpuaccept's own recipe" in shown


def footer_of(screen) -> dict[str, str]:
    """What the footer offers: key -> description."""
    return {key: b.binding.description for key, b in screen.active_bindings.items() if b.binding.show}
