"""Issue 7: the record's schema, its sign-off signed with ssh-keygen, and ``gpuaccept verify`` with its exit codes.

The record is the one the pipeline wrote for the tiny model, committed under tests/data/records (tests/records.py); each
test works on a copy. What the pipeline writes afresh is checked in tests/integration/test_record_of_a_run.py.
"""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import tomli_w

from core.record.shape import schema_problems
from core.record.verify import (
    EXIT_BAD_SIGNATURE,
    EXIT_SCHEMA,
    EXIT_SIGNER_NOT_ALLOWED,
    EXIT_SIGNER_NOT_CHECKED,
    EXIT_UNSIGNED,
    EXIT_VERDICT,
    EXIT_VERIFIED,
    recompute_verdicts,
)
from core.record.written import plain_values, write_record
from tests.records import as_schema
from tui.cli import main

pytestmark = pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="OpenSSH's ssh-keygen is needed")


@pytest.fixture
def record(tmp_path) -> Path:
    from tests.records import path_of

    path = tmp_path / "record.toml"
    shutil.copyfile(path_of("lora"), path)
    return path


@pytest.fixture(scope="module")
def key(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "grace"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "grace@box", "-f", str(path)], check=True)
    return path


def sign(record: Path, key: Path, capsys) -> int:
    code = main(["sign", str(record), "--key", str(key), "--operator", "Grace", "--role", "ML infra on-call",
                 "--decision", "accept", "--comment", "fits on one device"])
    capsys.readouterr()
    return code


def verify(record: Path, capsys, *extra: str) -> tuple[int, str]:
    code = main(["verify", str(record), *extra])
    return code, capsys.readouterr().out


def edit(record: Path, change) -> None:
    """Hand-edit the record as a person with a text editor would (TOML in, TOML out)."""
    data = tomllib.loads(record.read_text())
    change(data)
    record.write_text(tomli_w.dumps(data))



def test_the_committed_record_conforms_and_its_verdicts_follow(record):
    rec = tomllib.loads(record.read_text())
    assert schema_problems(rec) == []
    assert recompute_verdicts(rec) == []
    assert rec["verdict"]["status"] == "pass" and rec["resume"]["status"] == "pass"


def test_unsigned_is_reported_as_unsigned(record, capsys):
    code, out = verify(record, capsys)
    assert code == EXIT_UNSIGNED
    assert "signature: unsigned" in out and "schema: ok" in out and "UNSIGNED (consistent) (exit 3)" in out


def test_round_trip_sign_then_verify(record, key, capsys):
    assert sign(record, key, capsys) == 0
    signed = tomllib.loads(record.read_text())["signoff"]
    assert signed["operator"] == "Grace" and signed["role"] == "ML infra on-call" and signed["decision"] == "accept"
    assert signed["time_utc"].utcoffset() == dt.timedelta(0)
    code, out = verify(record, capsys)
    assert code == EXIT_SIGNER_NOT_CHECKED, out  # any key makes a good signature: who signed is not checked
    assert "signer not checked (no --allowed-signers)" in out
    allowed = record.parent / "allowed_signers"
    allowed.write_text("grace@box " + key.with_suffix(".pub").read_text())
    code, out = verify(record, capsys, "--allowed-signers", str(allowed), "--identity", "grace@box")
    assert code == EXIT_VERIFIED and "signer grace@box allowed" in out
    # issue 16: a name that is not the signer's is a mix-up, told apart from a changed record (which is exit 4)
    code, out = verify(record, capsys, "--allowed-signers", str(allowed), "--identity", "mallory@box")
    assert code == EXIT_SIGNER_NOT_ALLOWED and "SIGNER NOT ALLOWED" in out and "the signature is intact" in out
    record.write_bytes(record.read_bytes().replace(b'decision = "accept"', b'decision = "reject"'))
    code, out = verify(record, capsys, "--allowed-signers", str(allowed), "--identity", "mallory@box")
    assert code == EXIT_BAD_SIGNATURE and "BAD SIGNATURE" in out


def test_one_changed_byte_fails_the_signature(record, key, capsys):
    assert sign(record, key, capsys) == 0
    data = bytearray(record.read_bytes())
    at = data.index(b"Grace")
    data[at] = ord("g")  # one byte of the operator's name
    record.write_bytes(bytes(data))
    code, out = verify(record, capsys)
    assert code == EXIT_BAD_SIGNATURE and "BAD SIGNATURE (exit 4)" in out


def test_a_signature_in_another_namespace_fails(record, key, capsys):
    subprocess.run(["ssh-keygen", "-Y", "sign", "-f", str(key), "-n", "file", str(record)], check=True,
                   capture_output=True)
    code, out = verify(record, capsys)
    assert code == EXIT_BAD_SIGNATURE and "namespace" in out


def test_a_signed_record_is_not_signed_or_rewritten_again(record, key, capsys):
    assert sign(record, key, capsys) == 0
    before = record.read_bytes()
    assert main(["sign", str(record), "--key", str(key)]) == 2
    assert "already" in capsys.readouterr().err
    assert record.read_bytes() == before


def test_a_bad_key_leaves_the_record_untouched(record, tmp_path, capsys):
    before = record.read_bytes()
    not_a_key = tmp_path / "notes.txt"
    not_a_key.write_text("hello")
    assert main(["sign", str(record), "--key", str(not_a_key), "--operator", "Grace", "--decision", "accept"]) == 2
    assert "is not an SSH key" in capsys.readouterr().err
    assert record.read_bytes() == before and not record.with_name("record.toml.sig").exists()


def test_a_hand_edited_number_that_changes_a_verdict_fails_even_unsigned(record, capsys):
    import math

    def worse_after_training(data):  # perplexity and mean NLL changed together: only the comparison gives it away
        after = data["evaluation"]["after"]
        after["mean_nll"] = data["evaluation"]["before"]["mean_nll"] + 0.5
        after["perplexity"] = math.exp(after["mean_nll"])

    edit(record, worse_after_training)
    code, out = verify(record, capsys)
    assert code == EXIT_VERDICT
    assert "evaluation table says status pass, its data says fail" in out


def test_a_plan_total_edited_past_capacity_is_caught(record, capsys):
    def shrink_capacity(data):
        device = data["plan"]["devices"][0]
        device["capacity_bytes"] = device["total_bytes"] - 1

    edit(record, shrink_capacity)
    code, out = verify(record, capsys)
    assert code == EXIT_VERDICT and "means fits = False, the record says True" in out


def test_a_plan_total_summed_instead_of_its_peak_phase_is_caught(record, capsys):
    """Schema 2: the total is the largest phase; a total edited back to the sum of the components (which no moment of
    the step holds) does not follow, nor does a phase holding more of a component than its line."""
    def summed(data):
        device = data["plan"]["devices"][0]
        device["total_bytes"] = sum(device["components"].values())

    edit(record, summed)
    code, out = verify(record, capsys)
    assert code == EXIT_VERDICT and "its largest phase holds" in out


def test_a_phase_above_its_line_and_a_wrong_peak_phase_are_caught(record, capsys):
    def inflate(data):
        device = data["plan"]["devices"][0]
        device["phases"]["optimizer_step"]["components"]["temporaries"] += 10**12
        device["peak_phase"] = "forward"

    edit(record, inflate)
    code, out = verify(record, capsys)
    assert code == EXIT_VERDICT
    assert "above its line" in out and "the largest phase is 'optimizer_step'" in out


def test_a_fit_judged_by_the_smaller_estimate_is_caught(record, capsys):
    """The fit is judged by the larger of the analytic peak and the traced one (+ what a trace cannot see): a traced
    peak edited above the analytic one, with the record still saying "analytic", does not follow."""
    def traced_above(data):
        device = data["plan"]["devices"][0]
        data["plan"]["traced"]["peak_bytes"] = device["total_bytes"] + 1000

    edit(record, traced_above)
    code, out = verify(record, capsys)
    assert code == EXIT_VERDICT and "(traced: the larger of the analytic and traced peaks)" in out


def test_an_under_estimate_the_findings_do_not_name_is_caught(record, capsys):
    def measured_above_the_plan(data):
        row = data["probe"]["plan_comparison"][0]
        peak = int(row["planned_bytes"] * 1.2)
        row["measured_bytes"] = peak
        data["probe"]["devices"][0]["peak_bytes"] = peak
        data["probe"]["findings"] = []

    edit(record, measured_above_the_plan)
    code, out = verify(record, capsys)
    assert code == EXIT_VERDICT and "does not name the under-estimate" in out


def test_a_probe_that_ran_other_than_planned_does_not_pass(record, capsys):
    """Schema 2: a passing probe ran the spec's attention implementation and LoRA targets (the plan is for those), and
    names an under-estimate exactly where its numbers show one."""
    edit(record, lambda data: data["probe"].update(attention_implementation="eager"))
    code, out = verify(record, capsys)
    assert code == EXIT_VERDICT and "the model ran with eager attention and the plan is for sdpa" in out

    def other_targets(data):
        data["probe"]["attention_implementation"] = "sdpa"
        data["probe"]["lora_targets_resolved"] = ["k_proj"]
        data["probe"]["findings"] = [f"{data['probe']['devices'][0]['device']}: UNDER-ESTIMATE: invented"]

    edit(record, other_targets)
    code, out = verify(record, capsys)
    assert "are not the spec's targets" in out and "but it measured within the tolerance of its plan" in out


@pytest.mark.parametrize("change,says", [
    (lambda spec: spec.update(precision="half"), "spec.precision is 'half'"),
    (lambda spec: spec.pop("padding"), "spec.padding is None"),
])
def test_schema_2_spec_keys_are_checked_even_with_the_hash_recomputed(record, capsys, change, says):
    from core.record.shape import spec_table_hash

    def edited(data):
        change(data["spec"])
        data["spec"]["hash"] = spec_table_hash(data["spec"])

    edit(record, edited)
    code, out = verify(record, capsys)
    assert code == EXIT_SCHEMA and says in out


def test_a_plan_device_without_its_fit_is_a_schema_error(record, capsys):
    edit(record, lambda data: data["plan"]["devices"][0].pop("fit_bytes"))
    code, out = verify(record, capsys)
    assert code == EXIT_SCHEMA and "lacks fit_bytes" in out


def test_a_schema_1_record_is_read_with_its_own_rule(record, capsys):
    """Records written before schema 2 summed the components into the total: verify reads them by that rule."""
    def as_version_1(data):
        as_schema(data, 1)
        device = data["plan"]["devices"][0]
        device["total_bytes"] = sum(device["components"].values())
        device["fits"] = device["total_bytes"] <= device["capacity_bytes"]
        data["probe"]["plan_comparison"][0]["planned_bytes"] = device["total_bytes"]

    edit(record, as_version_1)
    code, out = verify(record, capsys)
    assert code == EXIT_UNSIGNED, out


def test_an_edited_spec_breaks_its_hash(record, capsys):
    edit(record, lambda data: data["spec"].update(batch_size=64))
    code, out = verify(record, capsys)
    assert code == EXIT_SCHEMA and "spec.hash is not the sha256 of the spec table" in out


def test_a_naive_time_is_a_schema_error(record, capsys):
    edit(record, lambda data: data.update(created_utc=data["created_utc"].replace(tzinfo=None)))
    code, out = verify(record, capsys)
    assert code == EXIT_SCHEMA and "created_utc is datetime.datetime(" in out
    assert "not a UTC date-time with its offset" in out


# Issue 16: each of these passed "schema: ok" while the check looked only at the top level.
AWARE = dt.datetime(2026, 12, 1, 6, 0, tzinfo=dt.UTC)


def _in_table(table, key, value):
    return lambda data: data[table].update({key: value})


@pytest.mark.parametrize("change, says", [
    (lambda d: d["evaluation"]["before"].update(perplexity=float("nan")),
     "evaluation.before.perplexity is nan as a TOML float"),
    (lambda d: d["plan"]["devices"][0]["components"].update(weights=float("inf")),
     "plan.devices[0].components.weights is inf as a TOML float"),
    (lambda d: d["probe"]["devices"][0].update(finished_utc=dt.datetime(2026, 12, 1, 6, 0)),
     "probe.devices[0].finished_utc is datetime.datetime(2026, 12, 1, 6, 0), not a UTC date-time"),
    (lambda d: d["probe"].update(steps=AWARE), "probe.steps is a date or time (2026-12-01 06:00:00+00:00)"),
    (lambda d: d["resume"]["tier"].update(multiple=dt.date(2026, 12, 1)), "resume.tier.multiple is a date or time"),
    (lambda d: d["plan"]["devices"][0].update({"": 1}), "plan.devices[0] has an empty key"),
    (lambda d: d["resume"]["comparison"][0].update(step=3.0), "resume.comparison[0].step is 3.0, not a count"),
    (lambda d: d["resume"].update(checkpoint_step=True), "resume.checkpoint_step is True, not a count"),
    (lambda d: d["probe"]["devices"][0].update(peak_rss_bytes=-5),
     "probe.devices[0].peak_rss_bytes is -5, not a count"),
    (lambda d: d["evaluation"].update(training_time_s=-1.0),
     "evaluation.training_time_s is -1.0, not a finite number >= 0"),
    (lambda d: d["evaluation"]["after"].update(mean_nll="huge"), "evaluation.after.mean_nll is 'huge', not a number"),
    (lambda d: d["resume"]["checks"][0].update(status=1), "resume.checks[0].status is 1, not a string"),
    (lambda d: d["resume"]["checkpoint_manifest"].update({"optimizer.pt": "abc"}),
     "resume.checkpoint_manifest.optimizer.pt is 'abc', not a sha256"),
    (lambda d: d["evaluation"].update(provenance="guessed"), "evaluation.provenance is 'guessed'"),
])
def test_every_value_below_the_top_level_is_checked(record, capsys, change, says):
    edit(record, change)
    code, out = verify(record, capsys)
    assert code == EXIT_SCHEMA and says in out, out
    assert "verdicts: not recomputed (the schema check failed)" in out


@pytest.mark.parametrize("key, value, says", [
    ("steps", 8.0, "spec.steps is 8.0, not int"),
    ("gradient_checkpointing", 1, "spec.gradient_checkpointing is 1, not bool"),
    ("learning_rate", "fast", "spec.learning_rate is 'fast', not float")])
def test_the_spec_table_holds_the_types_the_spec_takes_even_with_its_hash_recomputed(record, capsys, key, value, says):
    from core.record.shape import spec_table_hash

    def change(data):
        data["spec"][key] = value
        data["spec"]["hash"] = spec_table_hash(data["spec"])

    edit(record, change)
    code, out = verify(record, capsys)
    assert code == EXIT_SCHEMA and says in out, out



def test_nothing_but_plain_values_reaches_the_writer(tmp_path):
    import numpy as np

    ok = {"a": 1, "t": dt.datetime(2026, 11, 30, tzinfo=dt.UTC), "l": [1.5, "x"]}
    write_record(ok, tmp_path / "ok.toml")
    for bad, where in (({"a": {"b": None}}, "record.a.b is None"),
                       ({"a": [1, np.float32(2.0)]}, "record.a[1] is a numpy.float32"),
                       ({"t": dt.datetime(2026, 11, 30)}, "record.t = ")):
        with pytest.raises(TypeError, match=where.replace("[", r"\[").replace("]", r"\]")):
            write_record(bad, tmp_path / "bad.toml")
    assert not (tmp_path / "bad.toml").exists()
    plain_values(ok)



# ------------------------------------------------------------------ what a skeptical reviewer tried (each was accepted)
def not_run(data, *tables):
    for table in tables:
        data[table] = {"provenance": "not_run"}


def test_a_record_stripped_of_its_evidence_does_not_pass(record, capsys):
    edit(record, lambda data: not_run(data, "probe", "evaluation", "data"))
    code, out = verify(record, capsys)
    assert code == EXIT_VERDICT
    assert "verdict.stages.probe says pass, but its table holds no measurement" in out


def test_estimated_is_not_a_provenance_for_a_measurement(record, capsys):
    edit(record, lambda data: data["probe"].update(provenance="estimated", method="guessed"))
    code, out = verify(record, capsys)
    assert code == EXIT_SCHEMA and "probe.provenance is 'estimated'; for this table one of measured, not_run" in out


def test_a_probe_without_a_capacity_to_fit_in_cannot_pass(record, capsys):
    def drop_capacity(data):
        device = data["plan"]["devices"][0]
        del device["capacity_bytes"], device["fits"]
        data["probe"]["devices"][0]["peak_bytes"] = 10**14

    edit(record, drop_capacity)
    code, out = verify(record, capsys)
    assert code == EXIT_VERDICT and "its fit cannot be judged" in out


def test_a_resume_that_lost_checks_or_loosened_its_tier_does_not_pass(record, capsys):
    edit(record, lambda data: data["resume"].update(checks=data["resume"]["checks"][:1]))
    code, out = verify(record, capsys)
    assert code == EXIT_VERDICT and "resume passed without its rng_restored check" in out


@pytest.mark.parametrize(("version", "expected"), [(3, EXIT_VERDICT), (2, EXIT_UNSIGNED)])
def test_manifest_at_load_is_required_from_schema_3(record, capsys, version, expected):
    """A version 3 record whose passing resume lacks the resumed process's own manifest check does not follow; a
    version 2 record (written before the check existed) is read by its own rule."""
    def drop(data):
        as_schema(data, version)
        data["resume"]["checks"] = [c for c in data["resume"]["checks"] if c["name"] != "manifest_at_load"]

    edit(record, drop)
    code, out = verify(record, capsys)
    assert code == expected, out
    assert ("resume passed without its manifest_at_load check" in out) == (version == 3)


def test_a_loosened_tier_with_a_diverged_loss_is_caught(record, capsys):
    def loosen(data):
        data["resume"]["tier"]["multiple"] = 1000.0
        row = data["resume"]["comparison"][0]
        row["loss_resumed"] = row["loss_reference"] + 1.0
        row["difference"] = 1.0

    edit(record, loosen)
    code, out = verify(record, capsys)
    assert code == EXIT_VERDICT and "resume.tier cpu-fp32-exact has multiple 0.0, the record says 1000.0" in out
    assert "loss difference 1.0 on an exact tier, but the resume passed" in out


def test_a_twin_bound_that_does_not_hold_its_own_noise_is_caught(record, capsys):
    """A record judged by a twin's noise (the CPU with resume.noise = "twin"): a bound set below 4 x the noise it was
    made from, and a resumed loss above the bound that still passed, are both named."""
    from core.record.shape import spec_table_hash

    def bounded(data):
        data["spec"]["resume"]["noise"] = "twin"
        data["spec"]["hash"] = spec_table_hash(data["spec"])
        data["resume"]["tier"] = {"name": "cpu-fp32-twin-noise", "method": "twin", "multiple": 4.0, "why": "twin"}
        for check in data["resume"]["checks"]:
            if check["kind"] == "tolerance":
                check.update(largest_difference=0.0, noise=1e-3, bound=4e-3)
        loss = next(c for c in data["resume"]["checks"] if c["name"] == "loss")
        loss["bound"] = 1e-3  # below 4 x its noise
        row = data["resume"]["comparison"][0]
        row["loss_resumed"] = row["loss_reference"] + 2e-3
        row["difference"] = abs(row["loss_resumed"] - row["loss_reference"])

    edit(record, bounded)
    code, out = verify(record, capsys)
    assert code == EXIT_VERDICT, out
    assert "resume check loss: bound 0.001 is below 4 x the twin's noise 0.001" in out
    assert "is above the loss bound 0.001, but the resume passed" in out


def test_non_finite_numbers_as_the_writer_spells_them_are_read_not_crashed_on(record, capsys):
    def diverged(data):  # what the pipeline writes for a run whose loss went to nan: the stage fails
        data["evaluation"]["after"].update(perplexity="nan", mean_nll="nan")
        data["evaluation"]["status"] = "fail"
        data["verdict"]["stages"]["evaluation"]["status"] = "fail"
        data["verdict"]["stages"]["evaluation"]["criteria"][0].update(value="nan", met=False)
        data["verdict"]["status"] = "fail"

    edit(record, diverged)
    code, out = verify(record, capsys)
    assert code == EXIT_UNSIGNED, out  # consistent: a failed run, honestly recorded


def test_a_value_of_the_wrong_type_is_a_schema_finding_not_a_crash(record, capsys):
    edit(record, lambda data: data["probe"]["devices"][0].update(peak_bytes="a lot"))
    code, out = verify(record, capsys)
    assert code == EXIT_SCHEMA and "probe.devices[0].peak_bytes is 'a lot', not a count" in out
    assert "verdicts: not recomputed (the schema check failed)" in out


def test_a_spec_edited_with_its_hash_recomputed_still_disagrees_with_the_evaluation(record, capsys):
    from core.record.shape import spec_table_hash

    def rehash(data):
        data["spec"]["seq_len"] = 4096
        data["spec"]["hash"] = spec_table_hash(data["spec"])

    edit(record, rehash)
    code, out = verify(record, capsys)
    assert code == EXIT_VERDICT and "evaluation.settings.seq_len = 64, the spec says 4096" in out


def test_signing_changes_nothing_unless_it_can_be_done(record, key, tmp_path, capsys):
    before = record.read_bytes()
    lonely = tmp_path / "lonely.pub"  # a public key whose private half is in no agent
    shutil.copyfile(key.with_suffix(".pub"), lonely)
    assert main(["sign", str(record), "--key", str(lonely), "--operator", "Grace", "--decision", "accept"]) == 2
    assert "could not sign" in capsys.readouterr().err
    assert record.read_bytes() == before and not record.with_name("record.toml.sig").exists()
    edit(record, lambda data: data["verdict"].update(status="fail"))
    before = record.read_bytes()
    assert main(["sign", str(record), "--key", str(key), "--operator", "Grace", "--decision", "accept"]) == 2
    assert "not signed: the record does not verify" in capsys.readouterr().err
    assert record.read_bytes() == before


def test_a_passphrase_key_fails_at_once_instead_of_prompting(record, tmp_path, capsys):
    locked = tmp_path / "locked"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret words", "-f", str(locked)], check=True)
    # under `script` ssh-keygen has a terminal it could prompt on; it must not get one from us
    if shutil.which("script") is None:
        pytest.skip("util-linux script is needed to give the command a terminal")
    import sys

    exe = Path(sys.executable).parent / "gpuaccept"
    cmd = f"{exe} sign {record} --key {locked} --operator G --decision accept"
    import time

    started = time.monotonic()
    done = subprocess.run(["script", "-qec", cmd, "/dev/null"], capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stdout
    assert time.monotonic() - started < 20  # it did not wait for a passphrase (ssh-keygen's own timeout is none)
    assert "ssh-add" in done.stdout and "Enter passphrase" not in done.stdout


def test_the_cpu_runtime_measured_is_rss_minus_tensors_and_an_edit_is_caught(record, capsys):
    """The overhead line on the CPU is compared with peak RSS minus the peak of live tensors (issue 17: it said "in
    peak", though the tensor peak holds no runtime); the record says how, and verify recomputes it."""
    data = tomllib.loads(Path(record).read_text())
    device, row = data["probe"]["devices"][0], data["probe"]["plan_comparison"][0]
    overhead = row["components"]["overhead"]
    if device["peak_rss_bytes"] >= device["peak_bytes"]:
        assert overhead["measured_bytes"] == device["peak_rss_bytes"] - device["peak_bytes"]
        assert overhead["measured"].startswith("peak RSS minus the peak of live tensors")
    assert row["components"]["activations"]["measured"] == "not measured on its own: inside the peak"

    def runtime_edited(data):
        data["probe"]["plan_comparison"][0]["components"]["overhead"]["measured_bytes"] = 12345

    edit(record, runtime_edited)
    code, out = verify(record, capsys)
    assert code == EXIT_VERDICT and "the overhead measured 12345 B, but peak RSS minus the peak of tensors" in out


def test_on_cuda_the_overhead_is_said_not_read():
    from core.stages.probe import DeviceMeasurement, how_measured, runtime_bytes

    m = DeviceMeasurement(device="cuda:0", weights_bytes=1, gradients_bytes=0, optimizer_states_bytes=0,
                          peak_bytes=10 * 2**30, peak_method="torch.cuda.max_memory_allocated",
                          peak_reserved_bytes=11 * 2**30, peak_rss_bytes=12 * 2**30, rss_after_load_bytes=0,
                          parameters=1, trainable_parameters=1)
    assert runtime_bytes(m) is None  # RSS is host memory there: it says nothing of the CUDA context
    assert how_measured("overhead", m).startswith("not measured: the CUDA context is outside torch's allocator")
    from tui.screens.stages import measured_cell

    assert measured_cell(how_measured("overhead", m)) == "not read"
    assert measured_cell(how_measured("activations", m)) == "in peak"


@pytest.mark.parametrize("loss_multiple, says", [
    # losses by their own family's multiple: a check without its family is named
    (0.0, "resume check loss: its noise pairs [] of [] are not the pairs of the twins"),
    # a multiple edited is named (a twin tier's losses take theirs from their family: the tier says 0)
    (4.0, "resume.tier cpu-fp32-twin-noise has loss_multiple 0.0, the record says 4.0"),
])
def test_a_twin_tiers_losses_are_held_to_their_own_multiple(record, capsys, loss_multiple, says):
    from core.record.shape import spec_table_hash

    def bounded(data):
        data["spec"]["resume"]["noise"] = "twin"
        data["spec"]["hash"] = spec_table_hash(data["spec"])
        data["resume"]["tier"] = {"name": "cpu-fp32-twin-noise", "method": "twin", "multiple": 4.0, "why": "twin",
                                  "loss_multiple": loss_multiple}
        for check in data["resume"]["checks"]:
            if check["kind"] == "tolerance":
                check.update(largest_difference=0.0, noise=1e-3, bound=4e-3 if check["name"] != "loss" else 1e-3)

    edit(record, bounded)
    code, out = verify(record, capsys)
    assert code == EXIT_VERDICT and says in out, out
