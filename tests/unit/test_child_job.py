"""The job a stage child is handed (core/protocol/job.py): one typed job per kind of child, built once, written as
``job.json`` and read back once by the child.

Each stage's job is caught where the stage starts its child (``start_child`` replaced by one that keeps the job and
stops the stage), so these tests start no process: the JSON each stage writes has exactly the keys and values the
stages wrote before the job was typed, and the child reads it back unchanged; a file that is no job names its key.
"""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from core.protocol.job import EvalJob, JobFormatError, WorkerJob, worker_job
from core.spec import RunSpec

#: every key the worker child read from its job before the job was typed (core/child/*: job["..."], job.get("..."))
WORKER_KEYS = {"role", "spec", "model_path", "device", "devices", "events", "output_dir", "save_total_limit",
               "stop_after_step", "save_steps", "resume_from", "manifest", "kill_step", "kill_at", "kill_node", "device_map",
               "nudge"}
#: every key command mode's evaluation child read (core/child/checkpoint_eval.py), and the two start_child adds
EVAL_KEYS = {"checkpoint", "base", "data", "heldout_fraction", "seq_len", "max_blocks", "batch_size", "events",
             "output_dir"}


class Started(Exception):
    """Raised by the stand-in ``start_child`` once it holds the job: the stage goes no further."""


def catch_job(monkeypatch: pytest.MonkeyPatch, module: Any) -> dict[str, Any]:
    """Replace ``module.start_child`` by one that keeps the job as the real one writes it (placed in its job
    directory) and raises :class:`Started`; the dict it fills has ``job`` (the typed job) and ``text`` (job.json)."""
    caught: dict[str, Any] = {}

    def start_child(name: str, job_dir: Path, job: Any, launch: Any = None, module: str = "") -> Any:
        placed = job.placed(str(job_dir / "events.jsonl"), str(job_dir / "output"))
        caught.update(job=placed, text=placed.to_json(), module=module)
        raise Started

    monkeypatch.setattr(module, "start_child", start_child)
    return caught


def run_until_started(gen: Any) -> None:
    with pytest.raises(Started):
        for _ in gen:
            pass


def spec(**kw: Any) -> RunSpec:
    return RunSpec.build(steps=8, resume_checkpoint_every=2, resume_kill_after_checkpoint=2, **kw)


def old_base(s: RunSpec, tmp_path: Path, devices: list[str] | None = None) -> dict[str, Any]:
    """The resume check's base job as the stage built it before (a dict spread into each run's)."""
    return {"spec": s.to_dict(), "model_path": str(tmp_path / "model"), "device": "cpu", "devices": devices or ["cpu"],
            "save_total_limit": None}


def placed(job_dir: Path) -> dict[str, str]:
    return {"events": str(job_dir / "events.jsonl"), "output_dir": str(job_dir / "output")}


# ----------------------------------------------------------------------------------- what each stage writes
def test_the_probe_writes_the_job_it_always_wrote_byte_for_byte(monkeypatch, tmp_path):
    import core.stages.probe

    caught = catch_job(monkeypatch, core.stages.probe)
    s = spec()
    run_until_started(core.stages.probe.run_probe(s, tmp_path / "model", tmp_path / "probe", "cpu", plan=None))
    old = {"role": "probe", "spec": s.to_dict(), "model_path": str(tmp_path / "model"), "device": "cpu",
           "devices": ["cpu"], **placed(tmp_path / "probe")}
    assert caught["text"] == json.dumps(old, indent=2)  # the same keys, values and order: no save_total_limit
    assert WorkerJob.from_json(caught["text"]) == caught["job"]


@pytest.mark.parametrize("mode, role", [("lora", "train"), ("inference", "evaluate")])
def test_train_and_evaluate_write_the_job_they_always_wrote_byte_for_byte(monkeypatch, tmp_path, mode, role):
    import core.stages.train

    caught = catch_job(monkeypatch, core.stages.train)
    s = spec() if mode == "lora" else RunSpec.build(mode="inference", steps=0)
    run_until_started(core.stages.train.run_train_eval(s, tmp_path / "model", tmp_path / "train", "cpu"))
    old = {"role": role, "spec": s.to_dict(), "model_path": str(tmp_path / "model"), "device": "cpu",
           "devices": ["cpu"], "save_total_limit": None, **placed(tmp_path / "train")}
    assert caught["text"] == json.dumps(old, indent=2)
    assert WorkerJob.from_json(caught["text"]) == caught["job"]


def test_the_twin_writes_the_keys_and_values_it_always_wrote(monkeypatch, tmp_path):
    import core.stages.resume

    caught = catch_job(monkeypatch, core.stages.resume)
    s = spec(resume_noise="twin")  # the twins run first, from where the interrupted run starts
    begin = s.resume.interrupted_start()
    reference = type("Reference", (), {"output_dir": str(tmp_path / "train" / "output")})()
    if begin:
        (tmp_path / "train" / "output" / f"checkpoint-{begin}").mkdir(parents=True)
    run_until_started(core.stages.resume.run_resume_check(s, tmp_path / "model", tmp_path, "cpu", reference))
    end = s.resume.compared_until(s.steps)
    first = ({"resume_from": str(tmp_path / "resume-twin-1" / "output" / f"checkpoint-{begin}")} if begin else {})
    old = {**old_base(s, tmp_path), "role": "twin", "stop_after_step": end, "save_steps": end, **first,
           **placed(tmp_path / "resume-twin-1")}
    assert json.loads(caught["text"]) == old  # the same keys and values (the order of keys is the job's own)
    assert WorkerJob.from_json(caught["text"]) == caught["job"]


@pytest.mark.parametrize("start", ["checkpoint", "start"])
def test_the_interrupted_run_writes_the_keys_and_values_it_always_wrote(monkeypatch, tmp_path, start):
    import core.stages.resume

    caught = catch_job(monkeypatch, core.stages.resume)
    s = spec(resume_interrupted_from=start)  # on the CPU no twin: the interrupted run is the first child
    begin = s.resume.interrupted_start()
    reference = type("Reference", (), {"output_dir": str(tmp_path / "train" / "output")})()
    if begin:
        (tmp_path / "train" / "output" / f"checkpoint-{begin}").mkdir(parents=True)
    run_until_started(core.stages.resume.run_resume_check(s, tmp_path / "model", tmp_path, "cpu", reference))
    first = ({"resume_from": str(tmp_path / "resume-interrupted" / "output" / f"checkpoint-{begin}")}
             if begin else {})
    old = {**old_base(s, tmp_path), **first, "role": "interrupted", "kill_step": s.resume.kill_step(),
           "kill_at": s.resume.kill_at, **placed(tmp_path / "resume-interrupted")}
    assert json.loads(caught["text"]) == old
    assert WorkerJob.from_json(caught["text"]) == caught["job"]


def test_the_resumed_run_writes_the_keys_and_values_it_always_wrote(monkeypatch, tmp_path):
    import core.stages.resume

    caught = catch_job(monkeypatch, core.stages.resume)
    s = spec()
    ckpt, manifest = tmp_path / "resume-interrupted" / "output" / "checkpoint-4", tmp_path / "manifest.json"
    job = replace(worker_job(s, "train", tmp_path / "model", "cpu", ["cpu"]), resume_from=str(ckpt),
                  manifest=str(manifest))  # as run_resume_check hands it over
    run_until_started(core.stages.resume.run_resumed(s, tmp_path, job, core.stages.resume.SINGLE))
    old = {**old_base(s, tmp_path), "resume_from": str(ckpt), "manifest": str(manifest), "role": "resumed",
           "stop_after_step": s.resume.compared_until(s.steps), **placed(tmp_path / "resume-resumed")}
    assert json.loads(caught["text"]) == old
    assert WorkerJob.from_json(caught["text"]) == caught["job"]


def test_command_modes_evaluation_writes_the_job_it_always_wrote_byte_for_byte(monkeypatch, tmp_path):
    import core.command.evaluate
    from core.commandspec import CommandSpec
    from core.stages.checkpoint import Checkpoint

    caught = catch_job(monkeypatch, core.command.evaluate)
    cs = CommandSpec(train="python train.py", eval_max_blocks=8)
    final = Checkpoint(step=6, path=tmp_path / "out" / "checkpoint-6")
    run_until_started(core.command.evaluate.evaluate_stage(cs, final, "/base", 64, tmp_path / "evaluation"))
    old = {"checkpoint": str(final.path), "base": "/base", "data": cs.data, "heldout_fraction": cs.heldout_fraction,
           "seq_len": 64, "max_blocks": 8, "batch_size": 4, **placed(tmp_path / "evaluation")}
    assert caught["module"] == "core.child.checkpoint_eval"
    assert caught["text"] == json.dumps(old, indent=2)
    assert EvalJob.from_json(caught["text"]) == caught["job"]


# ----------------------------------------------------------------------------------- the job and its JSON
def full_job(tmp_path: Path) -> WorkerJob:
    """A job with every key given a value (as no stage writes it: each role has some)."""
    return replace(worker_job(spec(), "train", tmp_path / "model", "cpu", ["cpu:0", "cpu:1"]), role="interrupted",
                   save_total_limit=2, resume_from="/ckpt", manifest="/m.json", stop_after_step=6, save_steps=2,
                   kill_step=5, kill_at="boundary", kill_node=1, device_map={"": "cpu"}, events="/e.jsonl", output_dir="/out",
                   nudge=True)


def test_the_json_keys_are_exactly_the_ones_the_child_read():
    assert {f.name for f in fields(WorkerJob)} == WORKER_KEYS
    assert {f.name for f in fields(EvalJob)} == EVAL_KEYS


def test_a_job_round_trips_through_json_unchanged(tmp_path):
    job = full_job(tmp_path)
    assert set(json.loads(job.to_json())) == WORKER_KEYS
    assert WorkerJob.from_json(job.to_json()) == job
    (tmp_path / "job.json").write_text(job.to_json(), encoding="utf-8")
    assert WorkerJob.read(tmp_path / "job.json") == job  # what the child does with its argument
    ev = EvalJob(checkpoint="/c", base="", data="embedded", heldout_fraction=0.2, seq_len=64, max_blocks=8,
                 events="/e.jsonl", output_dir="/out")
    assert EvalJob.from_json(ev.to_json()) == ev


def test_an_optional_key_without_a_value_is_left_out_as_the_stages_left_it_out(tmp_path):
    train = worker_job(spec(), "train", tmp_path / "model", "cpu", ["cpu"]).placed("/e.jsonl", "/out")
    assert json.loads(train.to_json())["save_total_limit"] is None  # a trainer's job says it (keep every checkpoint)
    probe = replace(train, role="probe")
    assert "save_total_limit" not in json.loads(probe.to_json())  # the probe saves none and never said it
    assert not {"resume_from", "manifest", "kill_at", "device_map"} & set(json.loads(train.to_json()))


def _data(tmp_path: Path, **change: Any) -> dict[str, Any]:
    data = json.loads(full_job(tmp_path).to_json())
    for key, value in change.items():
        if value is _DROP:
            del data[key]
        else:
            data[key] = value
    return data


_DROP = object()


@pytest.mark.parametrize("change, named", [
    ({"role": _DROP}, "worker job: missing key(s) role"),
    ({"spec": _DROP, "device": _DROP}, "worker job: missing key(s) spec, device"),
    ({"events": _DROP}, "worker job: missing key(s) events"),  # the parent always fills it in
    ({"kill_step": "5"}, "worker job: kill_step = '5' is not int | None"),
    ({"kill_step": True}, "worker job: kill_step = True is not int | None"),
    ({"devices": "cpu"}, "worker job: devices = 'cpu' is not list[str]"),
    ({"devices": [0, 1]}, "worker job: devices = [0, 1] is not list[str]"),
    ({"role": "trian"}, "worker job: role = 'trian' is not one of 'probe', 'evaluate', 'train', 'twin', "
                        "'interrupted', 'resumed'"),
    ({"spec": []}, "worker job: spec = [] is not dict[str, Any]"),
    ({"rank": 0}, "worker job: unexpected key(s) rank"),
])
def test_a_missing_key_or_a_wrong_type_is_named(tmp_path, change, named):
    with pytest.raises(JobFormatError) as err:
        WorkerJob.from_dict(_data(tmp_path, **change))
    assert str(err.value) == named


def test_an_eval_job_names_its_key_too():
    good = {"checkpoint": "/c", "base": "", "data": "embedded", "heldout_fraction": 0.2, "seq_len": 64,
            "max_blocks": 8, "batch_size": 4, "events": "/e", "output_dir": "/o"}
    assert EvalJob.from_dict({**good, "heldout_fraction": 1}).heldout_fraction == 1  # an int is a float
    with pytest.raises(JobFormatError, match=r"^evaluation job: seq_len = 64.0 is not int$"):
        EvalJob.from_dict({**good, "seq_len": 64.0})
    with pytest.raises(JobFormatError, match=r"^evaluation job: missing key\(s\) max_blocks$"):
        EvalJob.from_dict({k: v for k, v in good.items() if k != "max_blocks"})


def test_a_file_that_is_no_job_is_named(tmp_path):
    path = tmp_path / "job.json"
    path.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(JobFormatError, match=r"job.json: a worker job must be a JSON object, got list$"):
        WorkerJob.read(path)
    path.write_text("{", encoding="utf-8")
    with pytest.raises(JobFormatError, match=r"job.json: a worker job file that is not JSON"):
        WorkerJob.read(path)


def test_the_interrupted_run_needs_its_kill_point(tmp_path):
    job = worker_job(spec(), "train", tmp_path / "model", "cpu", ["cpu"])
    with pytest.raises(JobFormatError, match="the interrupted run needs kill_at and kill_step"):
        replace(job, role="interrupted")
