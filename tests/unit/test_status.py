"""A stage's status is carried by its result or its stop (core/status.py), never read back from a message's words."""

from __future__ import annotations

from core.errors import GpuAcceptError, StageCancelled, StageError
from core.record.build import verdict
from core.spec import RunSpec
from core.status import StageStatus, Stopped


def test_an_exception_says_its_stop_by_its_class_not_its_words():
    assert Stopped.of(StageCancelled("probe: the child's group was killed")).status is StageStatus.CANCELLED
    # the word alone decided it before: an error whose message says "cancelled" is still an error
    assert Stopped.of(StageError("probe: cancelled? no: the child exited 1")).status is StageStatus.ERROR
    assert Stopped.of(GpuAcceptError("not run: anything")).status is StageStatus.ERROR
    assert str(StageStatus.NOT_APPLICABLE) == "not_applicable"  # the record's own string


def test_the_record_takes_each_stopped_stage_status_as_carried():
    spec = RunSpec.build(mode="lora")
    stopped = {"probe": Stopped(StageStatus.ERROR, "probe: the child was cancelled by the OOM killer, exit -9"),
               "train_eval": Stopped(StageStatus.CANCELLED, "train_eval: stopped"),
               "resume": Stopped(StageStatus.NOT_RUN, "resume: skipped")}
    stages = verdict(spec, None, None, None, None, stopped)["stages"]
    assert {k: v["status"] for k, v in stages.items()} == {"plan": "not_run", "probe": "error",
                                                            "evaluation": "cancelled", "resume": "not_run"}
    assert stages["probe"]["evidence"] == stopped["probe"].why
