"""End to end on the embedded SmolLM2-135M and the embedded text, as a user runs it (minutes on a 2-core CPU):
the headless run, and beside it the wizard, which must write the same record.

The headless run is the README's quick start (step 3), run exactly as written from a stand-in for the repository's
root (tests/readme_commands.py), and its record is then signed and verified by the README's step 5 as written. The
wizard beside it is prefilled with the same flags. Both run the default LoRA spec at a small size (8 steps of 4 x 64
tokens, a checkpoint every 2, 8 held-out blocks): every stage and every code path of the 30-step default (the kill
after a checkpoint, resumed from it over one interval that ends at the last step); the defaults' own values (kill step,
checkpoint step) are checked by tests/unit/test_spec.py. The two runs go side by side: the headless one is started in
the background before the wizard is driven, and the records are compared once both are written. Both get the same
number of torch threads (the environment's), so CPU fp32 with the same seed gives the same numbers in both.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.readme_commands import EXIT, headless_line, run_as_written, signing_lines, user_env, user_root, words_of
from tests.records import key_paths as keys
from tests.wizard_helpers import wait_for
from tui.app import GpuAcceptApp

pytestmark = pytest.mark.slow

EXE = shutil.which("gpuaccept", path=str(Path(sys.executable).parent))
#: the README's headless acceptance (its quick start, step 3), run exactly as written
QUICKSTART = headless_line()
#: its flags as the wizard's Setup fields, so the wizard beside it is prefilled with the same run
FIELDS = {"--steps": "steps", "--seq-len": "seq_len", "--checkpoint-every": "resume_checkpoint_every",
          "--eval-max-blocks": "eval_max_blocks", "--batch-size": "batch_size"}


def quickstart_fields() -> dict[str, int]:
    """The README line's setup flags (``--runs-dir`` and ``--headless`` are not setup) as Setup fields."""
    words = shlex.split(QUICKSTART)
    fields = {FIELDS[w]: int(words[i + 1]) for i, w in enumerate(words) if w in FIELDS}
    assert set(words[3:]) - set(FIELDS) - {str(v) for v in fields.values()} == {"--runs-dir", "runs/quickstart"}, \
        f"the README's headless line has a flag this test does not give the wizard: {QUICKSTART}"
    return fields


@pytest.fixture(scope="module")
def headless_started(tmp_path_factory):
    """The README's headless line started as written, in the background, from a stand-in for the repository's root
    (tests/readme_commands.py): (process, folder, start time). The process is killed if a test ends the module
    before it finished."""
    cwd = user_root(tmp_path_factory.mktemp("headless"))
    proc = subprocess.Popen(words_of(QUICKSTART, cwd), cwd=cwd, env=user_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    yield proc, cwd, time.monotonic()
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def headless(headless_started) -> dict:
    """The headless run's record, once it has finished, verified by ``gpuaccept verify``; then the README's step 5
    (a key, the signature, the verification) run as written on it."""
    proc, cwd, started = headless_started
    stdout, stderr = proc.communicate(timeout=1500)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    record_path = Path(cwd, stdout.strip().splitlines()[-1].removeprefix("record: "))
    assert record_path.parent.parent == cwd / "runs" / "quickstart"
    print(f"headless embedded LoRA acceptance (the README's quick start): {elapsed:.0f} s")
    verified = subprocess.run([EXE, "verify", str(record_path)], capture_output=True, text=True, timeout=120)
    assert verified.returncode == 3, verified.stdout  # unsigned, schema valid, every verdict follows from its data
    assert "schema: ok" in verified.stdout and "every verdict follows" in verified.stdout
    record = tomllib.loads(record_path.read_text())
    for line in signing_lines():  # the README's step 5, as written
        done = run_as_written(line, cwd, timeout_s=120)
        assert done.returncode == EXIT.get(line, 0), f"{line}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    signed = tomllib.loads(record_path.read_text())["signoff"]
    assert (signed["operator"], signed["decision"]) == ("Ada", "accept") and record_path.with_suffix(".toml.sig").is_file()
    return record


async def test_the_wizard_writes_the_same_record_as_the_headless_run(headless_started, request, tmp_path):
    # the defaults (embedded model and text, host memory bars) but for the README quick start's settings, prefilled as
    # `gpuaccept run` with its flags prefills the wizard
    app = GpuAcceptApp(runs_root=tmp_path / "runs", fields=quickstart_fields())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("3", "enter", "ctrl+n")
        await wait_for(pilot, lambda: not app.screen.query_one("#next").disabled, 120)
        for stage in ("probe", "train_eval", "resume"):
            await pilot.press("ctrl+n")
            # this stage's result, not the screen before it started: right after ^n nothing runs yet and the previous
            # screen's Next is enabled (the wait used to end there under load, with no run)
            await wait_for(pilot, lambda stage=stage: app.state.run is not None and stage in app.state.run.results
                           and app.state.running is None and not app.screen.query_one("#next").disabled, 1200)
            assert app.state.run.results[stage].status == "pass", (stage, app.state.run.results[stage].summary)
        await pilot.press("ctrl+n", *"Grace")
        app.screen.query_one("#decision").value = "accept"
        app.screen.query_one("#role").value = "ML infra on-call"
        key = tmp_path / "grace"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "grace@box", "-f", str(key)], check=True)
        app.screen.query_one("#key").value = str(key)
        await pilot.press("ctrl+n")  # the sign-off screen's key for Write record
        await wait_for(pilot, lambda: app.state.signature_path is not None, 60)
    wizard = tomllib.loads(Path(app.state.record_path).read_text())
    assert wizard["signoff"]["operator"] == "Grace" and wizard["signoff"]["role"] == "ML infra on-call"
    from core.record.signing import signature_path

    assert app.state.signature_path == signature_path(Path(app.state.record_path))
    from core.record.verify import verify

    allowed = tmp_path / "allowed_signers"
    allowed.write_text("grace@box " + (tmp_path / "grace.pub").read_text())
    # signed by the export screen with Grace's key; schema and every verdict hold
    assert verify(Path(app.state.record_path), allowed, "grace@box").exit_code == 0
    headless = request.getfixturevalue("headless")  # the run beside it, waited for now
    assert headless["signoff"] == {"status": "unsigned"}
    assert keys({k: v for k, v in wizard.items() if k != "signoff"}) == keys(
        {k: v for k, v in headless.items() if k != "signoff"})
    assert wizard["spec"] == headless["spec"]
    assert wizard["data"] == headless["data"]
    assert wizard["plan"]["parameters"] == headless["plan"]["parameters"]
    assert wizard["plan"]["traced"]["components"] == headless["plan"]["traced"]["components"]  # fake tensors: exact
    # CPU fp32 with the same seed is deterministic: the measured evaluation and losses are the same numbers
    for when in ("before", "after"):
        assert wizard["evaluation"][when]["perplexity"] == headless["evaluation"][when]["perplexity"]
    assert wizard["evaluation"]["loss_per_step"] == headless["evaluation"]["loss_per_step"]
    assert [c["name"] for c in wizard["resume"]["checks"]] == [c["name"] for c in headless["resume"]["checks"]]
    assert wizard["verdict"]["status"] == headless["verdict"]["status"] == "pass"


def test_headless_lora_acceptance_on_the_embedded_model(headless):
    record = headless
    assert record["model"]["kind"] == "embedded" and record["model"]["parameters_total"] > 130_000_000
    assert record["evaluation"]["after"]["perplexity"] < record["evaluation"]["before"]["perplexity"]
    assert record["resume"]["status"] == "pass"
    fields = quickstart_fields()  # what the README asked for
    assert (record["spec"]["steps"], record["spec"]["seq_len"]) == (fields["steps"], fields["seq_len"])
    assert record["spec"]["eval_max_blocks"] == fields["eval_max_blocks"]
    assert record["resume"]["checkpoint_step"] % fields["resume_checkpoint_every"] == 0  # resumed from a checkpoint
    assert record["verdict"]["status"] == "pass"
    assert record["data"]["heldout_documents"] > 0 and len(record["data"]["heldout_hash"]) == 64
    traced = record["plan"]["traced"]  # the traced plan beside the analytic one, weights equal to the byte
    assert traced["status"] == "estimated" and traced["tensors"] == "fake"
    assert traced["lines"]["weights"]["traced_bytes"] == traced["lines"]["weights"]["analytic_bytes"] > 500_000_000
