"""core.killpoints is the one home of the kill-point rule: the child holds by it, the resume stage checks by it."""

from __future__ import annotations

import pytest

from core import killpoints
from core.protocol.events import KillPoint
from core.spec import RunSpec
from core.spectables import KILL_POINTS


def _trainer_order(steps: int, accum: int, every: int):
    """Where the child asks the kill switch, in Trainer's order: (global steps done, where, micro-batches done)."""
    for k in range(steps):
        yield k, "step_begin", 0
        for done in range(1, accum + 1):
            yield k, "micro", done
        yield k + 1, "step_end", accum
        if (k + 1) % every == 0:
            yield k + 1, "save", 0


@pytest.mark.parametrize("at", list(KILL_POINTS))
@pytest.mark.parametrize(("every", "accum"), [(1, 1), (4, 1), (4, 3), (10, 4)])
def test_the_first_place_the_child_holds_is_where_the_stage_expects_it(at, every, accum):
    from core.stages.resumechecks import kill_point_check

    spec = RunSpec.build(None, mode="lora", steps=4 * every + 2, grad_accum=accum, resume_checkpoint_every=every,
                         resume_kill_after_checkpoint=2, resume_kill_at=at)
    k = spec.resume.kill_step()
    held = next((step, where, done) for step, where, done in _trainer_order(spec.steps, accum, every)
                if killpoints.holds(at, k, step, where, done, accum))
    event = KillPoint(step=held[0], where=held[1], micro_done=held[2], micro_in_step=accum)
    check = kill_point_check(spec, event)
    assert check.status == "pass", (held, check.evidence)
    assert check.evidence.startswith(f"{at}: killed ")
    # where it held and where it was planned are said in the same words (issue 34: "after its first micro-batch"
    # planned, "after its only micro-batch's backward" reported, "micro 1" on the timeline, for one kill)
    said = killpoints.position(held[0], held[1], held[2], accum)
    assert said == killpoints.planned(at, k, accum) == killpoints.words(*killpoints.planned_point(at, k, accum), accum)
    assert killpoints.timeline_label(at, k, accum) == killpoints.planned(at, k, accum, short=True)
    assert said.startswith(killpoints.timeline_label(at, k, accum))
    # one step off is another place, and the stage says so with the plan in words
    from core.stages.resumechecks import planned_kill

    off = kill_point_check(spec, KillPoint(step=held[0] + 1, where=held[1], micro_done=held[2], micro_in_step=accum))
    assert off.status == "fail" and f"; planned {planned_kill(spec)}" in off.evidence


def test_the_kill_switch_writes_where_it_holds_and_holds(monkeypatch):
    from dataclasses import replace

    from core.child import callbacks
    from core.protocol.job import worker_job

    class Held(Exception):
        pass

    def sleep(_s):
        raise Held

    written = []
    monkeypatch.setattr(callbacks.time, "sleep", sleep)

    class Events:
        def write(self, event):
            written.append(event)

    class State:
        global_step = 25

    class FakeTrainer:
        state = State()
        micro = [([1], 1.0)]
        current_gradient_accumulation_steps = 4

    job = worker_job(RunSpec.build(), "train", "/model", "cpu", ["cpu"])
    switch = callbacks.KillSwitch(replace(job, role="interrupted", kill_at="boundary+1", kill_step=25), Events(), 4)
    switch.check(FakeTrainer(), "step_end")  # not here: returns
    assert written == []
    with pytest.raises(Held):
        switch.check(FakeTrainer(), "micro")
    assert written == [KillPoint(step=25, where="micro", micro_done=1, micro_in_step=4)]
    # every other role never holds
    callbacks.KillSwitch(replace(job, role="resumed"), Events(), 4).check(FakeTrainer(), "micro")
    assert len(written) == 1


def test_an_unknown_kill_point_never_holds_and_the_words_are_kept():
    assert not any(killpoints.holds("halfway", 5, s, w, 1, 1) for s in range(8) for w in ("micro", "step_end", "save"))
    assert killpoints.timeline_label("halfway", 7) == "at step 7"
    assert killpoints.timeline_label("boundary+1", 7, 1) == "inside step 8, after micro-batch 1 of 1"
    assert killpoints.describe("checkpoint-write", 30, 20) == (
        "while checkpoint-30 is written (weights saved, optimizer not: resume must take checkpoint-20)")
    assert killpoints.position(3, "save") == "while checkpoint-3 is written (weights saved, optimizer not)"
    assert list(KILL_POINTS) == ["boundary", "boundary-1", "boundary+1", "checkpoint-write"]
    assert set(killpoints.CHOICE_LABELS) == set(KILL_POINTS)


def test_one_wording_for_a_kill_point_planned_reported_and_on_the_timeline():
    """Issue 34: the same kill read "after its first micro-batch, before its optimizer step" (planned), "after its only
    micro-batch's backward, before its optimizer step" (reported) and "in step 26, micro 1" (timeline)."""
    assert killpoints.planned("boundary+1", 25, 1) == "inside step 26, after micro-batch 1 of 1, before its optimizer step"
    assert killpoints.position(25, "micro", 1, 1) == killpoints.planned("boundary+1", 25, 1)
    assert killpoints.timeline_label("boundary+1", 25, 1) == "inside step 26, after micro-batch 1 of 1"
    assert killpoints.describe("boundary+1", 25, 20, micro_in_step=4) == (
        "inside step 26, after micro-batch 1 of 4 (no optimizer step; checkpoint-20 written)")
    # without the count (the spec's own describe, which has no accumulation) the words are a prefix of the same
    assert killpoints.planned("boundary+1", 25, 4).startswith(killpoints.describe("boundary+1", 25, 20, short=True))
    # boundary-1 without accumulation holds before the step's only micro-batch; with 3, after 2 of them
    assert killpoints.planned("boundary-1", 25, 1) == killpoints.position(24, "step_begin", 0, 1) == (
        "inside step 25, before its first micro-batch")
    assert killpoints.planned("boundary-1", 25, 3) == (
        "inside step 25, after micro-batch 2 of 3, before its optimizer step")
