"""Issue 36: one facade. The wizard and the CLI call core's use cases through core.api (plan, plan_report, trace,
search, run, verify, diff, sign, the quiz, the monitor) and otherwise hold only core's vocabulary; an import contract
(pyproject.toml, ``tui-through-api``) forbids tui the rest of core.

What is checked here: importing core.api imports nothing heavy; each re-exported name is its home's; the contract names
every module of core that is not the facade or the vocabulary (so a new module is not allowed by default), and tui's
imports keep to it; no module of core imports the facade; and each use case does what the front ends assembled
themselves before (``gpuaccept plan``'s fit, trace and search), on the tiny model.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import core.api as api
from core.plan.devices import DeviceInfo
from core.spec import RunSpec
from tests.paths import RECORDS, REPO

GiB = 2**30

#: what tui may import of core besides core.api: the modules that declare what a run is and what it says (the spec,
#: its devices and settings, the training methods, the kill points, the errors, the events, the statuses)
VOCABULARY = {"core.spec", "core.spectables", "core.specparse", "core.specdraft", "core.devicespec", "core.settings", "core.methods", "core.optim", "core.objectives", "core.losses",
              "core.killpoints", "core.errors", "core.events", "core.status"}
ALLOWED = VOCABULARY | {"core.api"}


def _contract() -> dict:
    data = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    (contract,) = [c for c in data["tool"]["importlinter"]["contracts"] if c.get("id") == "tui-through-api"]
    return contract


def _core_modules() -> set[str]:
    """Every top-level module and package of core (``core.x``)."""
    root = REPO / "core"
    return {f"core.{p.stem}" for p in root.glob("*.py") if p.stem != "__init__"} | \
        {f"core.{p.name}" for p in root.iterdir() if (p / "__init__.py").is_file()}


def _imports_of_core(path: Path) -> set[str]:
    """The modules of core that ``path`` imports, at any depth (those inside functions and TYPE_CHECKING too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "core":
                found |= {f"core.{a.name}" for a in node.names}
            elif node.module.startswith("core."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("core.")}
    return found


# ------------------------------------------------------------------------------------------------ the facade itself
def test_importing_the_facade_imports_neither_torch_nor_transformers_nor_a_stage():
    code = ("import sys, core.api; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', "
            "'textual') or m.startswith(('core.pipeline', 'core.plan', 'core.record', 'core.stages', 'core.command'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.strip() == "[]"


def test_each_reexported_name_is_its_homes_and_an_unknown_name_is_an_attribute_error():
    import importlib

    for name, home in api.REEXPORTED.items():
        assert getattr(api, name) is getattr(importlib.import_module(home), name), name
        assert name in api.__all__ and name in dir(api)
    with pytest.raises(AttributeError, match="no attribute 'make_plan'"):
        api.make_plan  # noqa: B018 - not re-exported: the facade's use case is api.plan


def test_every_use_case_is_documented_and_typed():
    for name in api.__all__:
        if name in api.REEXPORTED or name == "REEXPORTED":
            continue
        obj = getattr(api, name)
        assert inspect.getdoc(obj), name
        if inspect.isfunction(obj):
            sig = inspect.signature(obj)
            assert sig.return_annotation is not inspect.Signature.empty, name
            assert all(p.annotation is not inspect.Parameter.empty for p in sig.parameters.values()), name


# -------------------------------------------------------------------------------------------------------- the contract
def test_the_contract_forbids_tui_every_module_of_core_but_the_facade_and_the_vocabulary():
    contract = _contract()
    assert contract["type"] == "forbidden" and contract["source_modules"] == ["tui"]
    assert contract.get("allow_indirect_imports") is True  # core.api itself imports them
    forbidden = set(contract["forbidden_modules"])
    assert not forbidden & ALLOWED
    unlisted = _core_modules() - forbidden - ALLOWED
    assert not unlisted, (f"a module of core that is neither forbidden to tui nor the facade or its vocabulary: "
                          f"{sorted(unlisted)}; add it to the contract tui-through-api in pyproject.toml")


def test_tui_imports_of_core_keep_to_the_facade_and_the_vocabulary():
    stray = {f"{p.relative_to(REPO)}: {m}" for p in sorted((REPO / "tui").rglob("*.py")) for m in _imports_of_core(p)
             if not any(m == a or m.startswith(a + ".") for a in ALLOWED)}
    assert not stray, sorted(stray)


def test_no_module_of_core_imports_the_facade():
    """The facade is the front ends' way in: core's own modules call each other, never it (no cycle through it)."""
    users = sorted(str(p.relative_to(REPO)) for p in (REPO / "core").rglob("*.py")
                   if p.name != "api.py" and "core.api" in _imports_of_core(p))
    assert users == []


# ------------------------------------------------------------------------------------------------------------ plan
def _box(capacity: int = 1 * GiB) -> list[DeviceInfo]:
    return [DeviceInfo("cuda:0", "cuda", "planned box", capacity, "given")]


def test_plan_report_agrees_with_the_plan_fit_and_search_made_apart(tiny_model_dir):
    from core.plan.fit import fit_verdicts
    from core.plan.search import largest_fitting
    from core.prerun import make_plan

    spec = RunSpec.build(model=str(tiny_model_dir), mode="full", seq_len=64)
    box = _box(64 * GiB)  # the sequence length stops at the model's limit, not the capacity
    report = api.plan_report(spec, max_batch=True, max_seq=True, devices_override=box)
    ctx = make_plan(spec, box)
    assert report.plan.to_json() == ctx.plan.to_json() and report.ctx.devices == ctx.devices
    assert report.traced is None and report.fits == fit_verdicts(ctx.plan)
    assert list(report.largest) == ["batch_size", "seq_len"]
    assert report.largest["batch_size"] == largest_fitting(spec, ctx.config, ctx.devices, "batch_size")
    assert report.largest["seq_len"] == largest_fitting(spec, ctx.config, ctx.devices, "seq_len", 256)
    assert report.largest["seq_len"][0].limit == "the model's max_position_embeddings (256)"
    assert report.all_fit and not report.fit_unknown
    assert api.search(spec, report.ctx, "batch_size") == report.largest["batch_size"]
    assert api.plan_report(spec, devices_override=box).largest == {}


def test_plan_report_is_what_gpuaccept_plan_prints(tiny_model_dir, capsys):
    from tui.cli import main

    flags = ["--model", str(tiny_model_dir), "--mode", "full", "--devices", "1MiB", "--max-batch"]
    assert main(["plan", "--json", *flags]) == 3  # does not fit
    printed = json.loads(capsys.readouterr().out)
    spec = RunSpec.build(model=str(tiny_model_dir), mode="full", devices="1MiB")
    report = api.plan_report(spec, max_batch=True)
    assert not report.all_fit and printed == json.loads(json.dumps(report.to_json()))
    assert printed["devices"][0]["fits"] is False and printed["largest_fitting"]["batch_size"][0]["value"] == 0
    unknown = dataclasses.replace(_box()[0], capacity_bytes=None, capacity_source="unknown here")
    assert api.plan_report(spec, devices_override=[unknown]).fit_unknown


def test_an_untraceable_spec_has_its_reason_and_a_traceable_one_is_judged_by_its_trace(tiny_model_dir):
    sharded = RunSpec.build(model=str(tiny_model_dir), mode="lora", devices="2x1GiB", strategy="zero3")
    report = api.plan_report(sharded, traced=True)
    assert report.traced == {"status": "not_run", "reason": report.traced["reason"]}
    assert "zero3 is planned analytically only" in report.traced["reason"]
    assert all(f.judged_by == "analytic" for f in report.fits)

    single = RunSpec.build(model=str(tiny_model_dir), mode="lora", seq_len=32, devices="1GiB")
    traced = api.plan_report(single, traced=True)
    assert traced.traced["status"] == "estimated" and traced.traced["compared_with"] == "cuda:0"
    (fit,) = traced.fits
    assert fit.traced_bytes is not None and fit.tensor_bytes == max(fit.analytic_bytes, fit.traced_bytes)
    # on a CUDA device the caching allocator's predicted reserved (+ the overhead line) is judged too: NVML's used
    memory = traced.traced["device_memory"]
    overhead = traced.plan.devices[0].lines["overhead"].bytes
    assert fit.device_bytes == memory["reserved_bytes"] + overhead == memory["nvml_used_bytes"]
    assert memory["reserved_bytes"] >= memory["allocated_bytes"] and fit.bytes == max(fit.tensor_bytes,
                                                                                       fit.device_bytes)
    assert fit.judged_by == "reserved" and "predicted NVML used" in fit.untraced_note
    assert traced.to_json()["traced"] == traced.traced


def test_check_inputs_and_runnable_reason(tiny_model_dir):
    spec = RunSpec.build(model=str(tiny_model_dir), seq_len=64)
    checked = api.check_inputs(spec)
    assert checked.ok and checked.max_positions == 256 and checked.documents
    missing = api.check_inputs(RunSpec.build(model=str(tiny_model_dir / "nowhere")))
    assert [field for field, _ in missing.problems] == ["model"]
    host = [DeviceInfo("cpu", "cpu", "test host", 64 * GiB, "constructed for tests")]
    assert api.runnable_reason(spec, api.plan(spec, host)) is None
    planned = RunSpec.build(model=str(tiny_model_dir), devices="8x80GiB", strategy="ddp")
    assert api.runnable_reason(planned, api.plan(planned)) is not None  # a box planned for, not this one


# ---------------------------------------------------------------------------------------------------- run (lazily)
def test_run_and_run_command_are_event_generators_that_do_nothing_until_consumed(tmp_path):
    from core.api import CommandSpec

    events = api.run(RunSpec.build(), tmp_path / "runs")
    command = api.run_command(CommandSpec.from_dict({"train": "python train.py --output_dir {out}"}),
                              tmp_path / "command-runs")
    assert inspect.isgenerator(events) and inspect.isgenerator(command)
    events.close()
    command.close()
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------------------- records
def test_read_verify_diff_and_the_folder(tmp_path):
    from core.record.diff import compare
    from core.record.verify import verify

    for name in ("lora", "full"):
        (tmp_path / name).mkdir()
        shutil.copy(RECORDS / f"{name}.toml", tmp_path / name / "record.toml")
    lora, full = tmp_path / "lora" / "record.toml", tmp_path / "full" / "record.toml"
    assert api.read_record(lora) == tomllib.loads(lora.read_text(encoding="utf-8"))
    assert api.verify(lora).exit_code == verify(lora).exit_code
    rows = api.verify_folder(tmp_path)
    assert sorted(Path(r["record"]).parent.name for r in rows) == ["full", "lora"]
    assert api.diff([lora, full]).to_json() == compare([lora, full]).to_json()
    (tmp_path / "deep.toml").write_text("a = " + "[" * 100 + "]" * 100 + "\n")
    with pytest.raises(ValueError):
        api.read_record(tmp_path / "deep.toml")  # nesting beyond core.bounds' limit


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="OpenSSH's ssh-keygen is needed")
def test_sign_record_and_sign(tmp_path):
    key = tmp_path / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ada@box", "-f", str(key)], check=True)
    first, second = tmp_path / "a.toml", tmp_path / "b.toml"
    for path in (first, second):
        shutil.copy(RECORDS / "lora.toml", path)
    signoff = api.make_signoff("Ada", "accept")
    assert api.sign_record(first, key, signoff) == api.signature_path(first)
    assert api.read_record(first)["signoff"]["operator"] == "Ada"
    assert api.sign(second, key) == api.signature_path(second) and api.signature_path(second).is_file()
    assert api.verify(second).exit_code == 7  # signed, consistent, signer not checked
    with pytest.raises(api.SigningError):
        api.sign(second, key)  # a signature is never overwritten


# -------------------------------------------------------------------------------------------------------------- quiz
def test_the_quiz_answers_go_into_the_record(tmp_path):
    path = tmp_path / "record.toml"
    shutil.copy(RECORDS / "lora.toml", path)
    questions = api.build_quiz(api.read_record(path))
    chosen = [q.answer for q in questions]
    table, written = api.add_quiz_answers(path, questions, chosen, "Ada")
    assert written == path and table["score"] == table["questions_asked"] == len(questions)
    assert table["time_utc"].tzinfo is not None
    (attempt,) = api.read_record(path)["onboarding"]
    assert attempt["operator"] == "Ada" and attempt["score"] == len(questions)
