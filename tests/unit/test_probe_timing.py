"""Issue 34, first contact in a real terminal: the probe's speed is timed without the memory tracker's cost, the waits
before a child's first step are named, and the resume check's progress is proportional and monotonic."""

from __future__ import annotations

import copy
import os

import pytest

from core.child.probe import TRACKED_STEPS, Seen, step_timing
from core.criteria import speed_on
from core.events import FirstStepWait, Waiting, waiting_for
from core.protocol.events import (
    DataInfo,
    Evaluation,
    Ledger,
    ModelBuilt,
    Placement,
    ProbeStep,
    Started,
    Step,
    Trainable,
)
from core.spec import RunSpec
from core.stages.probe import ProbeTiming, probe_result, probe_timing
from core.stages.resume import CheckWork

# ------------------------------------------------------------------------------------------- the probe's speed


def test_the_speed_is_the_untracked_steps_after_the_warm_up():
    """The user's probe said 63.67 s/step (every step under the tracker) while training ran at 10-13 s/step."""
    assert TRACKED_STEPS == 2
    got = step_timing([5.0, 4.0, 1.0, 2.0], tracked_steps=[1, 2])
    assert got == {"timed_steps": [3, 4], "step_time_s": 1.5, "tracked_step_time_s": 4.0}
    # CUDA: no tracker, every step after the warm-up is timed
    assert step_timing([5.0, 1.0, 2.0], tracked_steps=[]) == {
        "timed_steps": [2, 3], "step_time_s": 1.5, "tracked_step_time_s": None}
    # probe_steps = 2 on the CPU: no untracked step ran, so the tracked step after the warm-up is timed (and says so)
    assert step_timing([5.0, 4.0], tracked_steps=[1, 2]) == {
        "timed_steps": [2], "step_time_s": 4.0, "tracked_step_time_s": 4.0}
    # one step: timed by itself, the warm-up included
    assert step_timing([5.0], tracked_steps=[1]) == {"timed_steps": [1], "step_time_s": 5.0, "tracked_step_time_s": 5.0}


def test_only_the_first_steps_run_under_the_tracker_and_each_step_says_so():
    class Events:
        def __init__(self):
            self.written = []

        def write(self, event):
            self.written.append(event)

    events = Events()
    seen = Seen(tracker=object())
    assert [seen.tracks(s) for s in (1, 2, 3, 4)] == [True, True, False, False]
    for step in (1, 2, 3):
        seen.step_done(0.5, step, 3, events, tracked=seen.tracks(step))
    assert seen.tracked_steps == [1, 2]
    assert [(e.step, e.tracked) for e in events.written] == [(1, True), (2, True), (3, False)]
    assert not Seen(tracker=None).tracks(1)  # CUDA: the allocator's counters, no tracker


def _ledger(rank: int = 0, times: tuple[float, ...] = (6.0, 5.0, 0.5, 0.7), tracked: tuple[int, ...] = (1, 2),
            spec: RunSpec | None = None) -> Ledger:
    from core.child.probe import step_timing

    timing = step_timing(list(times), list(tracked))
    tokens = spec.batch_size * spec.seq_len * spec.grad_accum if spec is not None else 256
    return Ledger(device="cpu", host="h", global_rank=rank, world_size=1, node_rank=0, weights_bytes=100,
                  weights_loaded_bytes=100, gradients_bytes=10, optimizer_states_bytes=20,
                  step_time_s=timing["step_time_s"], tokens_per_s=tokens / timing["step_time_s"], steps=len(times),
                  rss_start_bytes=1, rss_after_load_bytes=2, peak_rss_bytes=3_000_000, wrapper="none", torch_threads=2,
                  peak_tracked_tensor_bytes=1_000_000, tracked_method="tracked", step_times_s=list(times),
                  tracked_steps=list(tracked), timed_steps=timing["timed_steps"],
                  tracked_step_time_s=timing["tracked_step_time_s"])


def test_the_probe_says_how_it_timed_and_its_criteria_judge_the_untracked_figure(tiny_model_dir):
    from core.prerun import make_plan
    from tests.wizard_helpers import TEST_HOST

    # 2 s per step: the untracked steps (0.6 s) meet it, the tracked one (5.0 s) would not
    spec = RunSpec.build(mode="lora", model=str(tiny_model_dir), seq_len=64, steps=6, resume_checkpoint_every=2,
                         resume_kill_after_checkpoint=1, accept_max_step_time_s=2.0)
    plan = make_plan(spec, [TEST_HOST]).plan
    ledger = _ledger(spec=spec)
    result = probe_result(spec, [], [ledger], plan, None, "cpu", "log")
    assert result.step_time_s == pytest.approx(0.6)
    assert result.timing == ProbeTiming(timed_steps=[3, 4], timed_tracked=False, warmup_excluded=True,
                                        tracked_steps=[1, 2], tracked_step_time_s=5.0)
    (row,) = [j for j in result.judgements if j.criterion == "max_step_time_s"]
    assert (row.value, row.met, row.on) == (pytest.approx(0.6), True, "the probe's untracked steps 3–4")
    assert result.status == "pass"
    # the line the screen and the headless summary show
    assert "0.60 s/step (steps 3–4 untracked, warm-up step 1 left out; steps 1–2 tracked for memory: 5.00 s at " \
           "step 2)" in result.summary
    assert result.devices[0].step_times_s == [6.0, 5.0, 0.5, 0.7]


def test_the_words_say_when_the_timed_steps_were_tracked_or_the_warm_up_counted():
    tracked = ProbeTiming(timed_steps=[2], timed_tracked=True, warmup_excluded=True, tracked_steps=[1, 2],
                          tracked_step_time_s=4.0)
    assert tracked.words(4.0) == "4.00 s/step (step 2 tracked for memory, warm-up step 1 left out)"
    alone = ProbeTiming(timed_steps=[1], timed_tracked=False, warmup_excluded=False, tracked_steps=[])
    assert alone.words(0.25) == "0.25 s/step (step 1 untracked, the warm-up included: the only step)"
    cuda = ProbeTiming(timed_steps=[2, 3], timed_tracked=False, warmup_excluded=True, tracked_steps=[])
    assert cuda.words(0.1) == "0.10 s/step (steps 2–3 untracked, warm-up step 1 left out)"
    assert speed_on([2], True) == "the probe's tracked step 2"


def test_the_slowest_rank_sets_the_timing_and_old_ledgers_do_not_say():
    fast, slow = _ledger(0, (6.0, 5.0, 0.5, 0.5)), _ledger(1, (6.0, 5.5, 0.9, 0.9))
    timing = probe_timing([fast, slow])
    assert timing is not None and timing.tracked_step_time_s == 5.5 and timing.timed_steps == [3, 4]
    old = Ledger(**{**_ledger().__dict__, "timed_steps": None, "tracked_steps": None})
    assert probe_timing([old]) is None


# --------------------------------------------------------------------------------------- gpuaccept verify


def _timed_record():
    """The committed LoRA record with the probe's timing as the probe now writes it: tracked steps 1-2 slow, 3 fast."""
    from tests.records import committed

    rec = committed("lora")
    spec = rec["spec"]
    per_step = spec["batch_size"] * spec["seq_len"] * spec["grad_accum"]
    rec["probe"]["devices"][0]["step_times_s"] = [3.0, 2.0, 0.5]
    rec["probe"]["timing"] = {"method": "wall-clock", "timed_steps": [3], "timed_tracked": False,
                              "warmup_excluded": True, "tracked_steps": [1, 2], "tracked_step_time_s": 2.0}
    rec["probe"]["step_time_s"] = 0.5
    rec["probe"]["tokens_per_s"] = per_step / 0.5
    return rec


def test_verify_recomputes_the_speed_from_the_untracked_steps():
    from core.record.readback import probe_speed
    from core.record.shape import schema_problems

    rec = _timed_record()
    assert schema_problems(rec) == []
    step_s, tokens_s, on, problems = probe_speed(rec)
    assert (step_s, on, problems) == (0.5, "the probe's untracked step 3", [])
    # a record that judged the tracked figure instead is caught, and the untracked one is what is judged
    tracked = copy.deepcopy(rec)
    tracked["probe"]["step_time_s"] = 2.0
    step_s, _, _, problems = probe_speed(tracked)
    assert step_s == 0.5 and any("probe.step_time_s is 2.0" in p for p in problems), problems
    # timed steps that were tracked while an untracked one ran
    wrong = copy.deepcopy(rec)
    wrong["probe"]["timing"].update(timed_steps=[2, 3], timed_tracked=True)
    step_s, _, on, problems = probe_speed(wrong)
    assert step_s == 0.5 and on == "the probe's untracked step 3"
    assert any("timed on tracked step(s) [2]" in p for p in problems), problems
    # the yes/no facts must say what the steps say
    said = copy.deepcopy(rec)
    said["probe"]["timing"]["warmup_excluded"] = False
    assert any("warmup_excluded is False" in p for p in probe_speed(said)[3])
    # a record written before the timing is judged on its figure, as it was
    old = copy.deepcopy(rec)
    del old["probe"]["timing"]
    assert probe_speed(old)[2:] == (None, [])


def test_verify_judges_max_step_time_on_the_untracked_figure():
    from core.criteria import AcceptCriteria
    from core.record.readback import judgements_of

    rec = _timed_record()
    rows = judgements_of(rec, AcceptCriteria(max_step_time_s=1.0), {"cpu": 64 * 2**30}, training=True)["probe"]
    (row,) = [r for r in rows if r.criterion == "max_step_time_s"]
    assert (row.value, row.met, row.on) == (0.5, True, "the probe's untracked step 3")


def test_the_schema_holds_the_timing_to_its_kinds():
    from core.record.schema import value_problems

    rec = _timed_record()
    rec["probe"]["timing"]["timed_steps"] = [3.5]
    rec["probe"]["timing"]["timed_tracked"] = "no"
    rec["probe"]["devices"][0]["step_times_s"] = [-1.0, 2.0, 0.5]
    found = value_problems(rec)
    assert any("probe.timing.timed_steps[0]" in p for p in found), found
    assert any("probe.timing.timed_tracked" in p for p in found), found
    assert any("probe.devices[0].step_times_s[0]" in p for p in found), found


# ----------------------------------------------------------------------------------- the wait before step 1


def test_each_phase_before_the_first_step_is_named():
    probe = [waiting_for(e, "probe", tracked=True) for e in (
        None, Started(role="probe", pid=1, pgid=1, device="cpu", torch="2", host="h"),
        ModelBuilt(attention="sdpa", parameter_dtypes={}), _data(), Placement(devices={}))]
    assert probe == ["starting (importing torch and transformers)", "loading the model", "preparing the data",
                     "placing the model", "running its first step (tracked for memory: slower than the steps after it)"]
    assert waiting_for(_data(), "train") == "evaluating the held-out text before training"
    assert waiting_for(Evaluation(when="before", perplexity=2.0, mean_nll=0.7, nll_sum=7.0, tokens=10, blocks=1,
                                  seconds=1.0, metric="ppl"), "train") == "building the trainer"
    assert waiting_for(Trainable(names=[], parameters=1), "resumed", resumes=True) == (
        "loading the checkpoint and running its first step")
    assert waiting_for(Placement(devices={}), "train") is None


def _data() -> DataInfo:
    return DataInfo(train_documents=1, heldout_documents=1, train_blocks=1, heldout_blocks=1,
                    heldout_blocks_evaluated=1, heldout_selection="all", train_hash="a", heldout_hash="b",
                    split_method="m", disjoint_check="c")


def test_the_wait_is_said_until_the_first_step_then_never():
    wait = FirstStepWait("probe", "probe", 1234, "probe")
    first = wait.started()
    assert first.line(first.since + 12.4) == "probe: starting (importing torch and transformers) in child 1234… 12 s"
    loaded = wait.see(Started(role="probe", pid=1234, pgid=1234, device="cpu", torch="2", host="h"))
    assert isinstance(loaded, Waiting) and loaded.what == "loading the model" and loaded.since == first.since
    assert wait.see(ProbeStep(step=1, total=3, seconds=1.0)) is None
    assert wait.see(ModelBuilt(attention="sdpa", parameter_dtypes={})) is None  # after a step: nothing more
    other = FirstStepWait("resume", "twin", 7, "twin")
    assert other.see(Started(role="twin", pid=7, pgid=7, device="cpu", torch="2", host="h", rank=1, local_rank=1)) \
        is None  # another rank than this node's first says nothing
    assert other.see(Step(step=1, epoch=0.1, learning_rate=None, loss=1.0, sample_ids=[])) is None


def test_the_evaluation_after_training_is_said_with_its_blocks_and_its_own_seconds():
    """Issue 51: after the last step the Evaluate screen sat at 100 % for minutes with no word (the evaluation after
    training). Training's end starts a wait timed from then; each evaluation's blocks are said as they go."""
    from core.protocol.events import EvalProgress, Trained

    wait = FirstStepWait("train_eval", "train", 99, "train")
    before = wait.see(EvalProgress(when="before", done=8, total=32))
    assert before is not None and before.what == "evaluating the held-out text before training: 8 of 32 blocks"
    assert before.since == wait.since
    assert wait.see(Step(step=1, epoch=0.1, learning_rate=None, loss=1.0, sample_ids=[])) is None
    ended = wait.see(Trained(seconds=3.0, global_step=8, output_dir="out"))
    assert ended is not None and ended.what == "evaluating the held-out text after training"
    assert ended.since > wait.since
    after = wait.see(EvalProgress(when="after", done=16, total=32))
    assert after is not None and after.since == ended.since
    assert after.line(after.since + 40.2) == ("train: evaluating the held-out text after training: 16 of 32 blocks in "
                                              "child 99… 40 s")
    fixed = FirstStepWait("train_eval", "train", 5, "evaluate").see(EvalProgress(when="before", done=1, total=4))
    assert fixed is not None and fixed.what == "evaluating the held-out text: 1 of 4 blocks"  # inference: no "training"


def test_an_evaluation_writes_its_blocks_as_it_goes_at_most_once_a_second():
    from core.child.worker import eval_progress_writer

    written: list = []
    writer = type("W", (), {"write": lambda self, e: written.append(e)})()
    on_batch = eval_progress_writer(writer, "after", every_s=3600)
    for done in (4, 8, 12, 16):
        on_batch(done, 16)
    assert [(e.when, e.done, e.total) for e in written] == [("after", 4, 16)]  # the first; the last is the result's
    on_each = eval_progress_writer(writer, "before", every_s=0)
    for done in (4, 8, 16):
        on_each(done, 16)
    assert [e.done for e in written[1:]] == [4, 8]


# ------------------------------------------------------------------------------------ the resume check's bar


@pytest.mark.parametrize("twins", [0, 2])
def test_the_resume_bar_is_the_steps_trained_over_every_run_and_never_goes_back(twins):
    """It jumped 48 % -> 85 % (and 29 -> 48 -> 100): the interrupted run starts at step 11 of 26 and the resumed run at
    21 of 30, so each run's own fraction started high."""
    spec = RunSpec.build(mode="lora", steps=30, resume_checkpoint_every=10, resume_kill_after_checkpoint=2)
    work = CheckWork.of(spec, twins=twins)
    twin_steps = 20 * twins  # each from the interrupted run's start (checkpoint 10) to the last compared step (30)
    assert work.total == twin_steps + (26 - 10) + (30 - 20)
    order = [(f"twin-{i}", s) for i in range(1, twins + 1) for s in range(11, 31)] + [
        ("interrupted", s) for s in range(11, 26)] + [("resumed", s) for s in range(21, 31)]
    seen = [work.progress(run, step) for run, step in order]
    done = [p.work_done for p in seen]
    assert all(b > a for a, b in zip(done, done[1:])), done  # every step moves the bar forward
    assert done[-1] == work.total and all(p.work_total == work.total for p in seen)
    first_interrupted = next(p for p in seen if p.run == "interrupted")
    assert first_interrupted.work_done == twin_steps + 1  # step 11 of a run that started after 10: one step done
    first_resumed = next(p for p in seen if p.run == "resumed")
    assert first_resumed.work_done == twin_steps + 16 + 1  # the killed step 26 counted in the interrupted run's share
    assert first_resumed.part == (twins + 2, twins + 2) and first_interrupted.step == 11
    assert first_interrupted.total == 26


def test_the_resume_screen_draws_the_work_and_names_the_run_among_the_runs():
    from tui.screens.stages import ResumeScreen, progress_text

    spec = RunSpec.build(mode="lora", steps=30, resume_checkpoint_every=10, resume_kill_after_checkpoint=2)
    work = CheckWork.of(spec, twins=2)
    screen = ResumeScreen()
    assert screen.bar_progress(work.progress("interrupted", 11)) == (66.0, 41.0)
    line = progress_text(work.progress("interrupted", 11, loss=1.5), spec)
    assert line == ("interrupted run (3 of 4): step 11 of 26 (to be SIGKILLed inside step 26, after micro-batch 1 of 1, "
                    "before its optimizer step), loss 1.5000")
    assert progress_text(work.progress("twin-2", 14), spec) == "twin-2 run (2 of 4): step 14 (of 30)"


def test_the_one_time_conversion_says_it_runs_every_second(tmp_path, monkeypatch):
    """Issue 51: the embedded model's conversion (83 s) showed "--%" with no elapsed time. It is a wait: said as it
    starts and every second, with the child's pid; a failed one names its log."""
    import core.prerun as pipeline
    from core.errors import StageError

    monkeypatch.setattr(pipeline, "CONVERT_CODE", "import time; time.sleep(1.6)")
    waits = list(pipeline.convert_in_child(tmp_path / "convert.log"))
    assert 2 <= len(waits) <= 3 and all(isinstance(w, Waiting) and w.what == pipeline.CONVERTING for w in waits)
    assert len({w.since for w in waits}) == 1 and waits[0].run == "model"
    monkeypatch.setattr(pipeline, "CONVERT_CODE", "raise SystemExit(3)")
    with pytest.raises(StageError, match="convert.log"):
        pipeline.convert_blocking(tmp_path / "convert.log")


def test_a_stopped_stage_child_is_named_and_killed_within_seconds(tmp_path, monkeypatch):
    """Issue 52: a stage child stopped with SIGSTOP was waited on for 120 s showing "loading the model". A child in
    state T for STOPPED_CHILD_S is named (its pid, the signal it likely got, its log) and its group killed."""
    import signal
    import subprocess
    import sys
    import time

    from core.errors import StageError
    from core.stages import childproc

    monkeypatch.setattr(childproc, "STOPPED_CHILD_S", 0.5)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    child = childproc.ChildJob("probe", tmp_path, job=None, proc=proc)  # type: ignore[arg-type]
    assert not childproc.process_stopped(proc.pid)
    os.kill(proc.pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(StageError, match=rf"probe: child {proc.pid} was stopped \(state T: SIGSTOP or SIGTSTP\?\)"):
        list(childproc.watch(child))
    assert time.monotonic() - started < 5 and proc.wait(timeout=10) == -signal.SIGKILL
