"""End to end on the embedded SmolLM2-135M and the embedded text, as a user runs it (minutes on a 2-core CPU):
the headless run, and beside it the wizard, which must write the same record.

Both run the default LoRA spec but for a shorter schedule, a smaller micro-batch and a smaller held-out evaluation
(``SCHEDULE``: 6 steps of micro-batch 2, a checkpoint every 2, the resume check killing after the 2nd; 8 held-out blocks
of 128 tokens instead of 32): every stage and every code path of the 30-step default (the kill inside step 6, after
checkpoint 4, resumed from it over one interval that ends at the last step, as the default's 20 -> 30 does; held-out
perplexity 22.8 before and 21.7 after here), at 1.2 min per run on one core instead of 4.5 on two; the defaults' own
values (kill step, checkpoint step) are checked by tests/unit/test_spec.py. The two runs go side by side: the headless one
is started in the background before the wizard is driven, and the records are compared once both are written. Both
get the same number of torch threads (the environment's), so CPU fp32 with the same seed gives the same numbers in
both.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.records import key_paths as keys
from tests.wizard_helpers import wait_for
from tui.app import GpuAcceptApp

pytestmark = pytest.mark.slow

EXE = shutil.which("gpuaccept", path=str(Path(sys.executable).parent))
#: the default spec's schedule, micro-batch and held-out evaluation, made smaller: (flag, Setup field, value)
SCHEDULE = (("--steps", "steps", 6), ("--checkpoint-every", "resume_checkpoint_every", 2),
            ("--batch-size", "batch_size", 2), ("--eval-max-blocks", "eval_max_blocks", 8))


@pytest.fixture(scope="module")
def headless_started(tmp_path_factory):
    """``gpuaccept run --headless --mode lora`` (on ``SCHEDULE``) started in the background in a fresh folder: (process, folder,
    start time). The process is killed if a test ends the module before it finished."""
    cwd = tmp_path_factory.mktemp("headless")
    flags = [str(part) for flag, _, value in SCHEDULE for part in (flag, value)]
    proc = subprocess.Popen([EXE, "run", "--headless", "--mode", "lora", *flags], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    yield proc, cwd, time.monotonic()
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def headless(headless_started) -> dict:
    """The headless run's record, once it has finished, verified by ``gpuaccept verify``."""
    proc, cwd, started = headless_started
    stdout, stderr = proc.communicate(timeout=1500)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    record_path = Path(cwd, stdout.strip().splitlines()[-1].removeprefix("record: "))
    assert record_path.parent.parent == cwd / "runs"
    print(f"headless embedded LoRA acceptance: {elapsed:.0f} s")
    verified = subprocess.run([EXE, "verify", str(record_path)], capture_output=True, text=True, timeout=120)
    assert verified.returncode == 3, verified.stdout  # unsigned, schema valid, every verdict follows from its data
    assert "schema: ok" in verified.stdout and "every verdict follows" in verified.stdout
    return tomllib.loads(record_path.read_text())


async def test_the_wizard_writes_the_same_record_as_the_headless_run(headless_started, request, tmp_path):
    # the defaults (embedded model and text, host memory bars) but for the schedule, prefilled as `gpuaccept run
    # --steps 6 --checkpoint-every 2 --batch-size 2 --eval-max-blocks 8` prefills the wizard
    app = GpuAcceptApp(runs_root=tmp_path / "runs", fields={field: value for _, field, value in SCHEDULE})
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("3", "enter", "ctrl+n")
        await wait_for(pilot, lambda: not app.screen.query_one("#next").disabled, 120)
        for stage in ("probe", "train_eval", "resume"):
            await pilot.press("ctrl+n")
            await wait_for(pilot, lambda: app.state.running is None and not app.screen.query_one("#next").disabled,
                           1200)
            assert app.state.run.results[stage].status == "pass", (stage, app.state.run.results[stage].summary)
        await pilot.press("ctrl+n", *"Grace")
        app.screen.query_one("#decision").value = "accept"
        app.screen.query_one("#role").value = "ML infra on-call"
        key = tmp_path / "grace"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "grace@box", "-f", str(key)], check=True)
        app.screen.query_one("#key").value = str(key)
        await pilot.click("#write")
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
    assert (record["spec"]["steps"], record["resume"]["checkpoint_step"]) == (6, 4)  # the schedule asked for
    assert (record["spec"]["batch_size"], record["spec"]["eval_max_blocks"]) == (2, 8)
    assert record["verdict"]["status"] == "pass"
    assert record["data"]["heldout_documents"] > 0 and len(record["data"]["heldout_hash"]) == 64
    traced = record["plan"]["traced"]  # the traced plan beside the analytic one, weights equal to the byte
    assert traced["status"] == "estimated" and traced["tensors"] == "fake"
    assert traced["lines"]["weights"]["traced_bytes"] == traced["lines"]["weights"]["analytic_bytes"] > 500_000_000
