"""Issue 22: the acceptance criteria (core/criteria.py): how a spec sets them, each rule met and missed, and ``verify``
recomputing them from a record (a tampered threshold or value is caught). The pipeline judged by them:
tests/integration/test_criteria.py."""

from __future__ import annotations

import math
import shutil
import tomllib

import pytest
import tomli_w

from core.criteria import (
    AcceptCriteria,
    DeviceUse,
    judge_plan_error,
    judge_probe,
    judge_quality,
    judge_resume_tier,
    missed,
)
from core.errors import SpecError
from core.record.shape import schema_problems
from core.record.verify import recompute_verdicts
from core.spec import RunSpec

GIB = 2**30


# ------------------------------------------------------------------------------------- setting them
def test_the_accept_table_of_a_spec_file_sets_the_criteria_and_flags_override_it(tmp_path):
    path = tmp_path / "spec.toml"
    path.write_text('mode = "lora"\n[accept]\nmax_perplexity = 40\nmax_device_share = 0.9\nresume_tier = "exact"\n')
    spec = RunSpec.build(path, accept_max_device_share=0.8)
    assert spec.accept == AcceptCriteria(max_perplexity=40.0, max_device_share=0.8, resume_tier="exact")
    # the criteria are not the setup: the same setup hashes alike whatever it is judged by
    assert spec.spec_hash() == RunSpec.build(mode="lora").spec_hash() and "accept" not in spec.to_dict()
    # the spec file written to a run folder keeps them, and reads back the same
    again = RunSpec.from_dict(tomllib.loads(tomli_w.dumps(spec.to_file_dict())))
    assert again == spec


@pytest.mark.parametrize(("raw", "says"), [
    ({"max_perplexity": 0.5}, "accept.max_perplexity: 0.5 is out of range; give a number at least 1"),
    ({"max_device_share": 1.2}, "accept.max_device_share: 1.2 is out of range; give a number in (0, 1]"),
    ({"max_device_share": 0}, "accept.max_device_share: 0.0 is out of range"),
    ({"min_improvement": 1.0}, "accept.min_improvement: 1.0 is out of range; give a number in [0, 1)"),
    ({"min_accuracy": "high"}, "accept.min_accuracy: 'high' is not a number"),
    ({"resume_tier": "loose"}, "accept.resume_tier: 'loose' is not one of auto, exact"),
    ({"max_loss": 3}, "accept.max_loss: unknown criterion; known criteria are: max_device_share"),
])
def test_a_bad_criterion_is_named_with_what_to_give(raw, says):
    with pytest.raises(SpecError) as err:
        RunSpec.from_dict({"accept": raw})
    assert says in str(err.value)


def test_a_criterion_outside_its_table_says_where_it_belongs():
    with pytest.raises(SpecError, match=r"max_perplexity belongs in the \[accept\] table"):
        RunSpec.from_dict({"max_perplexity": 30})


def test_the_record_table_names_the_criteria_not_set():
    table = AcceptCriteria(max_perplexity=40.0).to_table()
    assert table["max_perplexity"] == 40.0 and table["min_improvement"] == 0.0 and table["max_device_share"] == 1.0
    assert sorted(table["not_set"]) == ["max_plan_error_pct", "max_step_time_s", "max_step_time_spread",
                                        "min_accuracy", "min_busbw_gbps", "min_tokens_per_s"]
    assert AcceptCriteria.from_table(table) == AcceptCriteria(max_perplexity=40.0)


# ------------------------------------------------------------------------------------- each rule, met and missed
def test_by_default_training_passes_exactly_when_perplexity_goes_down():
    default = AcceptCriteria()
    (row,) = judge_quality(default, True, 50.0, 49.0, None)
    assert (row.criterion, row.met) == ("min_improvement", True) and math.isclose(row.value, 0.02)
    assert missed(judge_quality(default, True, 50.0, 50.0, None))  # equal is not better
    assert missed(judge_quality(default, True, 50.0, math.inf, None))
    (row,) = judge_quality(default, False, 50.0, None, None)
    assert (row.criterion, row.met) == ("finite_perplexity", True)
    assert missed(judge_quality(default, False, math.nan, None, None))


def test_quality_thresholds_met_and_missed():
    c = AcceptCriteria(max_perplexity=45.0, min_improvement=0.05, min_accuracy=0.3)
    rows = {r.criterion: r for r in judge_quality(c, True, 50.0, 46.0, 0.31)}
    assert rows["min_improvement"].met and math.isclose(rows["min_improvement"].value, 0.08)
    assert rows["max_perplexity"].met is False and rows["max_perplexity"].value == 46.0
    assert rows["min_accuracy"].met and rows["min_accuracy"].value == 0.31
    rows = {r.criterion: r for r in judge_quality(c, True, 50.0, 48.0, 0.29)}
    assert [r.criterion for r in missed(rows.values())] == ["min_improvement", "max_perplexity", "min_accuracy"]
    # an accuracy asked for and not measured is missed, with why
    (acc,) = [r for r in judge_quality(c, True, 50.0, 40.0, None) if r.criterion == "min_accuracy"]
    assert acc.met is False and acc.why == "not measured"
    # inference: the thresholds apply to the fixed weights' one evaluation
    assert {r.criterion: r.met for r in judge_quality(c, False, 44.0, None, 0.4)} == {
        "finite_perplexity": True, "max_perplexity": True, "min_accuracy": True}


def test_headroom_fails_on_one_device_while_the_total_would_fit():
    """Two 80 GiB devices, 76 GiB used on the first and 10 on the second: 86 of 160 GiB is 54 %, well inside a 90 %
    share of the total, but the first device alone is at 95 %: it has not the headroom agreed, so the probe fails
    (a server's memory is not pooled: each device holds its own tensors)."""
    c = AcceptCriteria(max_device_share=0.9)
    uses = [DeviceUse("cuda:0", 76 * GIB, 80 * GIB), DeviceUse("cuda:1", 10 * GIB, 80 * GIB)]
    assert sum(u.used_bytes for u in uses) <= c.max_device_share * sum(u.capacity_bytes for u in uses)
    rows = judge_probe(c, uses, None, None)
    assert [(r.on, r.met) for r in rows] == [("cuda:0", False), ("cuda:1", True)]
    assert math.isclose(rows[0].value, 0.95) and "max_device_share 0.9 on cuda:0: 0.95: MISSED" == rows[0].words()
    # the default share, 1.0, is the fit rule: at capacity fits, a byte above does not
    assert not missed(judge_probe(AcceptCriteria(), [DeviceUse("cuda:0", 80 * GIB, 80 * GIB)], None, None))
    assert missed(judge_probe(AcceptCriteria(), [DeviceUse("cuda:0", 80 * GIB + 1, 80 * GIB)], None, None))
    # a device of unknown capacity is not judged (no row met or missed)
    (row,) = judge_probe(c, [DeviceUse("cuda:0", GIB, None)], None, None)
    assert row.met is None and row.why == "capacity unknown"


def test_speed_criteria_met_and_missed():
    c = AcceptCriteria(max_step_time_s=2.0, min_tokens_per_s=1000.0)
    assert not missed(judge_probe(c, [], 1.5, 1200.0))
    assert [r.criterion for r in missed(judge_probe(c, [], 2.5, 900.0))] == ["max_step_time_s", "min_tokens_per_s"]
    assert judge_probe(AcceptCriteria(), [], 2.5, 900.0) == []  # not set: no row


def test_the_plans_error_is_its_own_criterion():
    c = AcceptCriteria(max_plan_error_pct=10.0)
    rows = judge_plan_error(c, [("cuda:0", 90, 100), ("cuda:1", 80, 100)])
    assert [(r.on, r.value, r.met) for r in rows] == [("cuda:0", 10.0, True), ("cuda:1", 20.0, False)]
    # an over-estimate counts as much as an under-estimate: |planned - measured| / measured
    assert judge_plan_error(c, [("cpu", 125, 100)])[0].value == 25.0
    (row,) = judge_plan_error(c, [])
    assert row.met is None and "the probe did not measure" in row.why
    assert judge_plan_error(AcceptCriteria(), [("cuda:0", 1, 100)]) == []


def test_an_exact_resume_tier_is_required_on_any_device():
    from core.stages.noise import NOISE_MULTIPLE, known_tiers, required_tier

    assert required_tier("cuda:0", "bf16").multiple == NOISE_MULTIPLE  # bounded by a twin's measured noise
    exact = required_tier("cuda:0", "bf16", "exact")
    assert exact.multiple == 0.0 and exact.exact and exact.name in known_tiers()
    assert required_tier("cpu", "fp32", "exact").exact and required_tier("cpu", "fp32").exact  # the CPU's is exact
    assert judge_resume_tier(AcceptCriteria(resume_tier="exact"), exact.name, 0.0)[0].met
    assert judge_resume_tier(AcceptCriteria(resume_tier="exact"), "cuda-bf16-twin-noise", NOISE_MULTIPLE)[0].met is False


# ------------------------------------------------------------------------------------- recomputed by verify
@pytest.fixture
def record(tmp_path) -> dict:
    from tests.records import path_of

    path = tmp_path / "record.toml"
    shutil.copyfile(path_of("lora"), path)
    return tomllib.loads(path.read_text())


def rows_of(rec: dict, stage: str) -> list[dict]:
    return rec["verdict"]["stages"][stage]["criteria"]


def test_the_committed_record_names_the_criteria_each_stage_was_judged_by(record):
    assert schema_problems(record) == [] and recompute_verdicts(record) == []
    assert [r["criterion"] for r in rows_of(record, "probe")] == ["max_device_share"]
    share = rows_of(record, "probe")[0]
    device = record["probe"]["devices"][0]
    used = max(device["peak_bytes"], device["peak_rss_bytes"])
    assert math.isclose(share["value"], used / record["plan"]["devices"][0]["capacity_bytes"]) and share["met"]
    (gain,) = rows_of(record, "evaluation")
    before, after = record["evaluation"]["before"]["perplexity"], record["evaluation"]["after"]["perplexity"]
    assert gain["criterion"] == "min_improvement" and math.isclose(gain["value"], (before - after) / before)
    assert rows_of(record, "resume") == [{"criterion": "resume_tier", "threshold": "auto", "value": "cpu-fp32-exact",
                                          "met": True, "on": "the resumed steps' losses"}]
    assert rows_of(record, "plan") == []  # max_plan_error_pct not set


def test_a_tampered_threshold_is_caught(record):
    """Raise the bar in the accept table after the run (the probe used 2.6 % of host memory; say 1 % was agreed):
    the row no longer follows, nor does the probe's pass."""
    record["accept"]["max_device_share"] = 0.01
    problems = recompute_verdicts(record)
    assert any("verdict.stages.probe.criteria[0] says" in p and "threshold 1.0" in p for p in problems)
    assert "verdict.stages.probe says pass, its data says fail" in problems


def test_a_threshold_edited_in_the_verdict_alone_is_caught(record):
    rows_of(record, "evaluation")[0]["threshold"] = 0.5
    assert any("verdict.stages.evaluation.criteria[0] says criterion 'min_improvement', threshold 0.5" in p
               for p in recompute_verdicts(record))


def test_a_tampered_value_is_caught(record):
    record["evaluation"]["after"]["perplexity"] = record["evaluation"]["before"]["perplexity"] * 0.5
    record["evaluation"]["after"]["mean_nll"] = math.log(record["evaluation"]["after"]["perplexity"])
    problems = recompute_verdicts(record)
    assert any("verdict.stages.evaluation.criteria[0]" in p and "value 0.5" in p for p in problems)


def test_a_criterion_added_to_the_accept_table_after_the_run_is_caught(record):
    record["accept"]["max_perplexity"] = 2.0
    record["accept"]["not_set"].remove("max_perplexity")
    problems = recompute_verdicts(record)
    assert any("verdict.stages.evaluation lists 1 criteria row(s); its data and the accept table give 2" in p
               for p in problems)
    assert "verdict.stages.evaluation says pass, its data says fail" in problems


def test_an_accept_table_gpuaccept_does_not_know_is_a_schema_error(record):
    record["accept"]["max_loss"] = 3.0
    assert any("the accept table: accept.max_loss: unknown criterion" in p for p in schema_problems(record))
    del record["accept"]["max_loss"]
    record["accept"]["not_set"] = []
    assert any("accept.not_set is []" in p for p in schema_problems(record))
    del record["accept"]
    assert "missing tables: accept" in schema_problems(record)


def test_an_accuracy_that_is_not_correct_over_tokens_is_caught(record):
    record["evaluation"]["after"]["accuracy"] = 0.9
    assert any("accuracy 0.9 is not correct_tokens / tokens" in p for p in recompute_verdicts(record))


def test_a_record_before_schema_4_is_judged_by_the_default_criteria(record):
    from tests.records import as_schema

    as_schema(record, 3)
    assert schema_problems(record) == [] and recompute_verdicts(record) == []


# ------------------------------------------------------------------------------------- verify over a folder
def test_verify_over_a_folder_names_each_record_and_the_worst_finding(tmp_path, capsys):
    """A folder of runs: each record.toml found (a spec.toml and a writer's temporary file are not records), one
    line each; a tampered record makes the folder's exit code 6, as it would alone."""
    import json

    from tests.records import path_of
    from tui.cli import main

    for name in ("lora", "inference"):
        (tmp_path / name).mkdir()
        shutil.copyfile(path_of(name), tmp_path / name / "record.toml")
        (tmp_path / name / "spec.toml").write_text('mode = "lora"\n')
    shutil.copyfile(path_of("full"), tmp_path / "full.toml")  # a record under another name is one too
    (tmp_path / "lora" / ".record-x1.toml").write_text(path_of("lora").read_text())
    assert main(["verify", str(tmp_path)]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:4]] == ["full.toml", "inference/record.toml", "lora/record.toml"]
    assert lines[-1] == "3 record(s); 0 verified (exit 3)"
    tampered = tomllib.loads((tmp_path / "lora" / "record.toml").read_text())
    tampered["accept"]["max_device_share"] = 0.01
    (tmp_path / "lora" / "record.toml").write_text(tomli_w.dumps(tampered))
    assert main(["verify", "--json", str(tmp_path)]) == 6
    table = json.loads(capsys.readouterr().out)
    assert [(r["record"].split("/")[-2], r["exit_code"]) for r in table["records"]][1:] == [("inference", 3),
                                                                                           ("lora", 6)]
    assert table["records"][2]["result"] == "verdict does not follow from the data"
    assert main(["verify", "--json", str(tmp_path / "lora" / "record.toml")]) == 6
    one = json.loads(capsys.readouterr().out)
    assert one["schema"] == "gpuaccept.verify/1" and one["signature"]["status"] == "unsigned"
    assert any("verdict.stages.probe says pass, its data says fail" in p for p in one["verdict_problems"])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["verify", str(empty)]) == 2


def test_training_criteria_on_an_inference_spec_are_refused():
    with pytest.raises(SpecError, match="accept.min_improvement: applies to training"):
        RunSpec.build(mode="inference", accept_min_improvement=0.1)
    with pytest.raises(SpecError, match="accept.resume_tier: applies to training"):
        RunSpec.build(mode="inference", accept_resume_tier="exact")


def test_the_console_says_a_plan_failed_by_its_criterion_after_the_probe(record, tmp_path):
    """The plan's pass is printed when it runs; a missed max_plan_error_pct, judged once the probe measured, is
    said before the verdict line."""
    from types import SimpleNamespace

    from tui.cli import _judged_after

    record["verdict"]["stages"]["plan"].update(status="fail", criteria=[
        {"criterion": "max_plan_error_pct", "threshold": 0.0, "value": 0.0077, "met": False, "on": "cpu"}])
    path = tmp_path / "edited.toml"
    path.write_text(tomli_w.dumps(record))
    assert _judged_after(SimpleNamespace(record_path=path)) == [
        "[plan] fail: judged after the probe by max_plan_error_pct 0.0 on cpu: 0.0077: MISSED"]
    assert _judged_after(SimpleNamespace(record_path=None)) == []
