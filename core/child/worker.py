"""The child process: one readable recipe that builds the model, runs real steps and reports what it measured.

Run as ``python -m core.child.worker JOB.json``; started by :mod:`core.stages.childproc` in its own process group with stdin from
/dev/null and stdout/stderr to a log file. The job is a :class:`~core.protocol.job.WorkerJob`, read once; the child
talks to the parent only through the JSON-lines events file it names.

Roles (``job.role``):

- ``probe``: ``probe_steps`` real steps (Trainer + PEFT for training, forward passes under ``torch.no_grad`` for
  inference) with a measuring callback; emits a measured ledger per device.
- ``evaluate``: held-out perplexity of the fixed weights (inference mode).
- ``train``: held-out perplexity before, ``steps`` optimizer steps with Trainer checkpoints, perplexity after. This run is
  also the reference of the resume check.
- ``interrupted``: the same training (from ``resume_from`` when given: a copy of the reference's checkpoint before c);
  once step ``kill_step`` is done it emits ``kill_point`` and holds there until the parent SIGKILLs its process group
  (so the kill lands after checkpoint c and before the next on any machine speed).
- ``resumed``: the same training resumed with ``resume_from_checkpoint``, stopped after ``stop_after_step``.
- ``twin``: the same training as ``train`` from step 0, uninterrupted, without the evaluations, stopped after
  ``stop_after_step`` (checkpointed there only): its distance from the reference is the run-to-run noise the resume
  check bounds the resumed run by (:mod:`core.stages.noise`).

The training roles run under the test-only gradient jitter when ``GPUACCEPT_TEST_JITTER`` asks for it
(:mod:`core.child.inject.jitter`, a stand-in for a GPU's nondeterminism), and commit the planted fault
``GPUACCEPT_TEST_FAULT`` names (:mod:`core.protocol.faults`).

Every training role emits one ``step`` event per optimizer step: global step, epoch, the learning rate applied, the loss
(mean over the micro-batches of the step, unrounded) and the sample ids consumed.

The recipe reads top to bottom across the package: here the roles (:func:`run_job`); :mod:`core.child.recipe` builds
the model (LoRA wrapped), the data and the Trainer; :mod:`core.child.callbacks` measures each step, holds at the kill
point (:mod:`core.killpoints`) and reports; :mod:`core.child.probe` runs the probe's steps; every event is a typed
one of :mod:`core.protocol.events`.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.child.determinism import apply_determinism
from core.protocol.events import (
    ChildError,
    DataInfo,
    DeviceUuid,
    EvalProgress,
    EventWriter,
    ManifestChecked,
    ModelBuilt,
    Started,
    Trainable,
    Trained,
)
from core.protocol.job import WorkerJob
from core.protocol.lifeline import exit_with_parent
from core.spec import RunSpec


def main(argv: list[str]) -> int:
    job = WorkerJob.read(argv[0])  # a file that is no job: JobFormatError, naming the key (the log says it)
    exit_with_parent()
    apply_determinism()  # the resume check's exact mode on CUDA, when the parent asks for it
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1  # launched by torchrun (core.stages.childproc, nproc > 1)
    events = EventWriter(job.events, int(os.environ["RANK"]) if distributed else None,
                         int(os.environ["LOCAL_RANK"]) if distributed else None)
    try:
        run_job(job, events)
        _close_process_group()
    except BaseException as exc:  # the parent reads this event; the traceback goes to the child's log
        import traceback

        traceback.print_exc()
        events.write(ChildError(error=f"{type(exc).__name__}: {exc}"))
        return 1
    finally:
        events.close()
    return 0


def _close_process_group() -> None:
    """Under torchrun: wait for every rank, then destroy the process group before the interpreter exits (a gloo
    group left to interpreter teardown can abort the process with "terminate called without an active exception",
    an exit status torchrun reports as a failure)."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_job(job: WorkerJob, events: EventWriter) -> None:
    """Run the job's role (see the module's docstring): report the start, build the model and the data, then probe,
    evaluate or train."""
    import torch
    from transformers import set_seed
    from transformers.utils import logging as hf_logging

    from core.child.probe import rank_info, rss_bytes
    from core.child.recipe import build_data, build_model, model_facts

    hf_logging.disable_progress_bar()
    spec = RunSpec.from_dict(job.spec)
    role = job.role
    if role != "probe" and spec.training and _perturbations(job) == "other_run":
        spec = RunSpec.from_dict({**job.spec, "seed": spec.seed + 1})  # planted: another run (another seed)
    device, name = rank_device(job)
    rss_start = rss_bytes()
    place = rank_info()
    events.write(Started(role=role, pid=os.getpid(), pgid=os.getpgid(0), device=name, torch=torch.__version__,
                         host=socket.gethostname(), global_rank=place["global_rank"],
                         local_rank=place["local_rank"], world_size=place["world_size"],
                         node_rank=place["node_rank"]))
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        events.write(DeviceUuid(device=name, uuid=str(torch.cuda.get_device_properties(device).uuid)))

    set_seed(spec.seed)
    device_map = job.device_map or ("balanced" if spec.strategy == "device_map" else None)
    if device_map is not None:
        device = "cuda:0" if name.startswith("cuda") else "cpu"  # the first device: where the inputs go
    model, tokenizer = build_model(spec, job.model_path, device, device_map)
    events.write(ModelBuilt(**model_facts(spec, model)))
    train_blocks, heldout_blocks, data_info = build_data(spec, tokenizer)
    events.write(DataInfo(**data_info))

    if role == "probe":
        from core.child.probe import probe

        probe(spec, model, train_blocks, Path(job.output_dir), device, events, job, rss_start, name)
    elif role == "evaluate":  # inference: fixed weights, evaluated once
        evaluate(spec, model, heldout_blocks, device, events, "before")
    else:
        train(spec, model, train_blocks, heldout_blocks, device, events, job)


def _perturbations(job: WorkerJob) -> str | None:
    """Install the twin's one-ulp nudge (``job.nudge``) and the test jitter when ``GPUACCEPT_TEST_JITTER`` asks for
    it; the fault ``GPUACCEPT_TEST_FAULT`` plants in the job's role (:func:`core.protocol.faults.active`: it raises
    for a name that is no fault), or None."""
    from core.child.inject.jitter import amplitude, install, install_nudge
    from core.protocol import faults

    fault = faults.active(job.role)
    if job.nudge or fault == "one_ulp":  # the twin's nudge; planted in a resumed run, a difference that is no fault
        install_nudge()
    relative = amplitude()
    if relative:
        install(relative)
    return fault


def train(spec: RunSpec, model: Any, train_blocks: list[dict[str, Any]], heldout_blocks: list[dict[str, Any]],
          device: str, events: EventWriter, job: WorkerJob) -> None:
    """The training roles: ``train`` evaluates before and after; ``interrupted`` and ``resumed`` only train (from
    ``job.resume_from`` when given, verified against ``job.manifest`` before and after Trainer loads it)."""
    from core.child.recipe import build_trainer

    role = job.role
    if role == "train":
        evaluate(spec, model, heldout_blocks, device, events, "before")
    trainable = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    events.write(Trainable(names=[n for n, _ in trainable], parameters=sum(k for _, k in trainable)))
    out_dir = Path(job.output_dir)
    trainer = build_trainer(spec, model, train_blocks, out_dir, device, events, job)
    if not _checkpoint_intact(job, events, "before_load"):
        return  # the parent fails the check, naming the files; nothing changed is loaded
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=job.resume_from)
    train_s = time.perf_counter() - started
    _checkpoint_intact(job, events, "after_load")
    events.write(Trained(seconds=train_s, global_step=trainer.state.global_step, output_dir=str(out_dir)))
    if role == "train":
        evaluate(spec, model, heldout_blocks, device, events, "after")


def evaluate(spec: RunSpec, model: Any, heldout_blocks: list[dict[str, Any]], device: str, events: EventWriter,
             when: str) -> None:
    """Held-out perplexity of the model as it is now (:func:`core.child.evaluate.evaluate_perplexity`), emitted as
    an ``evaluation`` event ``when`` ("before" / "after" training)."""
    from core.child.evaluate import evaluate_perplexity, evaluation_event

    result = evaluate_perplexity(model, heldout_blocks, spec.batch_size, device=device,
                                 autocast=spec.dtype if spec.autocast else None,
                                 on_batch=eval_progress_writer(events, when))
    events.write(evaluation_event(when, result))


def eval_progress_writer(events: EventWriter, when: str, every_s: float = 1.0) -> Callable[[int, int], None]:
    """An ``on_batch`` for :func:`core.child.evaluate.evaluate_perplexity` that writes :class:`EvalProgress` as the
    first batch ends, then at most once every ``every_s`` seconds (the last batch's is left to the evaluation event)."""
    last = [0.0]

    def written(done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and (last[0] == 0.0 or now - last[0] >= every_s):
            last[0] = now
            events.write(EvalProgress(when=when, done=done, total=total))

    return written


def _checkpoint_intact(job: WorkerJob, events: EventWriter, when: str) -> bool:
    """Verify the checkpoint resumed from (``job.resume_from``) against the parent's sha256 manifest
    (``job.manifest``), in this process: ``before_load`` right before Trainer reads the files, ``after_load`` once
    its run is over. Emits ``manifest`` {when, files, bad}; True when nothing changed (or there is nothing to check)."""
    if not job.resume_from or not job.manifest:
        return True
    from core.protocol.manifest import read_manifest, verify_manifest

    manifest = read_manifest(Path(job.manifest))
    bad = verify_manifest(Path(job.resume_from), manifest)
    events.write(ManifestChecked(when=when, files=len(manifest), bad=bad))
    return not bad


def rank_device(job: WorkerJob) -> tuple[str, str]:
    """(torch device, reported name) of this rank.

    One process: ``job.device`` for both. Under torchrun each rank takes the device of its local rank: on the CPU
    ``"cpu"``, reported ``cpu:<local rank>`` (the ranks share the host); on CUDA the parent restricted
    ``CUDA_VISIBLE_DEVICES`` to the devices named in ``job.devices``, so the torch device is ``cuda:<local rank>``
    and the name reported is the one planned (``job.devices[local rank]``)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and "LOCAL_RANK" not in os.environ:
        return job.device, job.device
    local = int(os.environ.get("LOCAL_RANK", "0"))
    names = job.devices or [job.device]
    name = names[local] if local < len(names) else f"{job.device}:{local}"
    if name.startswith("cuda"):
        return f"cuda:{local}", name
    return "cpu", name


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
