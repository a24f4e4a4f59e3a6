"""Issue 36: one verdict engine (core/record/verdicts.py). Each rule on typed facts, its pass side and its fail side;
the facts read back from a record by ``gpuaccept verify`` give the verdicts the record states; and the facts the record
is built from (the stages' typed results) are the facts verify reads back from it, so both judge by the same call."""

from __future__ import annotations

import dataclasses
import math
import tomllib

import pytest
import tomli_w

from core.criteria import AcceptCriteria
from core.record.verdicts import (
    CheckFact,
    ComparedPeak,
    ComparedStep,
    KillSteps,
    MetricFacts,
    NotApplicable,
    PlanFacts,
    PlannedDevice,
    ProbedDevice,
    ProbeFacts,
    QualityFacts,
    RecordValueError,
    ResumeFacts,
    count,
    entry,
    evaluation_verdict,
    number,
    overall_status,
    plan_verdict,
    probe_verdict,
    resume_verdict,
    stated_problems,
)
from core.stages.noise import RecordedRule
from core.status import PASSING, StageStatus

PASS, FAIL = StageStatus.PASS, StageStatus.FAIL
GiB = 2**30


# ------------------------------------------------------------------------------------------------------------- plan
def test_a_plan_passes_exactly_when_every_device_fits():
    fits = PlanFacts((PlannedDevice("cuda:0", 10 * GiB, 80 * GiB), PlannedDevice("cuda:1", 80 * GiB, 80 * GiB)))
    assert plan_verdict(fits).status is PASS  # at its capacity exactly is a fit
    over = PlanFacts((PlannedDevice("cuda:0", 10 * GiB, 80 * GiB), PlannedDevice("cuda:1", 80 * GiB + 1, 80 * GiB)))
    judged = plan_verdict(over)
    assert judged.status is FAIL and judged.reasons == (f"cuda:1: planned {80 * GiB + 1} B, above its capacity "
                                                        f"{80 * GiB} B",)
    # a device whose capacity cannot be known is not held against the plan (core/plan/fit.py)
    assert plan_verdict(PlanFacts((PlannedDevice("cpu", 10**15, None),))).status is PASS


def test_a_plan_fails_on_its_own_criterion_against_the_probes_peak():
    crit = AcceptCriteria(max_plan_error_pct=10.0)
    device = (PlannedDevice("cuda:0", 10 * GiB, 80 * GiB),)
    near = plan_verdict(PlanFacts(device, (ComparedPeak("cuda:0", 105, 100),), crit))
    assert near.status is PASS and [(r.criterion, r.value, r.met) for r in near.criteria] == [
        ("max_plan_error_pct", 5.0, True)]
    far = plan_verdict(PlanFacts(device, (ComparedPeak("cuda:0", 150, 100),), crit))
    assert far.status is FAIL and far.criteria[0].value == 50.0 and "MISSED" in far.reasons[0]
    # without a probe's peak the criterion is written, not judged
    unjudged = plan_verdict(PlanFacts(device, (), crit))
    assert unjudged.status is PASS and unjudged.criteria[0].met is None


# ------------------------------------------------------------------------------------------------------------ probe
def _probe(**changes) -> ProbeFacts:
    base = ProbeFacts((ProbedDevice("cuda:0", 40 * GiB, 80 * GiB),), AcceptCriteria(), 0.5, 4000.0,
                      expected_devices=1, attention="sdpa", planned_attention="sdpa")
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize("changes, why", [
    ({"devices": (ProbedDevice("cuda:0", 80 * GiB + 1, 80 * GiB),)}, "max_device_share 1 on cuda:0"),
    ({"criteria": AcceptCriteria(max_device_share=0.4)}, "max_device_share 0.4 on cuda:0: 0.5: MISSED"),
    ({"devices": (ProbedDevice("cuda:0", GiB, 80 * GiB, "strategy ddp was asked for, but ..."),)},
     "cuda:0: strategy ddp was asked for"),
    ({"devices": (ProbedDevice("cuda:0", GiB, None),)}, "no planned device with a capacity"),
    ({"devices": ()}, "no device was measured"),
    ({"expected_devices": 2}, "1 device(s) measured (one per rank), the spec runs 2"),
    ({"attention": "eager"}, "the model ran with eager attention, the plan is for sdpa"),
    ({"criteria": AcceptCriteria(max_step_time_s=0.25)}, "max_step_time_s 0.25"),
    ({"criteria": AcceptCriteria(min_tokens_per_s=5000.0)}, "min_tokens_per_s 5000"),
    ({"step_time_s": None, "criteria": AcceptCriteria(max_step_time_s=1.0)}, "not measured"),
    ({"exit_code": 1}, "the process ended with 1"),
    ({"exit_code": "killed"}, "the process ended with 'killed'"),
    ({"steps": 3, "expected_steps": 10}, "it ran 3 of the 10 steps"),
])
def test_each_probe_rule_fails_the_probe(changes, why):
    assert probe_verdict(_probe()).status is PASS
    judged = probe_verdict(_probe(**changes))
    assert judged.status is FAIL and any(why in r for r in judged.reasons), judged.reasons


def test_the_probes_pass_sides():
    # at its share exactly; every step asked for; an unknown capacity where the rule does not require one (command mode)
    assert probe_verdict(_probe(devices=(ProbedDevice("cuda:0", 80 * GiB, 80 * GiB),))).status is PASS
    assert probe_verdict(_probe(steps=10, expected_steps=10, exit_code=0)).status is PASS
    assert probe_verdict(_probe(devices=(ProbedDevice("cpu", GiB, None),), capacity_required=False)).status is PASS
    assert probe_verdict(_probe(attention="", expected_devices=None)).status is PASS  # not known: not judged
    assert probe_verdict(_probe(criteria=AcceptCriteria(max_step_time_s=0.5, min_tokens_per_s=4000.0))).status is PASS
    quit_ = probe_verdict(_probe(quit=True, exit_code="killed"))
    assert quit_.status is StageStatus.CANCELLED and not quit_.passed


# ------------------------------------------------------------------------------------------------------- evaluation
@pytest.mark.parametrize("facts, status", [
    (QualityFacts(True, 50.0, 40.0, None), PASS),
    (QualityFacts(True, 50.0, 50.0, None), FAIL),  # not lower
    (QualityFacts(True, 50.0, math.nan, None), FAIL),
    (QualityFacts(True, 50.0, None, None), FAIL),  # after not measured
    (QualityFacts(True, 50.0, 40.0, None, AcceptCriteria(min_improvement=0.25)), FAIL),  # 20 % < 25 %
    (QualityFacts(True, 50.0, 30.0, None, AcceptCriteria(min_improvement=0.25)), PASS),
    (QualityFacts(True, 50.0, 40.0, None, AcceptCriteria(max_perplexity=39.0)), FAIL),
    (QualityFacts(True, 50.0, 40.0, 0.30, AcceptCriteria(min_accuracy=0.3)), PASS),
    (QualityFacts(True, 50.0, 40.0, 0.29, AcceptCriteria(min_accuracy=0.3)), FAIL),
    (QualityFacts(True, 50.0, 40.0, None, AcceptCriteria(min_accuracy=0.3)), FAIL),  # asked for, not measured
    (QualityFacts(False, 50.0, None, None), PASS),  # inference: finite
    (QualityFacts(False, math.inf, None, None), FAIL),
])
def test_the_recipes_evaluation_rule(facts, status):
    assert evaluation_verdict(facts).status is status


@pytest.mark.parametrize("facts, status", [
    (MetricFacts(False, 3.0, 2.5), PASS), (MetricFacts(False, 3.0, 3.5), FAIL),
    (MetricFacts(True, 0.5, 0.6), PASS), (MetricFacts(True, 0.6, 0.5), FAIL),
    (MetricFacts(True, 0.6, 0.6), FAIL), (MetricFacts(False, 3.0, math.nan), FAIL),
    (MetricFacts(False, None, 2.5), FAIL), (MetricFacts(False, 3.0, None), FAIL),
])
def test_command_modes_evaluation_rule(facts, status):
    assert evaluation_verdict(facts).status is status


def test_a_stage_that_does_not_apply():
    for judge in (plan_verdict, evaluation_verdict, resume_verdict):
        judged = judge(NotApplicable("inference trains nothing"))
        assert judged.status is StageStatus.NOT_APPLICABLE and judged.passed


# ----------------------------------------------------------------------------------------------------------- resume
def _checks(**loss) -> tuple[CheckFact, ...]:
    """The loss check with ``loss``'s distance, noise and bound; the weights' with the same noise and bound."""
    weights = {k: v for k, v in loss.items() if k in ("noise", "bound")}
    return (CheckFact("kill", True), CheckFact("kill_point", True),
            CheckFact("loss", True, "tolerance", **loss), CheckFact("final_weights", True, "tolerance", **weights))


def _resume(**changes) -> ResumeFacts:
    base = ResumeFacts(_checks(), steps=(ComparedStep(3, 10.5, 10.5), ComparedStep(4, 10.4, 10.4)),
                       tier=("cpu-fp32-exact", 0.0))
    return dataclasses.replace(base, **changes)


def test_a_resume_passes_exactly_when_every_check_passed():
    assert resume_verdict(_resume()).status is PASS
    failed = resume_verdict(_resume(checks=(*_checks()[:3], CheckFact("final_weights", False, "tolerance"))))
    assert failed.status is FAIL and failed.reasons[0] == "failed: final_weights"
    assert resume_verdict(_resume(checks=())).status is FAIL


def test_a_passing_resume_must_hold_the_required_checks_and_its_kill_points_steps():
    assert resume_verdict(_resume(required=("kill", "loss"))).status is PASS
    missing = resume_verdict(_resume(required=("kill", "manifest")))
    assert missing.status is FAIL and "resume passes without the checks manifest" in missing.reasons
    assert resume_verdict(_resume(kill_steps=KillSteps(2, 3, 4, 6))).status is PASS
    assert resume_verdict(_resume(kill_steps=KillSteps(2, 5, 4, 6))).status is FAIL  # the kill after n
    assert resume_verdict(_resume(kill_steps=KillSteps(2, 3, 4, 3))).status is FAIL  # n past the last compared
    assert resume_verdict(_resume(kill_steps_expected=True)).status is FAIL  # a passing kill point, no steps
    assert resume_verdict(_resume()).status is PASS  # the recipe's record does not hold them


def test_a_passing_resume_lies_within_its_tier():
    # exact: no difference allowed, in a tolerance check or a compared step
    assert resume_verdict(_resume(checks=_checks(largest_difference=1e-7))).status is FAIL
    assert resume_verdict(_resume(steps=(ComparedStep(3, 10.5, 10.5 + 1e-6),))).status is FAIL
    # twin: within multiple x the twins' noise, each check computed again from the evidence the record keeps (schema 7:
    # pooled over the noise pairs of twin-1, the nudged twin-2 and the reference, which started alike)
    from core.stages.noise import Family, bound_tensor_rows, pooled_losses

    twin = RecordedRule("twin", multiple=4.0, loss_multiple=4.0, evidence_kept=True, pooled=True)
    kin = Family.of(2, with_reference=True)
    loss, _ = pooled_losses([(3, 10.5 + 3e-6, 10.5)], [[10.5, 10.5 + 1e-6, 10.5 + 2e-6]], kin, 4.0)
    weights = bound_tensor_rows([("w", 2e-6, 1.0, 1e-6, 1e-6, 0.0)], 4.0)
    weights = dataclasses.replace(weights, evidence={**weights.evidence, **kin.evidence()})
    checks = (CheckFact("kill", True), CheckFact("kill_point", True),
              CheckFact("loss", True, "tolerance", loss.distance, loss.noise, loss.bound, loss.evidence),
              CheckFact("final_weights", True, "tolerance", weights.distance, weights.noise, weights.bound,
                        weights.evidence))
    ok = _resume(rule=twin, checks=checks, steps=(ComparedStep(3, 10.5, 10.5 + 3e-6, twin=10.5 + 1e-6),),
                 tier=("cuda-bf16-twin-noise", 4.0))
    assert resume_verdict(ok).status is PASS, resume_verdict(ok).reasons
    assert resume_verdict(dataclasses.replace(ok, steps=(ComparedStep(3, 10.5, 10.5 + 9e-6),))).status is FAIL
    assert resume_verdict(dataclasses.replace(ok, checks=_checks(largest_difference=2e-6, noise=1e-6,
                                                                 bound=3e-6))).status is FAIL  # bound < 4 x noise
    # schema 6 (one twin from step 0; losses judged step by step by 16 x its largest difference): judged by its rule
    single = RecordedRule("twin", multiple=4.0, loss_multiple=16.0, evidence_kept=True)
    rows6 = {"losses": [[3, 10.5 + 3e-6, 10.5]], "noise_losses": [[10.5 + 1e-6, 10.5]]}
    distance, noise = (10.5 + 3e-6) - 10.5, (10.5 + 1e-6) - 10.5
    assert single.evidence_problems("loss", True, distance, noise, 16 * noise, rows6) == []
    assert single.evidence_problems("loss", True, distance, 2 * noise, 32 * noise, rows6) == [
        f"resume check loss: noise is {2 * noise}; its evidence gives {noise}",
        f"resume check loss: bound is {32 * noise}; its evidence gives {16 * noise}"]
    # a record before the evidence was kept (schema 5): a passing twin-tier check cannot be computed again
    old = resume_verdict(dataclasses.replace(ok, rule=RecordedRule("twin", multiple=4.0), checks=_checks(
        largest_difference=loss.distance, noise=loss.noise, bound=loss.bound)))
    assert old.status is FAIL and "cannot be computed again from a record written before schema 6" in old.reasons[0]
    # the criteria: an exact tier asked for, a twin tier judged
    exact = resume_verdict(dataclasses.replace(ok, criteria=AcceptCriteria(resume_tier="exact")))
    assert exact.status is FAIL and exact.criteria[0].met is False


# ---------------------------------------------------------------------------------------------------------- overall
def test_overall_is_pass_exactly_when_every_stage_passed_or_does_not_apply():
    assert overall_status([PASS, StageStatus.NOT_APPLICABLE, "pass"]) is PASS
    for other in (FAIL, StageStatus.ERROR, StageStatus.CANCELLED, StageStatus.NOT_RUN, "unknown"):
        assert overall_status([PASS, other]) is FAIL
    assert PASSING == {PASS, StageStatus.NOT_APPLICABLE} and PASS.passing and not StageStatus.NOT_RUN.passing


def test_stated_against_recomputed():
    stages = {"plan": "pass", "probe": "pass", "evaluation": "pass", "resume": "not_applicable"}
    computed = {"plan": PASS, "probe": PASS, "evaluation": PASS, "resume": StageStatus.NOT_APPLICABLE}
    prov = dict.fromkeys(stages, "measured")
    may = (StageStatus.NOT_RUN, StageStatus.FAIL)
    assert stated_problems(stages, computed, "pass", prov, may) == []
    assert stated_problems({**stages, "probe": "fail"}, computed, "fail", prov, may) == [
        "verdict.stages.probe says fail, its data says pass", "verdict.status says fail, the stages say pass"]
    # a table without a measurement: the stage cannot have passed; a plan recomputed not_run may say why
    assert stated_problems(stages, {**computed, "evaluation": None}, "pass", prov, may) == [
        "verdict.stages.evaluation says pass, but its table holds no measurement (provenance 'measured')"]
    assert stated_problems({**stages, "plan": "cancelled"}, {**computed, "plan": StageStatus.NOT_RUN}, "fail", prov,
                           may) == []


def test_a_missing_or_mistyped_value_is_named():
    with pytest.raises(RecordValueError, match=r"^probe\.devices\[0\]\.peak_bytes is missing$"):
        entry({"device": "cpu"}, "peak_bytes", "probe.devices[0]")
    with pytest.raises(RecordValueError, match=r"is True, not a number"):
        number(True, "resume.tier.multiple")
    with pytest.raises(RecordValueError, match=r"is 3.0, not a count"):
        count(3.0, "resume.comparison[0].step")
    assert number("nan", "x") != number("nan", "x") and number("-inf", "x") == -math.inf and count(0, "x") == 0
    assert isinstance(RecordValueError("x"), TypeError)  # verify reports it as a schema finding (record_problems)


# --------------------------------------------------------------------------------------------------- the round trips
@pytest.mark.parametrize("name", ["lora", "full", "inference", "qlora"])
def test_a_committed_record_read_back_as_facts_gives_the_verdicts_it_states(name):
    from core.methods import trains
    from core.record.readback import compared_peaks, probe_facts, quality_facts, resume_facts
    from core.record.verify import _plan_verdict, _resume_tier, criteria_of, recompute_verdicts
    from tests.records import committed

    rec = committed(name)
    crit = criteria_of(rec)
    training = trains(rec["spec"]["mode"])
    findings: list[str] = []
    capacity, _, planned = _plan_verdict(rec, findings)
    assert planned is not None
    judged = {"plan": plan_verdict(PlanFacts(planned, compared_peaks(rec), crit)),
              "probe": probe_verdict(probe_facts(rec, crit, capacity)),
              "evaluation": evaluation_verdict(quality_facts(rec, crit, training))}
    judged["resume"] = resume_verdict(resume_facts(rec, crit, _resume_tier(rec, findings, crit)) if training else
                                      NotApplicable())
    stated = rec["verdict"]["stages"]
    assert {k: v.status.value for k, v in judged.items()} == {k: stated[k]["status"] for k in judged}
    for stage, v in judged.items():  # the rows the record states are the engine's
        assert [r.to_row() for r in v.criteria] == stated[stage].get("criteria", []), stage
    assert overall_status(v.status for v in judged.values()).value == rec["verdict"]["status"]
    assert findings == [] and recompute_verdicts(rec) == []
    # and a verdict that does not follow from the same facts is named
    rec["verdict"]["stages"]["evaluation"]["status"] = "fail"
    assert "verdict.stages.evaluation says fail, its data says pass" in recompute_verdicts(rec)


def test_build_and_verify_judge_the_same_facts(tiny_model_dir, tmp_path):
    """Typed stage results -> the facts build judges -> the record (as TOML) -> the facts verify reads: the same facts,
    so the same verdicts; a record whose numbers say otherwise fails the same rule."""
    import datetime as dt

    from core.plan.fit import fit_verdicts
    from core.prerun import make_plan
    from core.record import build, readback, verify
    from core.spec import RunSpec
    from core.stages.noise import required_tier
    from core.stages.probe import DeviceMeasurement, ProbeResult, ProbeTiming, compare_with_plan
    from core.stages.resume import Check, ResumeResult, expected_checks
    from core.stages.train import EvalPoint, TrainEvalResult
    from tests.wizard_helpers import TEST_HOST

    spec = RunSpec.build(mode="lora", model=str(tiny_model_dir), seq_len=64, steps=6, resume_checkpoint_every=2,
                         resume_kill_after_checkpoint=1)
    ctx = make_plan(spec, [TEST_HOST])
    plan_dev = ctx.plan.devices[0]
    fit = fit_verdicts(ctx.plan)[0]
    m = DeviceMeasurement(device="cpu", weights_bytes=plan_dev.lines["weights"].bytes, gradients_bytes=0,
                          optimizer_states_bytes=0, peak_bytes=fit.bytes - plan_dev.lines["overhead"].bytes,
                          peak_method="tracked", peak_reserved_bytes=None, peak_rss_bytes=2 * fit.bytes,
                          rss_after_load_bytes=fit.bytes, parameters=ctx.plan.parameters.total,
                          trainable_parameters=ctx.plan.parameters.trainable, step_times_s=[2.0, 1.9, 0.42])
    per_step = spec.batch_size * spec.seq_len * spec.grad_accum
    probe = ProbeResult("pass", 3, 0.42, per_step / 0.42, [m], {}, [compare_with_plan(plan_dev, m, fit.bytes)],
                        "probe.log", "3 steps", timing=ProbeTiming(timed_steps=[3], timed_tracked=False,
                                                                   warmup_excluded=True, tracked_steps=[1, 2]))
    point = EvalPoint(math.exp(10.8), 10.8, 252, 4, 0.1)
    te = TrainEvalResult("pass", "lower", "perplexity", point, EvalPoint(math.exp(10.7), 10.7, 252, 4, 0.1), 2.5,
                         600.0, [{"step": 1, "epoch": 0.1, "learning_rate": 1e-3, "loss": 10.8}], {}, "", "", "")
    tier = required_tier("cpu", spec.dtype)
    c, end = spec.resume.kill_checkpoint_step(), spec.resume.compared_until(spec.steps)
    rows = [{"step": s, "learning_rate": 1e-3, "loss_reference": 10.0 - s / 10, "loss_resumed": 10.0 - s / 10,
             "difference": 0.0} for s in range(c + 1, end + 1)]
    evidence = {"losses": [[r["step"], r["loss_resumed"], r["loss_reference"]] for r in rows]}  # bit-exact, as kept

    def kept(name: str) -> dict:
        return evidence if name in ("loss", "reproducible") else {"tensors": [["w", 0.0]]}

    checks = [Check(n, "pass", "ok", kind=k, tier=tier.name, largest_difference=0.0 if k == "tolerance" else None,
                    bound=0.0 if k == "tolerance" else None, evidence_rows=kept(n) if k == "tolerance" else None)
              for n, k in expected_checks(spec.dtype).items()]
    resume = ResumeResult("pass", checks, checkpoint_step=c, kill_step=c + 1, killed_pgid=1, tier=tier,
                          comparison=rows, manifest={"adapter_model.safetensors": "0" * 64}, summary="passed",
                          compared_steps=(c + 1, end))
    now = dt.datetime(2026, 12, 5, tzinfo=dt.UTC)
    made = build.build_record(spec, run_dir=tmp_path, model={}, plan=ctx.plan, probe=probe, train_eval=te,
                              resume=resume, started=now, finished=now, env={})
    rec = tomllib.loads(tomli_w.dumps(made))  # the record as written and read back
    crit = verify.criteria_of(rec)
    capacity, _, planned = verify._plan_verdict(rec, [])
    assert planned is not None
    built = {"plan": build.plan_facts(spec, ctx.plan, probe, None), "probe": build.probe_facts(spec, ctx.plan, probe),
             "evaluation": build.quality_facts(spec, te), "resume": build.resume_facts(spec, resume)}
    read = {"plan": PlanFacts(planned, readback.compared_peaks(rec), crit),
            "probe": readback.probe_facts(rec, crit, capacity), "evaluation": readback.quality_facts(rec, crit, True),
            "resume": readback.resume_facts(rec, crit, verify._resume_tier(rec, [], crit))}
    assert built == read
    assert {k: v["status"] for k, v in rec["verdict"]["stages"].items()} == dict.fromkeys(built, "pass")
    assert verify.recompute_verdicts(rec) == []
    # a number the stage did not see the same way: the record says pass, the same rule over its facts says fail
    rec["resume"]["comparison"][0]["loss_resumed"] += 1e-3
    rec["resume"]["comparison"][0]["difference"] = abs(rec["resume"]["comparison"][0]["loss_resumed"]
                                                       - rec["resume"]["comparison"][0]["loss_reference"])
    found = verify.recompute_verdicts(rec)
    assert "verdict.stages.resume says pass, its data says fail" in found, found
    # and build judges the same facts the same way: a result whose check failed is a failed stage in the record
    failed = dataclasses.replace(resume, status="fail", checks=[dataclasses.replace(checks[0], status="fail"),
                                                                *checks[1:]])
    again = build.verdict(spec, ctx.plan, probe, te, failed)
    assert again["stages"]["resume"]["status"] == "fail" and again["status"] == "fail"


def test_a_probe_before_the_trace_is_recorded_against_the_plan_the_record_holds(tiny_model_dir, tmp_path):
    """The wizard's Ctrl+N on Plan before the traced plan arrives: the probe was judged against the analytic plan,
    the record holds the traced one (larger here). The record compares the probe with the fit it holds, as headless
    does (issue 51: such a record failed verify with "planned ... B, the plan says ..."); the rule is idempotent."""
    import datetime as dt

    from core.plan.fit import fit_verdicts
    from core.prerun import make_plan
    from core.record import build, verify
    from core.spec import RunSpec
    from core.stages.probe import DeviceMeasurement, ProbeResult, against_plan, judge_devices
    from tests.wizard_helpers import TEST_HOST

    spec = RunSpec.build(mode="dora", model=str(tiny_model_dir), seq_len=64, steps=6, resume_check=False)
    ctx = make_plan(spec, [TEST_HOST])
    dev = ctx.plan.devices[0]
    analytic = fit_verdicts(ctx.plan)[0].tensor_bytes
    m = DeviceMeasurement(device="cpu", weights_bytes=dev.lines["weights"].bytes, gradients_bytes=0,
                          optimizer_states_bytes=0, peak_bytes=analytic + 1000, peak_method="tracked",
                          peak_reserved_bytes=None, peak_rss_bytes=3 * analytic, rss_after_load_bytes=analytic,
                          parameters=ctx.plan.parameters.total, trainable_parameters=ctx.plan.parameters.trainable,
                          step_times_s=[0.5, 0.4, 0.4])
    comparisons, problems, findings, _ = judge_devices(spec, ctx.plan, None, [m])  # the trace had not arrived
    probe = ProbeResult("pass", 3, 0.4, 100.0, [m], {}, comparisons, "probe.log", "3 steps", problems=problems,
                        findings=[*findings, "slow link: none here"])
    traced = {"status": "estimated", "peak_bytes": analytic + 9_000_000}  # arrived after the probe started
    now = dt.datetime(2026, 12, 7, tzinfo=dt.UTC)

    def recorded(p: ProbeResult) -> dict:
        made = build.build_record(spec, run_dir=tmp_path, model={}, plan=ctx.plan, probe=p, train_eval=None,
                                  resume=None, started=now, finished=now, env={}, traced=traced)
        return tomllib.loads(tomli_w.dumps(made))

    stale = [p for p in verify.recompute_verdicts(recorded(probe)) if "plan_comparison" in p]
    assert stale and "the plan says" in stale[0], stale  # the record as the wizard wrote it before
    again = against_plan(probe, spec, ctx.plan, traced)
    rec = recorded(again)
    row = rec["probe"]["plan_comparison"][0]
    assert row["planned_bytes"] == analytic + 9_000_000 and row["measured_bytes"] == analytic + 1000
    assert not [p for p in verify.recompute_verdicts(rec) if "plan_comparison" in p]
    assert "slow link: none here" in again.findings and against_plan(again, spec, ctx.plan, traced) == again


def test_a_command_stage_ends_live_with_the_status_its_record_states(tmp_path):
    """One rule at one moment for command mode: a resume whose every check passed but that lacks checks a pass must
    hold ends live as the verdict engine judges its record's table (fail, the missing checks named), and the record
    states that status without a second word on it."""
    import datetime
    import sys
    from types import SimpleNamespace

    from core.command.record import build_command_record, judged_stage
    from core.command.resume import CommandResume
    from core.commandspec import CommandSpec
    from core.pipeline import judged
    from core.stages.compare import Check
    from core.stages.noise import required_tier

    spec = CommandSpec.from_dict({"train": f"{sys.executable} train.py --output_dir {{out}}", "workdir": str(tmp_path)})
    resume = CommandResume(StageStatus.PASS, "killed at step 3 after checkpoint 2", [
        Check("kill", StageStatus.PASS, "SIGKILL; no process of the job is left"),
        Check("kill_point", StageStatus.PASS, "killed when its metrics showed step 3: after checkpoint 2, before 4")],
        2, 4, 3, 6, required_tier("cpu", "fp32"))
    run = SimpleNamespace(spec=spec, run_dir=tmp_path, stopped={}, reference=None, criteria=AcceptCriteria(),
                          started=datetime.datetime(2026, 12, 8, tzinfo=datetime.UTC), results={"resume": resume})
    live = judged(resume, judged_stage(run, "resume"))
    assert live.status == StageStatus.FAIL and "; but " in live.summary and "checkpoint_selection" in live.summary
    run.results["resume"] = live
    stated = build_command_record(run, started=run.started, finished=run.started, env={})["verdict"]
    assert stated["stages"]["resume"]["status"] == "fail" and stated["status"] == "fail"
    assert stated["stages"]["resume"]["evidence"] == live.summary  # the stage's word is the record's: nothing to add
    assert judged(live, judged_stage(run, "resume")) == live  # judged again: the same
