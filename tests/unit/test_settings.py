"""Issue 36, "each setting is declared once": every setting of the spec is declared on its dataclass field
(core/settings.py ``setting``), and its flag, TOML key and table, form field and docs row are made from that one
declaration: none of them is written a second time by hand."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from core.errors import SpecError
from core.methods import METHODS
from core.reference import REFERENCE
from core.settings import (
    FormField,
    markdown_table,
    nest,
    render_docs,
    setting,
    settings_of,
    table,
    unknown_value,
)
from core.spec import RunSpec, by_dest, spec_settings

SETTINGS = spec_settings()

ROOT = Path(__file__).resolve().parents[2]


def _spec_keys() -> list[str]:
    """Every key of the spec, found from the dataclasses alone: a field whose default is a dataclass is a table."""
    spec, keys = RunSpec(), []
    for f in dataclasses.fields(RunSpec):
        value = getattr(spec, f.name)
        if dataclasses.is_dataclass(value):
            keys += [f"{f.name}.{g.name}" for g in dataclasses.fields(value)]
        else:
            keys.append(f.name)
    return keys


def test_every_field_of_the_spec_and_its_tables_has_exactly_one_setting():
    keys = _spec_keys()
    assert Counter(s.key for s in SETTINGS) == Counter(keys)
    assert {"lora.r", "qlora.double_quant", "resume.kill_at", "torchrun.nnodes", "accept.resume_tier"} <= set(keys)
    spec = RunSpec()
    for s in SETTINGS:  # each setting's default is its field's
        assert s.value(spec) == s.default, s.key
        assert s.dest == s.key.replace(".", "_", 1)


def test_a_field_without_a_declaration_is_refused_by_name():
    @dataclass(frozen=True)
    class Undeclared:
        a: int = 1

    with pytest.raises(TypeError, match=r"Undeclared\.a is not declared"):
        settings_of(Undeclared)


# ------------------------------------------------------------------ the CLI
def _subparser(command: str) -> argparse.ArgumentParser:
    from tui.flags import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subs.choices[command]


@pytest.mark.parametrize("command", ["run", "plan"])
def test_every_setting_has_its_flag_as_declared(command):
    actions = {a.dest: a for a in _subparser(command)._actions if a.option_strings}
    for s in SETTINGS:
        action = actions[s.dest]
        negated = [f"--no-{f.removeprefix('--')}" for f in s.flags] if s.kind == "bool" else []
        assert action.option_strings == [*s.flags, *negated], s.key
        assert action.help == s.help.replace("%", "%%")
        assert tuple(action.choices or ()) == s.cli_choices
        assert action.default is None  # not given: the spec file's value or the default stands


def test_the_plan_takes_no_flag_of_the_spec_but_the_settings():
    dests = {a.dest for a in _subparser("plan")._actions if a.option_strings}
    assert dests - {s.dest for s in SETTINGS} == {"help", "json", "traced", "max_batch", "max_seq"}


def test_no_flag_of_a_setting_is_written_in_the_cli_by_hand():
    flags = {f for s in SETTINGS for f in s.flags}
    tree = ast.parse((ROOT / "tui" / "flags.py").read_text(encoding="utf-8"))
    written = {arg.value for node in ast.walk(tree) if isinstance(node, ast.Call)
               and getattr(node.func, "attr", None) == "add_argument"
               for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)}
    assert written, "tui/flags.py adds no argument at all: the check looks at the wrong calls"
    assert written & flags == set()
    assert not written & {"--command", "--resume-command", "--env", "--timeout", "--eval"}  # command mode's too


def test_command_modes_settings_are_declared_once_on_the_command_spec():
    """Command mode's settings were declared four times (CommandSpec's fields, a type table, the flags and the form);
    each is now one declared field: its flag (or the recipe's flag of the same meaning), its type check and its form
    field follow from it."""
    from core.commandspec import COMMAND_SETTINGS, SETTING_TYPES, CommandSpec
    from tui.flags import SHARED_WITH_COMMAND, build_parser, command_spec_from_args
    from tui.screens.command import FIELDS

    names = [f.name for f in dataclasses.fields(CommandSpec)]
    assert [s.name for s in COMMAND_SETTINGS] == names == list(SETTING_TYPES)
    own = {s.name for s in COMMAND_SETTINGS if s.flags}
    assert own.isdisjoint(SHARED_WITH_COMMAND.values()) and own | set(SHARED_WITH_COMMAND.values()) == set(names)
    assert [f[0] for f in FIELDS][:2] == ["train", "resume"] and "kill_after_checkpoint" in [f[0] for f in FIELDS]
    assert SETTING_TYPES["timeout_s"][0](1) and not SETTING_TYPES["timeout_s"][0](True)
    assert SETTING_TYPES["env"][1] == "a table of strings" and not SETTING_TYPES["checkpoint_files"][0]([1])
    args = build_parser().parse_args(
        ["run", "--command", "python -c pass {out}", "--resume-command", "{command} --from {checkpoint}", "--env",
         "A=1", "--env", "B=x", "--checkpoint-files", "a.pt, b.pt", "--timeout", "5", "--eval-seq-len", "64",
         "--kill-after-checkpoint", "2"])
    spec = command_spec_from_args(args)
    assert (spec.env, spec.checkpoint_files, spec.timeout_s, spec.eval_seq_len, spec.kill_after_checkpoint) == (
        {"A": "1", "B": "x"}, ("a.pt", "b.pt"), 5.0, 64, 2)


def test_the_old_spellings_and_aliases_still_parse_into_the_spec():
    from tui.flags import build_parser, spec_from_args

    args = build_parser().parse_args(
        ["plan", "--lr", "0.01", "--nproc", "2", "--quant-type", "fp4", "--no-double-quant", "--max-step-time", "2.5",
         "--max-plan-error", "10", "--strategy", "fsdp", "--lora-r", "4", "--kill-at", "boundary",
         "--no-resume-check", "--resume-noise", "twin", "--resume-tier", "exact", "--max-perplexity", "40"])
    assert (args.learning_rate, args.torchrun_nproc_per_node, args.qlora_quant_type, args.qlora_double_quant) == \
        (0.01, 2, "fp4", False)
    assert (args.accept_max_step_time_s, args.accept_max_plan_error_pct, args.strategy) == (2.5, 10.0, "fsdp")
    assert (args.resume_check, args.resume_noise, args.resume_kill_at) == (False, "twin", "boundary")
    spec = spec_from_args(build_parser().parse_args(
        ["plan", "--mode", "qlora", "--quant-type", "fp4", "--no-double-quant", "--lora-r", "4", "--lr", "0.01",
         "--max-step-time", "2.5", "--resume-tier", "exact"]))
    assert (spec.qlora.quant_type, spec.qlora.double_quant, spec.lora.r, spec.learning_rate) == (
        "fp4", False, 4, 0.01)
    assert (spec.accept.max_step_time_s, spec.accept.resume_tier) == (2.5, "exact")
    spec = spec_from_args(build_parser().parse_args(["plan", "--devices", "cpu", "--strategy", "fsdp", "--nproc", "2",
                                                     "--no-resume-check"]))
    assert (spec.strategy, spec.torchrun.nproc_per_node, spec.resume.check) == ("zero3", 2, False)


def test_the_flags_command_mode_shares_are_its_keys():
    from core.commandspec import CommandSpec
    from tui.flags import SHARED_WITH_COMMAND

    assert SHARED_WITH_COMMAND["resume_kill_after_checkpoint"] == "kill_after_checkpoint"
    assert set(SHARED_WITH_COMMAND) >= {"model", "data", "dtype", "resume_check", "resume_noise"}
    assert set(SHARED_WITH_COMMAND.values()) <= {f.name for f in dataclasses.fields(CommandSpec)}


# ------------------------------------------------------------------ the spec: TOML keys, tables, choices, defaults
def test_each_flat_keyword_goes_to_its_table():
    for s in SETTINGS:
        assert nest({s.dest: 1}, SETTINGS) == ({s.table: {s.name: 1}} if s.table else {s.name: 1})
    spec = RunSpec.build(lora_alpha=32, resume_compare_steps=10, torchrun_rdzv_id="job-7", accept_min_accuracy=0.25)
    assert (spec.lora.alpha, spec.resume.compare_steps, spec.torchrun.rdzv_id, spec.accept.min_accuracy) == \
        (32, 10, "job-7", 0.25)
    with pytest.raises(SpecError) as err:
        RunSpec.build(lora_bogus=1)
    assert err.value.field == "lora.bogus"


@pytest.mark.parametrize(("key", "table_name"), [("nnodes", "torchrun"), ("double_quant", "qlora"),
                                                 ("kill_at", "resume"), ("min_accuracy", "accept")])
def test_a_tables_key_at_the_top_is_named_with_its_table(key, table_name):
    with pytest.raises(SpecError, match=rf"{key} belongs in the \[{table_name}\] table"):
        RunSpec.from_dict({key: 1})


def test_a_value_outside_a_literal_is_refused_where_no_check_of_its_own_runs():
    # inference runs no resume check, so only the settings' own choices refuse this
    with pytest.raises(SpecError) as err:
        RunSpec.build(mode="inference", resume_interrupted_from="middle")
    assert (err.value.field, err.value.message) == ("resume.interrupted_from", "'middle' is not one of checkpoint, start")


def test_the_mode_dependent_defaults_are_the_methods():
    assert {s.key for s in SETTINGS if s.mode_default} == {"steps", "learning_rate", "resume.checkpoint_every",
                                                           "resume.kill_after_checkpoint"}
    full = RunSpec.build(mode="full")
    assert (full.steps, full.learning_rate, full.resume.checkpoint_every) == \
        (METHODS["full"].steps, METHODS["full"].learning_rate, METHODS["full"].checkpoint_every)
    assert RunSpec.build(mode="full", steps=20).steps == 20


# ------------------------------------------------------------------ the Setup form
def test_the_setup_form_is_made_from_the_settings():
    from tui.screens.setup import FIELDS, FIRST_CRITERION, current_value, spec_field_to_input

    on_form = sorted((s for s in SETTINGS if s.form is not None), key=lambda s: s.form_order or 0)
    assert FIELDS == [s.form for s in on_form]
    assert [f.name for f in FIELDS[:3]] == ["model", "data", "dtype"]
    kinds = {f.name: (f.kind, f.choices) for f in FIELDS}
    assert kinds["gradient_checkpointing"] == ("choice", ("off", "on"))  # a boolean: its default first
    assert kinds["qlora_double_quant"] == ("choice", ("on", "off"))
    assert kinds["strategy"] == ("choice", ("single", "ddp", "zero3"))
    assert kinds["resume_compare_steps"] == ("autoint", ())
    assert kinds["accept_max_perplexity"] == ("optfloat", ())
    assert kinds["lora_targets"] == ("str", ())
    assert FIRST_CRITERION == "accept_max_perplexity"
    spec = RunSpec.build(lora_r=4, accept_max_perplexity=30.0, resume_kill_at="boundary")
    assert [current_value(spec, n) for n in ("lora_r", "accept_max_perplexity", "accept_min_accuracy",
                                             "resume_kill_at", "gradient_checkpointing", "lora_targets")] == \
        ["4", "30.0", "", "boundary", "off", "q_proj,v_proj"]
    assert [spec_field_to_input(f) for f in ("lora.r", "torchrun.nproc_per_node", "accept.max_step_time_s",
                                              "lora.dropout", "spec", "seq_len")] == \
        ["lora_r", "torchrun_nproc_per_node", "accept_max_step_time_s", "lora.dropout", "spec", "seq_len"]


def test_the_wizard_is_prefilled_with_what_a_spec_file_sets_in_its_tables_too(tmp_path, monkeypatch):
    from tests.wizard_helpers import wizard_opened_with

    path = tmp_path / "spec.toml"
    path.write_text("seq_len = 64\n[lora]\nr = 4\n[resume]\nkill_at = \"boundary\"\n[accept]\nmax_perplexity = 30.0\n",
                    encoding="utf-8")
    seen = wizard_opened_with(monkeypatch, ["run", str(path), "--batch-size", "2"])
    assert seen["fields"] == {"seq_len": 64, "lora_r": 4, "resume_kill_at": "boundary", "accept_max_perplexity": 30.0,
                              "batch_size": 2}


# ------------------------------------------------------------------ a setting added: one field, and nothing else
Flavour = Literal["plain", "spicy"]


@dataclass(frozen=True)
class ToyTable:
    depth: int = setting(2, help="how deep", label="Depth", form_order=20)


@dataclass(frozen=True)
class Toy:
    widgets: int = setting(3, help="how many widgets", label="Widgets", form_order=10)
    flavour: Flavour = setting("plain", help="the taste", value_aliases={"mild": "plain"})
    sub: ToyTable = table(ToyTable, flag_prefix="toy-", group="training")


def test_a_setting_added_to_a_dataclass_gets_a_flag_a_toml_key_a_form_field_and_a_docs_row():
    from tui.flags import add_setting_flags
    from tui.screens.setup import form_fields

    settings = settings_of(Toy)
    assert [(s.key, s.dest, s.flags) for s in settings] == [
        ("widgets", "widgets", ("--widgets",)), ("flavour", "flavour", ("--flavour",)),
        ("sub.depth", "sub_depth", ("--toy-depth",))]
    parser = argparse.ArgumentParser()
    add_setting_flags(parser, settings)
    args = parser.parse_args(["--widgets", "5", "--flavour", "mild", "--toy-depth", "7"])
    assert (args.widgets, args.flavour, args.sub_depth) == (5, "mild", 7)
    with pytest.raises(SystemExit):
        parser.parse_args(["--flavour", "sweet"])
    assert nest(vars(args), settings) == {"widgets": 5, "flavour": "mild", "sub": {"depth": 7}}
    assert form_fields(settings) == [FormField("widgets", "Widgets", "int", (), "all"),
                                     FormField("sub_depth", "Depth", "int", (), "training")]
    assert unknown_value(Toy(flavour="sweet"), settings) == (settings[1], "sweet")  # type: ignore[arg-type]
    assert unknown_value(Toy(), settings) is None
    rows = markdown_table("settings", settings)
    assert "| `sub.depth` | `--toy-depth` | integer | `2` | how deep |" in rows
    assert "| `flavour` | `--flavour` | `plain` (or `mild`), `spicy` | `\"plain\"` | the taste |" in rows


def test_a_declaration_that_cannot_work_is_refused():
    with pytest.raises(ValueError, match="form_order"):
        setting(1, help="x", label="X")
    with pytest.raises(ValueError, match="group"):
        setting(1, help="x", group="sometimes")
    with pytest.raises(ValueError, match="flags start with --"):
        setting(1, help="x", flag="-x")


# ------------------------------------------------------------------ the docs
def test_the_reference_tables_are_the_settings():
    text = REFERENCE.read_text(encoding="utf-8")
    assert render_docs(text, SETTINGS) == text, ("docs/reference.md's generated tables differ from the settings' declarations: "
                                       "run `.venv/bin/python -m core.reference --update-docs`")
    for s in SETTINGS:  # every setting is a row of one of them, with its main flag
        assert f"`{s.key if s.doc_table == 'settings' else s.name}`" in text and f"`{s.flags[0]}`" in text


def test_a_table_edited_by_hand_is_made_again():
    text = REFERENCE.read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| `lora.r` |"))
    edited = text.replace(row, row.replace("`8`", "`16`"))
    assert edited != text and render_docs(edited, SETTINGS) == text
    with pytest.raises(ValueError, match="no generated table"):
        render_docs("# nothing generated here\n", SETTINGS)
    assert by_dest()["accept_max_plan_error_pct"].doc.startswith("per device, |planned")
    assert "per device, \\|planned" in markdown_table("criteria", SETTINGS)  # a | in a cell is escaped
