"""The acceptance record: ``record.toml`` in the run directory, built from stage results, written atomically.

Every table that holds numbers says where they come from with ``provenance``: ``measured`` (read from live tensors, the
allocator, the OS or a clock), ``estimated`` (with ``method``), or ``not_run``. TOML has no null (docs/architecture.md §5): a value that
does not exist is omitted and its table says why.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import platform
import socket
from importlib import metadata
from pathlib import Path
from typing import Any, cast

from core.criteria import device_label, speed_on
from core.criteria import summary as criteria_summary
from core.plan.fit import fit_verdicts, measured_use_bytes
from core.record.verdicts import (
    CheckFact,
    ComparedPeak,
    ComparedStep,
    NotApplicable,
    PlanFacts,
    PlannedDevice,
    ProbedDevice,
    ProbeFacts,
    QualityFacts,
    ResumeFacts,
    StageVerdict,
    evaluation_verdict,
    expected_probe_devices,
    overall_status,
    plan_verdict,
    probe_verdict,
    resume_verdict,
    timed_means,
)
from core.record.written import SCHEMA_VERSION, TOOL, clean, stage_entry, tool_version
from core.spec import RunSpec
from core.stages.noise import RecordedRule
from core.status import PASSING, StageStatus, Stopped


def environment() -> dict[str, Any]:
    """Python, library versions (from installed metadata, no imports), host and CPU facts; CUDA when torch sees it."""
    env: dict[str, Any] = {
        "provenance": "measured",
        "method": "read from the running system and the installed packages' metadata",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count() or 0,
    }
    for dist in ("torch", "transformers", "peft", "accelerate", "textual", "nvidia-ml-py", "safetensors", "bitsandbytes"):
        try:
            env[dist.replace("-", "_")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist.replace("-", "_")] = "not installed"
    try:
        import psutil

        env["host_memory_bytes"] = int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 - environment capture never fails a record
        pass
    env.update(_nvidia_driver())
    try:
        import torch

        env["torch_threads"] = int(torch.get_num_threads())  # the bit-exact CPU tier assumes a fixed thread count
        env["cuda_available"] = bool(torch.cuda.is_available())
        if torch.cuda.is_available():
            env["cuda_runtime"] = str(torch.version.cuda)
            env["gpus"] = [
                {"index": i, "name": torch.cuda.get_device_name(i),
                 "uuid": str(torch.cuda.get_device_properties(i).uuid),
                 "memory_bytes": int(torch.cuda.get_device_properties(i).total_memory)}
                for i in range(torch.cuda.device_count())
            ]
    except Exception:  # noqa: BLE001
        env["cuda_available"] = False
    env.update(test_settings())
    return env


def test_settings(environ: Any = None) -> dict[str, Any]:
    """What the tests planted in this run, so that its record says so: ``test_jitter`` (the gradient jitter's relative
    amplitude, core/child/inject/jitter.py) and ``test_fault`` (a resume bug committed on purpose,
    core/protocol/faults.py); empty for any real run."""
    from core.child.inject.jitter import amplitude
    from core.protocol.faults import FAULT_ENV

    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    jitter = amplitude(environ)
    if jitter:
        out["test_jitter"] = jitter
    if environ.get(FAULT_ENV, "").strip():
        out["test_fault"] = environ[FAULT_ENV].strip()
    return out


def _nvidia_driver() -> dict[str, Any]:
    """The NVIDIA driver's version and CUDA driver API version from NVML, or why there is none."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no driver here is a fact to record, not an error
        return {"nvidia_driver": f"not found ({type(exc).__name__}: {str(exc)[:80]})"}
    try:
        out: dict[str, Any] = {"nvidia_driver": str(pynvml.nvmlSystemGetDriverVersion())}
        try:
            v = int(pynvml.nvmlSystemGetCudaDriverVersion_v2())
            out["cuda_driver_api"] = f"{v // 1000}.{v % 1000 // 10}"
        except Exception:  # noqa: BLE001
            pass
        return out
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def build_record(spec: RunSpec, *, run_dir: Path, model: dict[str, Any], plan: Any, probe: Any, train_eval: Any,
                 resume: Any, started: dt.datetime, finished: dt.datetime, env: dict[str, Any] | None = None,
                 stopped: dict[str, Stopped] | None = None, traced: dict[str, Any] | None = None) -> dict[str, Any]:
    """Assemble the record mapping from stage results (``None`` for a stage that did not run).

    Tables: ``spec``, ``environment``, ``model``, ``data``, ``plan``, ``probe``, ``evaluation``, ``resume``, ``verdict``.
    """
    rec: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "tool": TOOL,
        "tool_version": tool_version(),
        "created_utc": finished,
        "started_utc": started,
        "run_dir": str(Path(run_dir).resolve()),
        "spec": {**spec.to_dict(), "hash": spec.spec_hash()},
        "environment": env if env is not None else environment(),
        "model": {"provenance": "measured", "method": "parameters counted on the model built on the meta device",
                  **model},
        "accept": spec.accept.to_table(),
    }
    rec["seeds"] = {"provenance": "measured", "method": "the spec's seed, set in every child process with "
                    "transformers.set_seed and passed to Trainer as seed and data_seed",
                    "seed": spec.seed, "data_seed": spec.seed}
    rec["plan"] = _plan_table(plan, traced)
    rec["probe"] = _probe_table(probe)
    rec["data"], rec["evaluation"] = _evaluation_tables(spec, train_eval)
    rec["resume"] = _resume_table(resume)
    rec["verdict"] = verdict(spec, plan, probe, train_eval, resume, stopped, traced)
    for name in ("probe", "evaluation", "resume"):  # a measured stage's table says the verdict's status
        if rec[name].get("provenance") == "measured":
            rec[name]["status"] = rec["verdict"]["stages"][name]["status"]
    return cast(dict[str, Any], clean(rec))  # _clean keeps a dict a dict


def _plan_table(plan: Any, traced: dict[str, Any] | None) -> dict[str, Any]:
    """The analytic plan per device (its phases, lines and peak), the traced plan beside it, and each device's fit
    judged by the larger of the two (``fit_bytes``, ``fit_judged_by``, ``fits``; core/plan/fit.py)."""
    from core.plan.fit import fit_verdicts

    if plan is None:
        return {"provenance": "not_run"}
    data = plan.to_json()
    for device, fit in zip(data["devices"], fit_verdicts(plan, traced)):
        device.update(fit_bytes=fit.bytes, fit_judged_by=fit.judged_by, fits=fit.fits)
    return {
        "provenance": "estimated",
        "method": "analytic: the peak of the step over its phases (forward, backward, optimizer step), each line its "
                  "component's largest value (see each line's method); model built on the meta device for counts",
        **data,
        "traced": traced if traced else {"status": "not_run", "reason": "the trace did not run before the probe "
                                                                        "started"},
    }


def _probe_table(probe: Any) -> dict[str, Any]:
    if probe is None:
        return {"provenance": "not_run"}
    return {
        "provenance": "measured",
        "status": probe.status,
        "steps": probe.steps,
        "step_time_s": probe.step_time_s,
        "tokens_per_s": probe.tokens_per_s,
        **({"timing": _probe_timing(probe.timing)} if getattr(probe, "timing", None) is not None else {}),
        "log": probe.log_path,
        "devices": [dataclasses.asdict(d) for d in probe.devices],
        "placement": probe.placement,
        "problems": list(probe.problems),
        "findings": list(probe.findings),
        "attention_implementation": probe.attention,
        **({"lora_targets_resolved": probe.lora_targets, "lora_modules_adapted": probe.lora_modules}
           if probe.lora_targets else {}),
        **({"layer_placement": probe.layers} if getattr(probe, "layers", None) else {}),
        **({"health": probe.health.to_table()} if getattr(probe, "health", None) is not None else {}),
        **({"links": probe.links.to_table()} if getattr(probe, "links", None) is not None else {}),
        "plan_comparison": [
            {"device": c.device, "rank": c.rank, "planned_bytes": c.planned_bytes, "measured_bytes": c.measured_bytes,
             "error_pct": c.error_pct, "compared": c.compared,
             **({"under_estimate_pct": 100 * c.under_estimate} if c.under_estimate is not None else {}),
             "components": {k: {"planned_bytes": p, **({"measured_bytes": m} if m is not None else {}),
                                **({"measured": c.how[k]} if k in c.how else {})}
                            for k, (p, m) in c.components.items()}}
            for c in probe.comparisons
        ],
    }


def _probe_timing(timing: Any) -> dict[str, Any]:
    """``probe.timing``: which steps ``step_time_s`` and ``tokens_per_s`` are the mean of, whether the memory tracker
    ran in them, whether the warm-up step 1 was left out, the steps tracked for memory and their time
    (:class:`core.stages.probe.ProbeTiming`; each rank's seconds per step are in ``devices[].step_times_s``)."""
    return {
        "method": "wall-clock seconds of each optimizer step (time.perf_counter, after a CUDA synchronize); "
                  "step_time_s is the mean of timed_steps per rank, the slowest rank's",
        "timed_steps": list(timing.timed_steps),
        "timed_tracked": bool(timing.timed_tracked),
        "warmup_excluded": bool(timing.warmup_excluded),
        "tracked_steps": list(timing.tracked_steps),
        **({"tracked_step_time_s": timing.tracked_step_time_s} if timing.tracked_step_time_s is not None else {}),
    }


def _evaluation_tables(spec: RunSpec, te: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    if te is None:
        return {"provenance": "not_run"}, {"provenance": "not_run"}
    data = {"provenance": "measured", "source": spec.data, "heldout_fraction": spec.heldout_fraction, "seq_len": spec.seq_len, **te.data}
    ev: dict[str, Any] = {
        "provenance": "measured",
        "status": te.status,
        "criterion": te.criterion,
        "metric": te.metric,
        "settings": {"mode": spec.mode, "steps": spec.steps, "batch_size": spec.batch_size, "seq_len": spec.seq_len,
                     "grad_accum": spec.grad_accum, "learning_rate": spec.learning_rate, "optimizer": spec.optimizer,
                     "dtype": spec.dtype, "precision": spec.precision, "attn_implementation": spec.attn_implementation,
                     "padding": spec.padding, "seed": spec.seed, "strategy": spec.strategy,
                     "torchrun": dataclasses.asdict(spec.torchrun)},
        "before": dataclasses.asdict(te.before),
        "log": te.log_path,
    }
    if te.after is not None:
        ev["after"] = dataclasses.asdict(te.after)
        ev["training_time_s"] = te.training_time_s
        ev["tokens_per_s"] = te.tokens_per_s
        ev["loss_per_step"] = [s["loss"] for s in te.steps]
        ev["epoch_per_step"] = [s["epoch"] for s in te.steps]  # Trainer's fractional epoch after each optimizer step
        ev["learning_rate_per_step"] = [s["learning_rate"] for s in te.steps]
    else:
        ev["after"] = {"provenance": "not_run", "why": "inference: no training, the fixed weights are evaluated once"}
    return data, ev


def _resume_table(r: Any) -> dict[str, Any]:
    if r is None:
        return {"status": StageStatus.NOT_RUN.value, "provenance": "not_run"}
    if r.status == StageStatus.NOT_APPLICABLE:
        return {"status": StageStatus.NOT_APPLICABLE.value, "why": r.summary}
    return {
        "status": r.status,
        "provenance": "measured",
        "summary": r.summary,
        "checkpoint_step": r.checkpoint_step,
        "kill_step": r.kill_step,
        "kill_at": r.kill_at,
        "kill_planned": r.kill_planned,
        "killed_process_group": r.killed_pgid,
        "tier": dataclasses.asdict(r.tier) if r.tier else {},
        "extra_steps": r.extra_steps,
        # the interrupted run's first step (0: from the start; else from a copy of the reference's checkpoint)
        "interrupted_start_step": r.interrupted_start,
        "compared_steps": list(r.compared_steps) if r.compared_steps else None,
        # the twin run's steps (1 to the last compared step), when the tier measured the noise with one
        "twin_steps": list(r.twin_steps) if r.twin_steps else None,
        "seconds": r.seconds,
        # every row names its tier: exact checks are equality, completeness checks presence of every component
        "checks": [c.row() for c in r.checks],
        "comparison": r.comparison,
        "checkpoint_manifest": r.manifest,
    }


def verdict(spec: RunSpec, plan: Any, probe: Any, te: Any, resume: Any,
            stopped: dict[str, Stopped] | None = None, traced: dict[str, Any] | None = None) -> dict[str, Any]:
    """Overall verdict: pass only when every stage that applies passed; each stage's status and evidence are listed.

    Each status is the verdict engine's (:mod:`core.record.verdicts`) over the facts of the stage's result
    (:func:`plan_facts`, :func:`probe_facts`, :func:`quality_facts`, :func:`resume_facts`): the facts ``gpuaccept
    verify`` reads back from the record's tables and judges by the same functions.

    Args:
        stopped: why a stage ended without a result, by stage name (``probe``, ``train_eval``, ``resume``), with
            the status it carries (:class:`core.status.Stopped`: ``cancelled``, ``error`` or ``not_run``); the stage
            has that status, with that reason as its evidence.
    """
    stopped = stopped or {}
    stages: dict[str, dict[str, Any]] = {}
    if plan is not None:
        judged = judged_stage(spec, "plan", plan, probe, te, resume, traced)
        rows = judged.criteria
        evidence = "; ".join(
            f"{f.device}: planned {f.bytes / 2**30:.2f} GiB ({f.untraced_note}) of "
            + (f"{d.device.capacity_bytes / 2**30:.2f} GiB ({d.device.capacity_source})" if d.device.capacity_bytes
               else "unknown capacity") for f, d in zip(fit_verdicts(plan, traced), plan.devices))
        stages["plan"] = {"status": judged.status.value,
                          "evidence": evidence + (f"; judged by {criteria_summary(rows)}" if rows else ""),
                          "criteria": [r.to_row() for r in rows]}
    else:
        stages["plan"] = {"status": StageStatus.NOT_RUN.value, "evidence": "the plan did not run"}
    for name, key, res in (("probe", "probe", probe), ("evaluation", "train_eval", te), ("resume", "resume", resume)):
        earlier = any(s["status"] not in PASSING for s in stages.values())
        stages[name] = stage_entry(res, judged_stage(spec, key, plan, probe, te, resume, traced)
                                   if res is not None else None, stopped.get(key),
                                   "not run: an earlier stage did not pass" if earlier else "not run")
    return {"status": overall_status(s["status"] for s in stages.values()).value, "stages": stages,
            "note": "pass means every applicable check passed on this box with this spec; it is not a claim about "
                    "other data, longer training or other hardware"}


def judged_stage(spec: RunSpec, stage: str, plan: Any, probe: Any, te: Any, resume: Any,
                 traced: dict[str, Any] | None = None) -> StageVerdict:
    """The verdict engine's verdict of the pipeline's stage ``stage`` (``plan``, ``probe``, ``train_eval``,
    ``resume``) over the facts of its result (:func:`plan_facts`, :func:`probe_facts`, :func:`quality_facts`,
    :func:`resume_facts`): what the record states (:func:`verdict`) and the status the stage ends with live
    (:meth:`core.pipeline.AcceptanceRun.engine`). The plan is judged with the probe when it ran (the plan's error
    against the peak).

    Raises:
        KeyError: ``stage`` is none of the four."""
    if stage == "plan":
        return plan_verdict(plan_facts(spec, plan, probe, traced))
    if stage == "probe":
        return probe_verdict(probe_facts(spec, plan, probe))
    if stage == "train_eval":
        return evaluation_verdict(quality_facts(spec, te))
    if stage == "resume":
        return resume_verdict(resume_facts(spec, resume))
    raise KeyError(stage)


# ------------------------------------------------------------ the stage results as the verdict engine's facts
def plan_facts(spec: RunSpec, plan: Any, probe: Any, traced: dict[str, Any] | None) -> PlanFacts:
    """The plan's facts: each device's fit (:func:`core.plan.fit.fit_verdicts`: the bytes it is judged by, its
    capacity) and the probe's plan comparison for ``accept.max_plan_error_pct``."""
    world = max((d.world_size for d in probe.devices), default=1) if probe is not None else 1
    return PlanFacts(
        tuple(PlannedDevice(f.device, f.bytes, f.capacity_bytes) for f in fit_verdicts(plan, traced)),
        tuple(ComparedPeak(device_label(c.device, c.rank, world), c.planned_bytes, c.measured_bytes)
              for c in (probe.comparisons if probe is not None else [])),
        spec.accept)


def probe_facts(spec: RunSpec, plan: Any, probe: Any) -> ProbeFacts:
    """The probe's facts: each measured device's use (:func:`core.plan.fit.measured_use_bytes`), the capacity of the
    planned device of its name, its wrapper against the strategy; the ranks the spec runs on the planned devices (one
    node: a node other than 0 of several holds only its own ranks, and the stage raised unless every rank it started
    reported); the speed over the steps it was timed on; the attention implementation it ran with against the
    spec's."""
    from core.stages.probe import wrapper_problem  # the probe stage (its launch, its events): imported when judged

    planned = list(plan.devices) if plan is not None else []
    capacity = {d.device.name: d.device.capacity_bytes for d in planned}
    timing = getattr(probe, "timing", None)
    return ProbeFacts(
        tuple(ProbedDevice(device_label(m.device, m.rank, m.world_size),
                           measured_use_bytes(m.device, m.peak_bytes, m.peak_rss_bytes), capacity.get(m.device),
                           wrapper_problem(spec.strategy, m.wrapper)) for m in probe.devices),
        spec.accept, probe.step_time_s, probe.tokens_per_s,
        speed_on(timing.timed_steps, timing.timed_tracked) if timing is not None else None,
        expected_devices=expected_probe_devices(spec.to_dict(), len(planned)),
        attention=str(probe.attention or ""), planned_attention=spec.attn_implementation,
        health=tuple(probe.health.facts()) if getattr(probe, "health", None) is not None else (),
        links=probe.links.facts() if getattr(probe, "links", None) is not None else None,
        rank_step_times=timed_means({m.rank: (device_label(m.device, m.rank, m.world_size), m.step_times_s)
                                     for m in probe.devices}.values(), timing.timed_steps if timing else ()))


def quality_facts(spec: RunSpec, te: Any) -> QualityFacts:
    """The evaluation's facts: held-out perplexity before and after training and the final model's accuracy."""
    final = te.after if te.after is not None else te.before
    return QualityFacts(spec.training, te.before.perplexity, te.after.perplexity if te.after is not None else None,
                        final.accuracy, spec.accept)


def resume_facts(spec: RunSpec, r: Any) -> ResumeFacts | NotApplicable:
    """The resume check's facts: every check (a tolerance check with its distance, the twin's noise and its bound),
    the tier's rule and criterion, the compared steps' losses; not applicable when the stage says so."""
    if r.status == StageStatus.NOT_APPLICABLE:
        return NotApplicable(str(r.summary))

    def loss(value: Any) -> float:  # a loss that is not a number cannot be within a tier
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan")

    tier = r.tier
    return ResumeFacts(
        tuple(CheckFact(c.name, c.status in PASSING, c.kind, c.largest_difference or 0.0, c.noise, c.bound,
                        c.evidence_rows, c.row().get("margin")) for c in r.checks),
        rule=RecordedRule.of_tier(tier, twins_from_start=getattr(r, "interrupted_start", 0) == 0)
        if tier is not None else RecordedRule("exact", evidence_kept=True, pooled=True),
        steps=tuple(ComparedStep(row.get("step"), loss(row.get("loss_reference")), loss(row.get("loss_resumed")),
                                 None if row.get("loss_twin") is None else loss(row["loss_twin"]))
                    for row in r.comparison),
        tier=(tier.name, tier.multiple) if tier is not None else None, criteria=spec.accept)
