"""Issue 35, item 6: no sign-off that contradicts its verdict.

``gpuaccept sign --decision accept`` on a record whose verdict is not pass (a stage fail, error, cancelled or not_run)
is refused, exit 2, naming the stages and ``--override "reason"``; with the reason it is signed, the reason and the
stages it overrode kept in the record's sign-off (``override``, ``overridden``), and ``verify`` (text and ``--json``)
and ``diff`` show them. A reject needs no override. The wizard's sign-off screen and the runs' ``write_record`` apply
the same rule (:func:`core.record.signoff.checked_signoff`).

The failing records are the committed passing record (tests/records.py) with what the pipeline writes when a stage
ends otherwise: the resume cancelled (its table ``not_run``, its stage ``cancelled``), or the loss diverged (the
evaluation fails); ``verify`` finds each consistent (exit 3) before anything is signed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomli_w

from core.record.verify import EXIT_SCHEMA, EXIT_SIGNER_NOT_CHECKED, EXIT_UNSIGNED
from tests.records import committed
from tui.cli import main

pytestmark = pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="OpenSSH's ssh-keygen is needed")

REASON = "the resume check was cancelled by a hang-up; a rerun is booked for Monday"


def resume_cancelled(data: dict) -> None:
    """What the pipeline writes when the resume check is cancelled (core.record.build: ``_resume_table(None)`` and
    the stage's ``Stopped`` status as its verdict)."""
    data["resume"] = {"status": "not_run", "provenance": "not_run"}
    data["verdict"]["stages"]["resume"] = {"status": "cancelled",
                                           "evidence": "cancelled: the operator quit during the resume check"}
    data["verdict"]["status"] = "fail"


def loss_diverged(data: dict) -> None:
    """What the pipeline writes for a run whose loss went to nan: the evaluation fails."""
    data["evaluation"]["after"].update(perplexity="nan", mean_nll="nan")
    data["evaluation"]["status"] = "fail"
    data["verdict"]["stages"]["evaluation"]["status"] = "fail"
    data["verdict"]["stages"]["evaluation"]["criteria"][0].update(value="nan", met=False)
    data["verdict"]["status"] = "fail"


FAILING = {"resume-cancelled": (resume_cancelled, ["resume"], "resume cancelled"),
           "evaluation-fail": (loss_diverged, ["evaluation"], "evaluation fail")}


def write(path: Path, change=None) -> Path:
    data = committed("lora")
    if change is not None:
        change(data)
    path.write_text(tomli_w.dumps(data))
    return path


@pytest.fixture
def failing(tmp_path, capsys) -> Path:
    """The record of a run whose resume check was cancelled; verify finds it consistent and unsigned."""
    (tmp_path / "failing").mkdir()
    path = write(tmp_path / "failing" / "record.toml", resume_cancelled)
    assert main(["verify", str(path)]) == EXIT_UNSIGNED, capsys.readouterr().out
    capsys.readouterr()
    return path


@pytest.fixture(scope="module")
def key(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "grace"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "grace@box", "-f", str(path)], check=True)
    return path


def sign(record: Path, key: Path, *extra: str) -> int:
    return main(["sign", str(record), "--key", str(key), "--operator", "Grace", *extra])


@pytest.mark.parametrize("case", FAILING, ids=list(FAILING))
def test_accept_of_a_record_that_did_not_pass_is_refused_without_a_reason(case, tmp_path, key, capsys):
    change, _, said = FAILING[case]
    record = write(tmp_path / "record.toml", change)
    assert main(["verify", str(record)]) == EXIT_UNSIGNED  # consistent: a failed run, honestly recorded
    capsys.readouterr()
    before = record.read_bytes()
    assert sign(record, key, "--decision", "accept") == 2
    err = capsys.readouterr().err
    assert f"refused: the decision is accept, but the verdict is FAIL ({said})" in err, err
    assert '--override "reason" signs it anyway' in err and "--decision reject" in err
    assert record.read_bytes() == before and not record.with_name("record.toml.sig").exists()


def test_an_override_signs_it_and_verify_names_the_override_and_its_reason(failing, key, capsys):
    assert sign(failing, key, "--decision", "accept", "--override", REASON) == 0, capsys.readouterr().err
    capsys.readouterr()
    signoff = tomllib.loads(failing.read_text())["signoff"]
    assert (signoff["decision"], signoff["override"], signoff["overridden"]) == ("accept", REASON, ["resume"])
    assert main(["verify", str(failing)]) == EXIT_SIGNER_NOT_CHECKED  # schema valid, verdicts follow, signed
    out = capsys.readouterr().out
    assert "schema: ok" in out
    assert f"sign-off: OVERRIDE by Grace: accepted although resume did not pass; reason: {REASON!r}" in out, out
    assert main(["verify", "--json", str(failing)]) == EXIT_SIGNER_NOT_CHECKED
    summary = json.loads(capsys.readouterr().out)
    assert summary["signoff"]["decision"] == "accept"
    assert summary["signoff"]["override"] == {"reason": REASON, "overridden": ["resume"]}


def test_diff_shows_the_override_beside_a_record_without_one(failing, key, tmp_path, capsys):
    passing = write(tmp_path / "passing.toml")
    assert sign(failing, key, "--decision", "accept", "--override", REASON) == 0
    capsys.readouterr()
    assert main(["diff", str(passing), str(failing)]) == 0
    out = capsys.readouterr().out
    assert "\nsignoff\n" in out and "* override            - | the resume check was cancelled by a h..." in out, out
    assert "* overridden          - | resume" in out
    assert main(["diff", "--json", str(passing), str(failing)]) == 0
    rows = {(r["section"], r["name"]): r["values"] for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows[("signoff", "override")] == [None, REASON]
    assert rows[("signoff", "overridden")] == [None, ["resume"]]
    assert rows[("signoff", "decision")] == ["unsigned", "accept"]


def test_a_reject_needs_no_override_and_an_override_goes_only_with_an_accept_of_a_failing_verdict(
        failing, key, tmp_path, capsys):
    passing = write(tmp_path / "passing.toml")
    assert sign(failing, key, "--decision", "reject", "--override", REASON) == 2
    assert "--override goes with --decision accept" in capsys.readouterr().err
    assert sign(failing, key, "--decision", "accept", "--override", "   ") == 2
    assert "--override is empty" in capsys.readouterr().err
    assert sign(passing, key, "--decision", "accept", "--override", REASON) == 2
    assert "the verdict is PASS, there is nothing to override" in capsys.readouterr().err
    assert not failing.with_name("record.toml.sig").exists() and not passing.with_name("passing.toml.sig").exists()
    assert sign(failing, key, "--decision", "reject", "--comment", "the resume must pass") == 0
    signoff = tomllib.loads(failing.read_text())["signoff"]
    assert signoff["decision"] == "reject" and "override" not in signoff and "overridden" not in signoff


@pytest.mark.parametrize(("change", "says"), [
    (lambda so: so.update(overridden=["plan"]), "signoff.overridden is ['plan']; the stages that did not pass are "
                                                "['resume']"),
    (lambda so: so.update(override=""), "signoff.override is ''; the operator's reason"),
    (lambda so: so.update(decision="reject"), "signoff.override goes with the decision accept, not 'reject'"),
    (lambda so: so.update(override=7), "signoff.override is 7, not a string"),
])
def test_an_override_that_does_not_match_its_record_is_a_schema_finding(failing, change, says, capsys):
    data = tomllib.loads(failing.read_text())
    data["signoff"] = {"operator": "Grace", "role": "", "decision": "accept", "comment": "", "override": REASON,
                       "overridden": ["resume"], "time_utc": committed("lora")["created_utc"]}
    failing.write_text(tomli_w.dumps(data))
    assert main(["verify", str(failing)]) == EXIT_UNSIGNED, capsys.readouterr().out  # a right override conforms
    capsys.readouterr()
    change(data["signoff"])
    failing.write_text(tomli_w.dumps(data))
    assert main(["verify", str(failing)]) == EXIT_SCHEMA
    assert says in capsys.readouterr().out


def test_an_override_on_a_record_that_passed_is_a_schema_finding(tmp_path, capsys):
    data = committed("lora")
    data["signoff"] = {"operator": "Grace", "role": "", "decision": "accept", "comment": "", "override": REASON,
                       "overridden": [], "time_utc": data["created_utc"]}
    record = tmp_path / "record.toml"
    record.write_text(tomli_w.dumps(data))
    assert main(["verify", str(record)]) == EXIT_SCHEMA
    assert "signoff.override overrides nothing: the verdict is pass" in capsys.readouterr().out


def test_the_runs_write_record_refuses_an_accept_without_a_reason(tmp_path):
    """The wizard writes its sign-off through the run's ``write_record``: the same rule holds there, nothing is
    written without the reason, and with it the record holds the override and verifies."""
    from core.errors import GpuAcceptError
    from core.pipeline import StagedRun
    from core.record.signoff import make_signoff
    from core.record.verify import record_problems

    data = committed("lora")
    resume_cancelled(data)
    run = SimpleNamespace(signed=False, run_dir=tmp_path, record_path=None, verdict=None)
    with pytest.raises(GpuAcceptError, match=r"verdict is FAIL \(resume cancelled\)") as refused:
        StagedRun._write_record_file(run, dict(data), make_signoff("Ada", "accept"))
    assert type(refused.value).__name__ == "SignoffRefused"
    assert not (tmp_path / "record.toml").exists()
    path = StagedRun._write_record_file(run, dict(data), make_signoff("Ada", "accept", override=REASON))
    written = tomllib.loads(path.read_text())
    assert (written["signoff"]["override"], written["signoff"]["overridden"]) == (REASON, ["resume"])
    assert record_problems(written) == ([], [])


async def test_the_sign_off_screen_asks_for_a_reason_before_accepting_a_run_that_did_not_pass(
        tmp_path, monkeypatch, tiny_model_dir):
    """Accept on a run whose resume was cancelled: ^n writes nothing and says why (the Comment is the reason); with a
    comment typed, ^n writes the sign-off with the override."""
    from textual.widgets import Input, Select

    from core.status import StageStatus, Stopped
    from tests.unit.test_export_keys import export_screen

    shutil.copytree(tiny_model_dir, tmp_path / "tiny-llama")
    monkeypatch.chdir(tmp_path)
    async with export_screen(tmp_path) as (app, pilot, run):
        run.results["resume"] = None
        run.stopped = {"resume": Stopped(StageStatus.CANCELLED, "cancelled: the operator quit during the resume")}
        await pilot.press(*"ada")
        app.screen.query_one("#decision", Select).value = "accept"
        await pilot.pause()
        await pilot.press("ctrl+n")
        await pilot.pause(0.3)
        assert run.written == []  # nothing written without the reason
        error = app.screen.query_one("#export-error")
        assert "not written: the verdict is FAIL (resume cancelled)" in str(error.content), str(error.content)
        assert "type your reason in Comment" in str(error.content)
        app.screen.query_one("#decision", Select).value = "reject"
        await pilot.pause()
        app.screen.query_one("#decision", Select).value = "accept"  # said as soon as accept is chosen
        await pilot.pause()
        assert str(error.content).startswith("the verdict is FAIL (resume cancelled): to accept it anyway")
        app.screen.query_one("#comment", Input).value = REASON
        await pilot.pause()
        await pilot.press("ctrl+n")
        for _ in range(50):
            await pilot.pause(0.05)
            if run.written:
                break
        (signoff,) = run.written
        assert (signoff["decision"], signoff["override"], signoff["overridden"]) == ("accept", REASON, ["resume"])
        await pilot.pause(0.2)
        assert "OVERRIDE of resume" in str(app.screen.query_one("#written").content)
