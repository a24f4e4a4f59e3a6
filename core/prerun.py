"""What is settled before a run of gpuaccept's recipe starts: its plan (:func:`make_plan`), its inputs checked
(:func:`check_inputs`), whether it can run here (:func:`check_runnable`, :func:`runnable_reason`), the devices its ranks
run on, and the embedded model converted once in a child (:func:`convert_in_child`)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.devicespec import parse_devices
from core.errors import GpuAcceptError, SpecError, StageError
from core.events import Event
from core.spec import RunSpec


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
    from core.plan.devices import detect_devices
    from core.plan.memory import plan_memory
    from core.plan.meta import linear_module_names, untied
    from core.specdraft import validate_against_config

    source = resolve_model(spec.model)
    config = load_config(source)
    if spec.untie_embeddings:
        config = untied(config)
    modules = linear_module_names(config) if spec.adapters else None
    validate_against_config(spec, declared_max_positions(source, config), modules)
    # on the CPU, torchrun's ranks are planned as devices: local_world_size(1) is nproc_per_node there (else 1)
    devices = devices_override if devices_override is not None else detect_devices(spec.devices,
                                                                                   cpu_ranks=spec.local_world_size(1))
    plan = plan_memory(spec, config, devices)
    return PlanContext(source=source, config=config, devices=devices, plan=plan)


@dataclass(frozen=True)
class InputsChecked:
    """What :func:`check_inputs` read: the model found and the data's split, for a screen to confirm them, and every
    problem found on the way.

    Attributes:
        model: the model as found (``"the embedded SmolLM2-135M"``, a directory, a cached hub id), in words; None when
            it was not found.
        max_positions: the sequence length the model declares, or None.
        documents: documents in the data (None when the data could not be read); train / heldout: documents per side of
            the split.
        data: the data as named in the spec (``"embedded"`` or a path).
        problems: ``(field, message)`` for each input a plan or a run would refuse: ``"model"``, ``"data"``, or a spec
            field the model refuses (``"seq_len"``, ``"lora.targets"``); empty when none.
    """

    model: str | None
    max_positions: int | None
    documents: int | None
    train: int
    heldout: int
    data: str
    problems: tuple[tuple[str, str], ...] = ()
    heldout_fraction: float = 0.2

    @property
    def ok(self) -> bool:
        """True when nothing was refused."""
        return not self.problems

    def data_summary(self) -> str:
        """``"483 documents: 386 train / 97 held-out (20 %; each document by a hash of its id, 20 % expected)"``;
        "" when unread. The split is per document by a hash (core.data), so the share is near the fraction, not it."""
        if self.documents is None:
            return ""
        share = f"{100 * self.heldout / self.documents:.0f} %" if self.documents else "none"
        return (f"{self.documents:,} documents: {self.train:,} train / {self.heldout:,} held-out ({share}; each "
                f"document by a hash of its id, {100 * self.heldout_fraction:g} % expected)")


def check_inputs(spec: RunSpec) -> InputsChecked:
    """Everything a plan or a run would refuse about the spec's inputs, checked without weights or a run folder: the
    model is found and its config read, the spec fits the config (sequence length, LoRA target names), the data file
    is read and split (:func:`core.data.check_data`). The model and the data are checked apart, so a missing model does
    not hide a bad data file. Fast (a config and a text file), for a form to check as the user types.

    Returns:
        an :class:`InputsChecked`; its ``problems`` name each field to fix (never raised: a form shows them all).
    """
    from core.data import check_data
    from core.models import declared_max_positions, load_config, resolve_model
    from core.plan.meta import linear_module_names
    from core.specdraft import config_problems

    problems: list[tuple[str, str]] = []
    model: str | None = None
    max_positions: int | None = None
    try:
        source = resolve_model(spec.model)
        config = load_config(source)
        max_positions = declared_max_positions(source, config)
        problems += [(e.field, e.message) for e in config_problems(
            spec, max_positions, linear_module_names(config) if spec.adapters else None)]
        model = {"embedded": "the embedded SmolLM2-135M", "local_dir": f"the folder {source.path}",
                 "hf_cache": f"{source.name} from the Hugging Face cache",
                 "config_only": f"{source.name}: a config only (planned, not run)"}.get(source.kind, str(source.path))
    except SpecError as exc:
        problems.append((exc.field, exc.message))
    except GpuAcceptError as exc:  # ModelNotFoundError, an unreadable config
        problems.append(("model", str(exc)))
    try:
        split = check_data(spec.data, spec.heldout_fraction)
    except GpuAcceptError as exc:  # DataError
        problems.append(("data", str(exc)))
        return InputsChecked(model=model, max_positions=max_positions, documents=None, train=0, heldout=0,
                             data=spec.data, problems=tuple(problems), heldout_fraction=spec.heldout_fraction)
    return InputsChecked(model=model, max_positions=max_positions, documents=len(split.train) + len(split.heldout)
                         + split.dropped_duplicates, train=len(split.train), heldout=len(split.heldout),
                         data=spec.data, problems=tuple(problems), heldout_fraction=spec.heldout_fraction)


def traced_summary(traced: dict[str, Any] | None) -> str:
    """One line on the traced plan: its peak against the analytic tensor total and the line that differs most."""
    if not traced:
        return "traced plan: not run"
    if traced.get("status") != "estimated":
        return f"traced plan: {traced.get('status')} ({traced.get('reason', '')})"
    a, t = traced["analytic_tensor_bytes"], traced["peak_bytes"]
    rel = f" ({(t - a) / a:+.1%})" if a else ""
    row = traced["lines"][traced["most_different"]]
    return (f"traced plan (estimate, fake tensors): peak {t / 2**30:.3f} GiB of tensors vs analytic {a / 2**30:.3f} "
            f"GiB{rel} without overhead; differs most: {traced['most_different']} (analytic "
            f"{row['analytic_bytes'] / 2**30:.3f}, traced {row['traced_bytes'] / 2**30:.3f} GiB)")


#: what the one-time conversion of the embedded model is, in the wait's words
CONVERTING = "converting the embedded model from GGUF to safetensors (once)"


#: the code the conversion's child runs
CONVERT_CODE = "from core.models import ensure_embedded_cache; ensure_embedded_cache()"


def convert_in_child(log_path: Path, stage: str = "probe",
                     cancelled: Callable[[], bool] | None = None) -> Generator[Event, None, None]:
    """Convert the embedded model in a child process: its progress bars go to ``log_path``, never to the terminal.
    Yields a :class:`core.events.Waiting` as it starts and then every second (the screen shows the seconds; about
    80 s on a 2-core CPU), so the conversion is never a wait without a sign of life.

    Raises:
        StageError: the conversion failed (the log is named).
        StageCancelled: ``cancelled`` said stop (the child's process group is killed).
    """
    import subprocess
    import sys
    import time

    from core.errors import StageCancelled
    from core.events import Waiting
    from core.interpreter import python_env
    from core.procgroup import end_group

    since = time.time()
    with open(log_path, "wb") as log, open(os.devnull, "rb") as devnull:
        child = subprocess.Popen(
            [sys.executable, "-P", "-c", CONVERT_CODE], stdin=devnull, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=python_env(os.environ),
        )
        try:
            while child.poll() is None:
                yield Waiting(stage, run="model", pid=child.pid, what=CONVERTING, since=since)
                if cancelled is not None and cancelled():
                    raise StageCancelled(f"{stage} cancelled while {CONVERTING}")
                try:
                    child.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            end_group(child)
    if child.returncode != 0:
        raise StageError(f"converting the embedded model failed (see {log_path})")


def convert_blocking(log_path: Path) -> None:
    """:func:`convert_in_child` run to its end without showing its waits (where no screen follows them).

    Raises:
        StageError: the conversion failed (the log is named).
    """
    for _ in convert_in_child(log_path):
        pass


def recipe_unrunnable(spec: RunSpec) -> tuple[str, str] | None:
    """The first setting of ``spec`` gpuaccept's own recipe does not run (it plans them all): (the setting, what it
    asks), or None."""
    beyond = spec.beyond_own_recipe()
    if beyond is not None:
        return beyond
    if spec.training and spec.optimizer_kind.library in ("torchao", "galore_torch"):
        return "optimizer", f"{spec.optimizer_kind.label} ({spec.optimizer_kind.library} is not installed here)"
    return None


def check_runnable(spec: RunSpec, ctx: PlanContext, device: str, allow_unfit: bool = False) -> None:
    """Refuse, before a run directory exists, a run that cannot start here (``allow_unfit``: all but a plan that does
    not fit, which the user asked to probe anyway).

    Raises:
        GpuAcceptError: a config without weights, a plan that does not fit, a CUDA device torch cannot see, fp16
            training on the CPU, the paged 8-bit optimizer on the CPU, a variant without bitsandbytes installed; each
            says what to change.
    """
    from core.plan.fit import plan_fits

    spec.method.check_run(spec)  # what the method plans but this version's recipe does not run
    planned_only = recipe_unrunnable(spec)
    if planned_only:
        raise GpuAcceptError(f"{planned_only[0]}: {planned_only[1]} is planned (gpuaccept plan), not run by gpuaccept's own "
                             "recipe in this version (Trainer, standard cross-entropy, SFT); run your own trainer on it "
                             "in command mode (gpuaccept run --command ...), which measures what it does")
    if spec.strategy not in RUNNABLE_STRATEGIES:
        why = {"zero1": "Trainer runs ZeRO stages 1 and 2 through DeepSpeed, which is not installed here",
               "zero2": "Trainer runs ZeRO stages 1 and 2 through DeepSpeed, which is not installed here",
               "tp": "this version runs tensor parallelism only in the plan"}[spec.strategy]
        raise GpuAcceptError(f"strategy: {spec.strategy} can be planned (gpuaccept plan --strategy {spec.strategy}), "
                             f"not run: {why}; run with strategy single, ddp or zero3 (fsdp)")
    if spec.strategy == "device_map" and spec.training:
        raise GpuAcceptError("strategy: device_map is probed for inference in this version (layers split over the "
                             "devices, one process); training with it is planned only: gpuaccept plan --strategy "
                             "device_map, or train with ddp or zero3")
    if spec.torchrun.nnodes > 1 and spec.training and spec.resume.check and spec.strategy != "ddp":
        raise GpuAcceptError(f"resume.check: across nodes the kill-and-resume check runs under ddp, where each node "
                             f"keeps a whole checkpoint of its own; under {spec.strategy} Trainer gathers the full "
                             "state to rank 0's node only, so another node has nothing to resume from: run with "
                             "--no-resume-check (resume.check = false) on every node, or --strategy ddp")
    optimizer = spec.optimizer_kind
    if spec.strategy == "zero3" and device == "cpu" and spec.training and not optimizer.traceable:
        raise GpuAcceptError(f"optimizer: the CPU zero3 probe (torch FSDP2 outside Trainer) runs torch's own "
                             f"optimizers, not {spec.optimizer}: choose adamw or sgd, or probe zero3 on CUDA devices")
    if optimizer.needs_cuda and device == "cpu" and spec.training:
        raise GpuAcceptError(f"optimizer: {spec.optimizer} keeps its states in CUDA unified memory, paged between a GPU "
                             "and the host; on the CPU there is nothing to page (bitsandbytes would run the unpaged "
                             "optimizer instead): run an unpaged optimizer here (adamw_8bit), or this one on a CUDA "
                             "device")
    if spec.strategy in ("ddp", "zero3") and not spec.training:
        raise GpuAcceptError(f"strategy: inference runs in one process; {spec.strategy} is for training (every rank "
                             "would evaluate the same held-out blocks): use strategy single")
    if not ctx.source.runnable:
        raise GpuAcceptError(f"{spec.model} has no weights: it can be planned (gpuaccept plan), not run; "
                             "give a model directory with weights")
    if not allow_unfit and not plan_fits(ctx.plan):
        raise GpuAcceptError("the plan does not fit on the device; lower batch_size or seq_len (or use LoRA)")
    if device.startswith("cuda") and not _cuda_visible():
        raise GpuAcceptError(f"devices: {device} is not visible to torch here (no CUDA device or driver); "
                             "use --devices cpu or auto, or plan it with `gpuaccept plan`")
    if spec.dtype == "fp16" and device == "cpu" and spec.training:
        raise GpuAcceptError("dtype: fp16 training needs a CUDA device; on the CPU use fp32 or bf16")
    missing = attention_unavailable(spec.attn_implementation, device)
    if missing:
        raise GpuAcceptError(f"attn_implementation: {missing}")
    needs_bnb = f"mode: {spec.mode}" if spec.method.quantised else (
        f"optimizer: {spec.optimizer}" if spec.training and optimizer.needs_bitsandbytes else None)
    if needs_bnb and importlib.util.find_spec("bitsandbytes") is None:
        raise GpuAcceptError(f"{needs_bnb} runs on bitsandbytes, which is not installed here: pip install -e "
                             "\".[qlora]\" (make run and make test install it), or plan it only (gpuaccept plan)")


def attention_unavailable(attention: str, device: str) -> str | None:
    """Why ``attention`` cannot run on ``device`` here (a kernel whose package is missing, or a CUDA-only kernel on the
    CPU), or None. It can still be planned: the plan counts flash_attention_2 as a fused kernel, like sdpa."""
    import importlib.util

    if attention != "flash_attention_2":
        return None
    if importlib.util.find_spec("flash_attn") is None:
        return ("flash_attention_2 needs the flash_attn package, which is not installed here (pip install flash-attn, "
                "on a CUDA box); use sdpa, whose fused kernels save the same tensors (the plan is the same)")
    if not device.startswith("cuda"):
        return "flash_attention_2 runs on CUDA devices only; use sdpa on the CPU"
    return None


def runnable_reason(spec: RunSpec, ctx: PlanContext, allow_unfit: bool = False) -> str | None:
    """Why ``spec`` cannot run here (:func:`check_runnable`'s refusal), or None: for a screen to say it before Next
    (``allow_unfit``: whatever else refuses it; a plan that does not fit can still be probed anyway)."""
    try:
        check_runnable(spec, ctx, run_device(spec, ctx.devices), allow_unfit=allow_unfit)
    except GpuAcceptError as exc:
        return str(exc)
    return None


#: Strategies the probe, training and resume stages run (the others are planned only; see check_runnable).
RUNNABLE_STRATEGIES = ("single", "ddp", "zero3", "device_map")


def rank_devices(spec: RunSpec, devices: list[Any], device: str) -> list[str]:
    """The device of each rank on this node, in local-rank order: the planned devices under torchrun (``cpu:r`` for
    CPU ranks, ``cuda:i``), else the one device the single process runs on."""
    if spec.local_world_size(len(devices)) > 1 or spec.torchrun.nnodes > 1 or spec.strategy == "device_map":
        return [d.name for d in devices]
    return [device]


def run_device(spec: RunSpec, devices: list[Any]) -> str:
    """The device the single-device probe and training run on: the first planned device."""
    names = parse_devices(spec.devices)
    if names == ["cpu"] or not devices or devices[0].kind == "cpu":
        return "cpu"
    return devices[0].name


def _cuda_visible() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def plan_summary(plan: Any, traced: dict[str, Any] | None = None) -> str:
    from core.plan.fit import fit_verdicts

    parts = []
    from core.plan.memory import component_label

    for d, fit in zip(plan.devices, fit_verdicts(plan, traced)):
        verdict = {True: "fits", False: "does not fit", None: "fit unknown"}[fit.fits]
        peak = d.peak_phase.name.replace("_", " ") if d.peak_phase else ""
        # the peak the fit is judged by, split as the probe compares it: its tensors (`gpuaccept diff`'s "planned
        # tensors", the record's probe.plan_comparison planned_bytes) and the overhead line
        overhead = d.lines["overhead"].bytes
        parts.append(f"{d.device.name}: plan peak {fit.bytes / 2**30:.2f} GiB (tensors "
                     f"{(fit.bytes - overhead) / 2**30:.2f} GiB + {component_label('overhead', d.device.kind)} "
                     f"{overhead / 2**30:.2f} GiB) of {d.device.capacity_text()}, {verdict} ({fit.untraced_note}; "
                     f"the analytic peak is in the {peak})")
    return "; ".join(parts)
