"""The one step-by-step resume comparison (core/stages/compare.py) on typed series built by hand: a resume that
continues the run passes, each kind of divergence fails the check that names it, and the recipe's resume stage and
command mode, which both call it, give the same checks for the same series."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core.command.reports import StepRecord
from core.command.resumechecks import compare_steps as command_compare_steps
from core.stages.checkpoint import safe_loading
from core.stages.compare import (
    COMMAND_RULES,
    RECIPE_RULES,
    Check,
    ResumeSeries,
    StepPoint,
    StepSeries,
    compare_series,
    verdict,
)
from core.stages.noise import Family, loss_multiple_for, required_tier
from core.stages.resumechecks import compare_steps as recipe_compare_steps

EXACT = required_tier("cpu", "fp32")
TWIN = required_tier("cuda:0", "bf16")
C, END = 4, 8  # resumed from checkpoint 4, compared up to step 8


def point(step: int, **change) -> StepPoint:
    """Step ``step`` of the run every series below starts from: a falling loss and schedule, two samples a step."""
    base = StepPoint(step=step, loss=3.0 - step * 0.01, learning_rate=1e-3 * (1 - step / 20),
                     sample_ids=(2 * step, 2 * step + 1), epoch=step / 10)
    return dataclasses.replace(base, **change)


def series(first: int, last: int, changes: dict[int, dict] | None = None, **all_steps) -> StepSeries:
    """Steps ``first`` .. ``last``; ``changes``: step -> the fields that step has otherwise; ``all_steps``: for every
    step."""
    return StepSeries.of(point(s, **{**all_steps, **(changes or {}).get(s, {})}) for s in range(first, last + 1))


def runs(resumed: StepSeries | None = None, interrupted: StepSeries | None = None, twin: StepSeries | None = None,
         reference: StepSeries | None = None, **kw) -> ResumeSeries:
    """The uninterrupted run 1-8, the interrupted one 1-5 (killed in step 6), the resumed one 5-8, unless given."""
    return ResumeSeries(reference=series(1, END) if reference is None else reference,
                        interrupted=series(1, C + 1) if interrupted is None else interrupted,
                        resumed=series(C + 1, END) if resumed is None else resumed, c=C,
                        expected=tuple((0, s) for s in range(C + 1, END + 1)),
                        twins=(twin,) if twin is not None else (),
                        family=Family.of(1, with_reference=True) if twin is not None else None, **kw)


def checks_of(found) -> dict[str, Check]:
    return {c.name: c for c in found.checks}


def failed(found) -> list[str]:
    return [c.name for c in found.checks if c.status != "pass"]


# ------------------------------------------------------------------------------------------- matching runs
def test_a_resume_that_continues_the_run_passes_every_step_check_in_order():
    found = compare_series(runs(), EXACT, RECIPE_RULES)
    assert [(c.name, c.status) for c in found.checks] == [
        ("global_steps", "pass"), ("reproducible", "pass"), ("epoch", "pass"), ("learning_rate", "pass"),
        ("sample_ids", "pass"), ("loss", "pass")]
    loss = checks_of(found)["loss"]
    assert loss.kind == "tolerance" and loss.tier == EXACT.name and loss.largest_difference == 0.0 and loss.bound == 0
    assert found.not_compared == []
    assert [r["step"] for r in found.rows] == [5, 6, 7, 8]
    assert found.rows[0] == {"step": 5, "learning_rate": point(5).learning_rate, "loss_reference": point(5).loss,
                             "loss_resumed": point(5).loss, "difference": 0.0}
    assert verdict(found.checks) == ("pass", [])


# ------------------------------------------------------------------------------------------- each divergence
def test_a_missing_resumed_step_fails_global_steps_naming_both_spans():
    found = compare_series(runs(resumed=series(C + 1, END - 1)), EXACT, RECIPE_RULES)
    assert failed(found) == ["global_steps"]
    assert checks_of(found)["global_steps"].evidence == "resumed steps 5-7; expected 5-8"


def test_a_step_logged_twice_fails_global_steps():
    twice = StepSeries.of([*series(C + 1, END).points, point(6)])
    assert failed(compare_series(runs(resumed=twice), EXACT, RECIPE_RULES)) == ["global_steps"]


def test_a_resumed_trainer_that_began_at_another_step_fails_global_steps():
    ok = compare_series(runs(resumed_trainer=True, trainer_start=C), EXACT, COMMAND_RULES)
    bad = compare_series(runs(resumed_trainer=True, trainer_start=0), EXACT, COMMAND_RULES)
    assert checks_of(ok)["global_steps"].status == "pass"
    assert failed(bad) == ["global_steps"] and "began at global step 0" in checks_of(bad)["global_steps"].evidence


@pytest.mark.parametrize("field, value, name", [
    ("learning_rate", 1e-3, "learning_rate"),  # the schedule restarted at its peak
    ("sample_ids", (0, 1), "sample_ids"),  # the data replayed from the start
    ("epoch", 0.0, "epoch"),
])
def test_an_exact_field_that_differs_after_the_resume_fails_its_check_at_its_step(field, value, name):
    found = compare_series(runs(resumed=series(C + 1, END, {7: {field: value}})), EXACT, RECIPE_RULES)
    assert failed(found) == [name]
    assert checks_of(found)[name].evidence.endswith("differs at steps 7")


def test_a_resumed_loss_is_bit_exact_on_the_cpu_and_bounded_by_the_twins_noise_on_cuda():
    """The twin is 2e-4 from the reference at step 6 and 3e-4 at step 8: the noise over the resumed steps 5-8 is the
    norm 3.6e-4 (one pair: the twin and the reference, which started alike), the bound the t quantile of one contrast
    x it (255: one draw of the noise says little of its spread). A resumed
    loss 0.9 x the bound away at step 7 passes; 1.1 x fails naming step 7; on the exact tier the first fails with its
    distance."""
    twin = series(1, END, {6: {"loss": point(6).loss + 2e-4}, 8: {"loss": point(8).loss - 3e-4}})
    noise = (2e-4 ** 2 + 3e-4 ** 2) ** 0.5
    LOSS_MULTIPLE = loss_multiple_for(1)  # noqa: N806 - the multiple of this family
    near = series(C + 1, END, {7: {"loss": point(7).loss + 0.9 * LOSS_MULTIPLE * noise}})
    far = series(C + 1, END, {7: {"loss": point(7).loss + 1.1 * LOSS_MULTIPLE * noise}})
    ok = checks_of(compare_series(runs(resumed=near, twin=twin), TWIN, RECIPE_RULES))["loss"]
    bad = checks_of(compare_series(runs(resumed=far, twin=twin), TWIN, RECIPE_RULES))["loss"]
    exact = checks_of(compare_series(runs(resumed=near), EXACT, RECIPE_RULES))["loss"]
    assert ok.status == "pass" and abs(ok.noise - noise) < 1e-9 and abs(ok.bound - LOSS_MULTIPLE * noise) < 1e-9
    assert 254 < LOSS_MULTIPLE < 255 and "(255 x the noise 0.000361 of 1 noise pair)" in ok.evidence
    assert bad.status == "fail" and "steps 7" in bad.evidence
    assert abs(bad.largest_difference - 1.1 * LOSS_MULTIPLE * noise) < 1e-6
    assert exact.status == "fail" and abs(exact.largest_difference - 0.9 * LOSS_MULTIPLE * noise) < 1e-6
    assert exact.bound == 0


def test_each_ranks_loss_is_judged_not_their_mean():
    """Two ranks whose losses moved in opposite directions keep the same mean: the loss check still fails."""
    ranks = {s: {"rank_losses": (point(s).loss, point(s).loss)} for s in range(1, END + 1)}
    reference = series(1, END, ranks)
    crossed = series(C + 1, END, {**{s: ranks[s] for s in range(C + 1, END + 1)},
                                  6: {"rank_losses": (point(6).loss - 0.1, point(6).loss + 0.1)}})
    found = compare_series(runs(reference=reference, resumed=crossed, interrupted=series(1, C + 1, ranks)), EXACT,
                           RECIPE_RULES)
    assert failed(found) == ["loss"] and abs(checks_of(found)["loss"].largest_difference - 0.1) < 1e-9
    fewer = series(C + 1, END, {s: ranks[s] for s in range(C + 1, END + 1) if s != 8})  # step 8: one rank only
    found = compare_series(runs(reference=reference, resumed=fewer, interrupted=series(1, C + 1, ranks)), EXACT,
                           RECIPE_RULES)
    assert failed(found) == ["loss"] and "other ranks than the reference's at steps 8" in checks_of(found)["loss"].evidence


def test_an_interrupted_run_that_is_another_run_fails_reproducible_naming_the_step():
    other = series(1, C + 1, {3: {"sample_ids": (9, 9)}})
    found = compare_series(runs(interrupted=other), EXACT, RECIPE_RULES)
    assert failed(found) == ["reproducible"]
    assert "at steps 3 (samples, learning rate or epoch)" in checks_of(found)["reproducible"].evidence
    drift = series(1, C + 1, {2: {"loss": point(2).loss + 0.5}})
    found = compare_series(runs(interrupted=drift), EXACT, COMMAND_RULES)
    assert failed(found) == ["reproducible"] and abs(checks_of(found)["reproducible"].largest_difference - 0.5) < 1e-9


def test_without_a_measured_noise_the_loss_and_reproducible_checks_fail_saying_why():
    short_twin = series(1, END - 1)  # the twin did not log step 8
    for twin, why in ((None, "no twin run to measure the noise with"),
                      (short_twin, "a twin run logged no loss at steps 8, so no noise bound could be measured")):
        found = compare_series(runs(twin=twin), TWIN, RECIPE_RULES)
        assert failed(found) == ["loss", "reproducible"]
        assert checks_of(found)["loss"].evidence == why == checks_of(found)["reproducible"].evidence


def test_what_a_users_metrics_do_not_hold_is_named_not_passed_and_the_recipe_requires_it():
    """Command mode compares a field where both runs logged it and names what neither logged; the recipe's child logs
    everything, so an interrupted run with no step to compare fails there."""
    bare = dict(learning_rate=None, sample_ids=None, epoch=None)
    found = compare_series(runs(reference=series(1, END, **bare), interrupted=series(1, C + 1, **bare),
                                resumed=series(C + 1, END, **bare)), EXACT, COMMAND_RULES)
    assert [c.name for c in found.checks] == ["global_steps", "reproducible", "loss"]
    assert [n.split(":")[0] for n in found.not_compared] == ["learning rate", "sample ids"]
    nothing_before = runs(interrupted=StepSeries())
    assert failed(compare_series(nothing_before, EXACT, RECIPE_RULES)) == ["reproducible"]
    found = compare_series(nothing_before, EXACT, COMMAND_RULES)
    assert failed(found) == [] and "reproducible" not in checks_of(found)
    assert found.not_compared == ["the interrupted run before the kill: it logged no step the uninterrupted run logged"]


def test_no_reference_at_all_is_one_failed_loss_check():
    found = compare_series(runs(reference=StepSeries()), EXACT, COMMAND_RULES)
    assert [(c.name, c.status) for c in found.checks] == [("loss", "fail")] and found.rows == []
    assert "command.metrics" in found.checks[0].evidence


# ------------------------------------------------------------------------------------------- both modes, one comparison
def command_view(c: Check) -> tuple:
    """A check without its words: what both modes must agree on."""
    return c.name, c.status, c.kind, c.tier, c.largest_difference, c.noise, c.bound


CASES = {
    "matching": {},
    "missing step": {"resumed": series(C + 1, END - 1)},
    "restarted schedule": {"resumed": series(C + 1, END, {6: {"learning_rate": 1e-3}})},
    "replayed data": {"resumed": series(C + 1, END, {5: {"sample_ids": (0, 1)}})},
    "loss off": {"resumed": series(C + 1, END, {8: {"loss": 9.0}})},
    "another run's checkpoint": {"interrupted": series(1, C + 1, {2: {"learning_rate": 0.5}})},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_both_modes_give_the_same_checks_for_the_same_series(case):
    """Without an epoch (a user's metrics hold none) the recipe's rules and command mode's give the same checks, the
    same statuses, tiers and distances; only the words are each mode's (the records keep them)."""
    kw = {k: StepSeries.of(dataclasses.replace(p, epoch=None) for p in v.points) for k, v in CASES[case].items()}
    no_epoch = dict(reference=series(1, END, epoch=None), interrupted=series(1, C + 1, epoch=None),
                    resumed=series(C + 1, END, epoch=None))
    both = runs(**{**no_epoch, **kw})
    recipe = [command_view(c) for c in compare_series(both, EXACT, RECIPE_RULES).checks if c.name != "epoch"]
    command = [command_view(c) for c in compare_series(both, EXACT, COMMAND_RULES).checks]
    assert recipe == command
    assert (case == "matching") == all(status == "pass" for _, status, *_ in command)


def as_dicts(s: StepSeries) -> list[dict]:
    return [{"step": p.step, "epoch": p.epoch, "learning_rate": p.learning_rate, "loss": p.loss,
             "sample_ids": list(p.sample_ids)} for p in s.points]


def as_records(s: StepSeries) -> list[StepRecord]:
    return [StepRecord(step=p.step, loss=p.loss, learning_rate=p.learning_rate, sample_ids=list(p.sample_ids))
            for p in s.points]


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_modes_compare_steps_is_the_shared_comparison_of_its_records(case):
    """The recipe's compare_steps (per-step dicts) and command mode's (StepRecords) return exactly what the shared
    comparison returns for the same steps as a typed series, words included."""
    r = runs(**CASES[case])
    recipe = recipe_compare_steps({d["step"]: d for d in as_dicts(r.reference)}, as_dicts(r.interrupted),
                                  as_dicts(r.resumed), C, END, EXACT)
    assert recipe == compare_series(r, EXACT, RECIPE_RULES).checks
    no_epoch = ResumeSeries(*(StepSeries.of(dataclasses.replace(p, epoch=None) for p in s.points)
                              for s in (r.reference, r.interrupted, r.resumed)), c=C, expected=r.expected)
    not_compared: list[str] = []
    command, rows = command_compare_steps(as_records(r.reference), as_records(r.interrupted), as_records(r.resumed),
                                          C, EXACT, not_compared)
    shared = compare_series(no_epoch, EXACT, COMMAND_RULES)
    assert (command, rows, not_compared) == (shared.checks, shared.rows, shared.not_compared)


def test_the_verdict_passes_only_a_non_empty_list_of_passed_checks():
    ok, bad = Check("a", "pass", ""), Check("b", "fail", "")
    assert verdict([ok, ok]) == ("pass", [])
    assert verdict([ok, bad]) == ("fail", [bad])
    assert verdict([]) == ("fail", [])


# ------------------------------------------------------------------------------------------- safe loading
class NotATensor:
    """An object a checkpoint pickle must never be allowed to rebuild (weights_only=True refuses it)."""

    def __reduce__(self):
        return (print, ("this would run on load",))


def test_a_trainer_checkpoint_leaves_training_args_unloaded_and_a_script_refuses_it(tmp_path):
    """One safe_loading check for both subjects (core/stages/checkpoint.py): under Trainer every pickle but
    training_args.bin, which Trainer never loads on resume (and the evidence says so); a script of its own may load
    it, so there it is refused. A refused optimizer fails both, named."""
    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    torch.save({"state": {}, "param_groups": []}, ckpt / "optimizer.pt")
    torch.save({"last_epoch": 4}, ckpt / "scheduler.pt")
    torch.save({"cpu": torch.get_rng_state()}, ckpt / "rng_state.pth")
    assert safe_loading(ckpt, trainer=True).status == "pass"
    torch.save({"x": NotATensor()}, ckpt / "training_args.bin")
    trainer = safe_loading(ckpt, trainer=True)
    assert trainer.status == "pass" and "training_args.bin, a pickle of TrainingArguments" in trainer.evidence
    script = safe_loading(ckpt, trainer=False)
    assert script.status == "fail" and script.evidence.startswith("training_args.bin: refused")
    (ckpt / "training_args.bin").unlink()
    torch.save({"state": {}, "param_groups": [], "extra": NotATensor()}, ckpt / "optimizer.pt")
    for trained_by_trainer in (True, False):
        refused = safe_loading(ckpt, trainer=trained_by_trainer)
        assert refused.status == "fail" and refused.evidence.startswith("optimizer.pt: refused")
