"""The pipeline: plan -> probe -> train + evaluate -> kill and resume -> record, as one generator of typed events.

Both faces of gpuaccept (the headless CLI and the Textual wizard) call :func:`run_pipeline` and only consume its events;
they never compute memory or verdicts themselves. Stage results arrive in :class:`~core.events.StageFinished` events.
A stage that fails stops the stages after it; the record is written in every case, with what did not run marked so.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generator

from core.errors import GpuAcceptError
from core.events import Event, EventWriter, Message, RunFinished, StageFinished, StageStarted
from core.spec import RunSpec, parse_devices

STAGES = ("plan", "probe", "train_eval", "resume", "record")


@dataclass(frozen=True)
class PlanContext:
    """What the plan stage found: the resolved model, its config, the devices and the plan."""

    source: Any
    config: Any
    devices: list[Any]
    plan: Any


def make_plan(spec: RunSpec, devices_override: list[Any] | None = None) -> PlanContext:
    """Resolve the model, read its config (no weights), validate the spec against it and plan memory per device.

    Raises:
        SpecError, ModelNotFoundError: named errors for bad input.
    """
    from core.models import declared_max_positions, load_config, resolve_model
    from core.plan import count_parameters, detect_devices, linear_module_names, plan_memory
    from core.spec import validate_against_config

    source = resolve_model(spec.model)
    config = load_config(source)
    modules = linear_module_names(config) if spec.mode == "lora" else None
    validate_against_config(spec, declared_max_positions(source, config), modules)
    devices = devices_override if devices_override is not None else detect_devices(spec.devices)
    params = count_parameters(config, spec.mode, spec.lora if spec.mode == "lora" else None)
    plan = plan_memory(spec, config, devices, parameters=params)
    return PlanContext(source=source, config=config, devices=devices, plan=plan)


def new_run_dir(spec: RunSpec, runs_root: Path, now: Any) -> Path:
    """``runs/<UTC time>-<mode>-<model>/``, unique (a suffix is added if it exists)."""
    model = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(spec.model.rstrip("/")).name or spec.model)[:40]
    base = runs_root / f"{now.strftime('%Y%m%dT%H%M%SZ')}-{spec.mode}-{model}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    path.mkdir(parents=True)
    return path


def run_pipeline(
    spec: RunSpec,
    runs_root: Path = Path("runs"),
    cancelled: Callable[[], bool] | None = None,
    devices_override: list[Any] | None = None,
) -> Generator[Event, None, Path]:
    """Run every stage in order, yielding events; return the record's path.

    The run directory keeps the spec, the pipeline's events (``events.jsonl``), each child's job, log, events and
    checkpoints, and ``record.toml``. Bad input raises a named :class:`~core.errors.GpuAcceptError` before the run
    directory is created.
    """
    import tomli_w

    from core.probe import run_probe
    from core.record import build_record, environment, utc_now, write_record
    from core.resume import not_applicable, run_resume_check
    from core.train import run_train_eval

    started = utc_now()
    yield StageStarted("plan", detail="per-component memory plan per device (no weights loaded)")
    ctx = make_plan(spec, devices_override)
    run_dir = new_run_dir(spec, Path(runs_root), started)
    (run_dir / "spec.toml").write_text(tomli_w.dumps(spec.to_dict()), encoding="utf-8")
    (run_dir / "plan.json").write_text(json.dumps(ctx.plan.to_json(), indent=2), encoding="utf-8")
    log = EventWriter(run_dir / "events.jsonl")

    def emit(event: Event) -> Event:
        log.emit(type(event).__name__, **{k: v for k, v in vars(event).items() if k not in ("result", "t")})
        return event

    plan_fits = all(d.fits is not False for d in ctx.plan.devices)
    yield emit(StageFinished("plan", status="pass" if plan_fits else "fail", result=ctx.plan,
                             summary=_plan_summary(ctx.plan)))
    results: dict[str, Any] = {"plan": ctx.plan, "probe": None, "train_eval": None, "resume": None}
    model_info = {"name": spec.model, "kind": ctx.source.kind, "path": str(ctx.source.path),
                  "model_type": getattr(ctx.config, "model_type", "unknown"),
                  "parameters_total": ctx.plan.parameters.total, "parameters_trainable": ctx.plan.parameters.trainable}
    device = _run_device(spec, ctx.devices)
    try:
        if not ctx.source.runnable:
            raise GpuAcceptError(f"{spec.model} has no weights: planned only; give a model with weights to run it")
        if not plan_fits:
            raise GpuAcceptError("the plan does not fit on the device; lower batch_size or seq_len (or use LoRA)")
        if device.startswith("cuda") and not _cuda_visible():
            raise GpuAcceptError(f"devices: {device} is not visible to torch (no CUDA device or driver here); "
                                 "use --devices cpu, or auto")
        if len(ctx.devices) > 1:
            yield emit(Message("probe", text=f"{len(ctx.devices)} devices planned; this version probes and trains on "
                                             f"{device} only"))
        if spec.dtype == "fp16" and device == "cpu" and spec.training:
            raise GpuAcceptError("fp16 training needs a CUDA device; on CPU use dtype fp32 or bf16")
        from core.models import embedded_cache_ready, runnable_path

        if ctx.source.kind == "embedded" and not embedded_cache_ready():
            yield emit(Message("probe", text="converting the embedded model from GGUF to a safetensors cache (once)"))
            convert_in_child(run_dir / "convert-embedded.log")
        model_path = runnable_path(ctx.source)

        yield emit(StageStarted("probe", detail=f"{spec.probe_steps} real steps in a child process on {device}"))
        probe = yield from _logged(run_probe(spec, model_path, run_dir / "probe", device, ctx.plan, cancelled), emit)
        results["probe"] = probe
        yield emit(StageFinished("probe", status=probe.status, result=probe, summary=probe.summary))
        if probe.status != "pass":
            raise GpuAcceptError("the probe failed; later stages were not run")

        yield emit(StageStarted("train_eval", detail="held-out perplexity before/after training" if spec.training
                                else "held-out perplexity of the fixed weights"))
        te, _child = yield from _logged(run_train_eval(spec, model_path, run_dir / "train", device, cancelled), emit)
        results["train_eval"] = te
        yield emit(StageFinished("train_eval", status=te.status, result=te, summary=te.summary))

        if spec.training and spec.resume.check:
            yield emit(StageStarted("resume", detail="kill the training process, resume from its checkpoint, compare"))
            resume = yield from _logged(run_resume_check(spec, model_path, run_dir, device, te, cancelled), emit)
        else:
            yield emit(StageStarted("resume", detail="nothing to resume"))
            resume = not_applicable(spec)
        results["resume"] = resume
        yield emit(StageFinished("resume", status=resume.status, result=resume, summary=resume.summary))
    except GpuAcceptError as exc:
        yield emit(Message("pipeline", text=f"stopped: {exc}"))
    finally:
        log.close()

    yield StageStarted("record", detail="record.toml, written atomically")
    record = build_record(spec, run_dir=run_dir, model=model_info, plan=results["plan"], probe=results["probe"],
                          train_eval=results["train_eval"], resume=results["resume"], started=started,
                          finished=utc_now(), env=environment())
    path = write_record(record, run_dir / "record.toml")
    status = record["verdict"]["status"]
    yield StageFinished("record", status="pass", summary=str(path))
    yield RunFinished("record", status=status, record_path=str(path), run_dir=str(run_dir))
    return path


def convert_in_child(log_path: Path) -> None:
    """Convert the embedded model in a child process: its progress bars go to ``log_path``, never to the terminal.

    Raises:
        StageError: the conversion failed (the log is named).
    """
    import subprocess
    import sys

    from core.errors import StageError

    with open(log_path, "wb") as log, open(os.devnull, "rb") as devnull:
        rc = subprocess.call(
            [sys.executable, "-P", "-c", "from core.models import ensure_embedded_cache; ensure_embedded_cache()"],
            stdin=devnull, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    if rc != 0:
        raise StageError(f"converting the embedded model failed (see {log_path})")


def _logged(gen: Generator[Event, None, Any], emit: Callable[[Event], Event]) -> Generator[Event, None, Any]:
    """Pass a stage's events through the run's event log; return the stage's result."""
    try:
        while True:
            yield emit(next(gen))
    except StopIteration as stop:
        return stop.value


def _run_device(spec: RunSpec, devices: list[Any]) -> str:
    """The device the single-device probe and training run on: the first planned device."""
    names = parse_devices(spec.devices)
    if names == ["cpu"] or not devices:
        return "cpu"
    return devices[0].name


def _cuda_visible() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _plan_summary(plan: Any) -> str:
    parts = []
    for d in plan.devices:
        cap = f"{d.device.capacity_bytes / 2**30:.1f} GiB" if d.device.capacity_bytes else "unknown"
        verdict = {True: "fits", False: "does not fit", None: "fit unknown"}[d.fits]
        parts.append(f"{d.device.name}: {d.total_bytes / 2**30:.2f} GiB of {cap}, {verdict}")
    return "; ".join(parts)
