"""The acceptance record: ``record.toml`` in the run directory, built from stage results, written atomically.

Every table that holds numbers says where they come from with ``provenance``: ``measured`` (read from live tensors, the
allocator, the OS or a clock), ``estimated`` (with ``method``), or ``not_run``. TOML has no null (docs/architecture.md §5): a value that
does not exist is omitted and its table says why.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import os
import platform
import socket
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, cast

import tomli_w

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
    evaluation_verdict,
    expected_probe_devices,
    overall_status,
    plan_verdict,
    probe_verdict,
    resume_verdict,
    timed_means,
)
from core.spec import RunSpec
from core.stages.noise import RecordedRule
from core.status import PASSING, StageStatus, Stopped

SCHEMA_VERSION = 7
#: Versions ``gpuaccept verify`` reads: 1 (a plan's total is the sum of its components), 2 (the peak of the step's
#: phases; the fit judged by the larger of the analytic and traced peaks; probe findings), 3 (the resumed process
#: verifies the checkpoint's manifest itself: the resume check ``manifest_at_load``; every table checked recursively)
#: and 4 (the ``accept`` table of criteria; each stage's verdict lists the criteria it was judged by, with the numbers;
#: next-token accuracy beside perplexity) and 5 (the resume check's tolerance is a bound from measured noise: the tier
#: says its method, ``exact`` or ``twin``, and multiple; each tolerance check its distance, the twin's noise and the
#: bound; the ``reproducible`` check of the interrupted run; the environment's test jitter or planted fault, when set).
#: 6 (each tolerance check keeps what it is computed from, ``evidence_rows``: per tensor its distance, the twin's and the
#: reference's norm; per step and rank the losses, and the twin's losses the noise comes from; verify computes each
#: check again from them). 7 (the noise is the spread of several twins branched where the resumed run branches, one
#: nudged by one ulp: the tier says how many, ``twins``; each tolerance check's evidence keeps the noise family's
#: ``members`` and ``pairs`` and, per tensor, one distance per pair, per point each member's loss; the losses are judged
#: by the norm of their differences, pooled). A record before 4 is judged by the default criteria; before 5, by the relative tolerance
#: tier it was written under; before 6, a passing twin-tier check is not shown consistent (its bound cannot be computed
#: again).
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7)
#: The version of a command-mode record (core/command/record.py): from 4 its resume tier is a bound from measured
#: noise (core/stages/noise.py), before it a relative tolerance; from 5 it holds the ``accept`` table of criteria and
#: each stage's verdict lists the criteria it was judged by (before 5: judged by the default criteria); from 6 its
#: tolerance checks keep their evidence, as the recipe's record does; from 7 several twins' spread is the noise, as in
#: the recipe's record of schema 7.
COMMAND_SCHEMA_VERSION = 7
TOOL = "gpuaccept"


def tool_version() -> str:
    try:
        return metadata.version("gpuaccept")
    except metadata.PackageNotFoundError:  # running from a source tree
        return "0+unknown"


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
    return cast(dict[str, Any], _clean(rec))  # _clean keeps a dict a dict


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
        judged = plan_verdict(plan_facts(spec, plan, probe, traced))
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
        if res is None and key in stopped:
            stop = stopped[key]
            stages[name] = {"status": StageStatus(stop.status).value, "evidence": stop.why}
        elif res is None:
            earlier = next((s for s in stages.values() if s["status"] not in PASSING), None)
            stages[name] = {"status": StageStatus.NOT_RUN.value, "evidence": "not run: an earlier stage did not pass"
                            if earlier else "not run"}
        else:
            if name == "probe":
                judged = probe_verdict(probe_facts(spec, plan, res))
            elif name == "evaluation":
                judged = evaluation_verdict(quality_facts(spec, res))
            else:
                judged = resume_verdict(resume_facts(spec, res))
            evidence = str(res.summary)
            if judged.status != res.status:  # the stage's own word differs from the record's rule: say why
                evidence += f"; {judged.status.value} by the record's rules: " + "; ".join(judged.reasons)
            stages[name] = {"status": judged.status.value, "evidence": evidence,
                            "criteria": [r.to_row() for r in judged.criteria]}
    return {"status": overall_status(s["status"] for s in stages.values()).value, "stages": stages,
            "note": "pass means every applicable check passed on this box with this spec; it is not a claim about "
                    "other data, longer training or other hardware"}


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


PROVENANCES = ("measured", "estimated", "not_run")
TABLES = ("spec", "environment", "model", "seeds", "plan", "probe", "data", "evaluation", "resume", "verdict",
          "signoff")
STAGE_STATUSES = tuple(s.value for s in (StageStatus.PASS, StageStatus.FAIL, StageStatus.NOT_APPLICABLE,
                                          StageStatus.NOT_RUN, StageStatus.CANCELLED, StageStatus.ERROR))
#: the stage statuses an overall pass allows; any other (fail, error, cancelled, not_run) is a stage not passed
PASSING_STATUSES = (StageStatus.PASS.value, StageStatus.NOT_APPLICABLE.value)
VERDICT_STAGES = ("plan", "probe", "evaluation", "resume")
TOP_LEVEL = ("schema_version", "tool", "tool_version", "created_utc", "started_utc", "run_dir")
OPTIONAL_TABLES = ("onboarding",)  # the onboarding quiz's answers, when the operator adds them


def _utc_aware(value: Any) -> bool:
    from datetime import datetime

    offset = value.utcoffset() if isinstance(value, datetime) else None
    return offset is not None and offset.total_seconds() == 0


def _version_2_problems(rec: dict[str, Any]) -> list[str]:
    """What schema 2 adds: the spec's precision, attention implementation and padding, each one of its values; a plan's
    devices with their phases (names among :data:`core.plan.phases.PHASES`), peak phase and fit."""
    from core.plan.phases import PHASES
    from core.spec import ATTN_IMPLEMENTATIONS, PADDINGS, PRECISIONS

    out = []
    for key, allowed in (("precision", PRECISIONS), ("attn_implementation", ATTN_IMPLEMENTATIONS),
                         ("padding", PADDINGS)):
        if rec["spec"].get(key) not in allowed:
            out.append(f"spec.{key} is {rec['spec'].get(key)!r}; schema 2 holds one of {', '.join(allowed)}")
    plan = rec["plan"]
    if plan.get("provenance") != "estimated":
        return out
    devices = plan.get("devices", [])
    if not isinstance(devices, list) or not all(isinstance(d, dict) for d in devices):
        return out + ["plan.devices must be an array of tables, one per device"]
    for i, d in enumerate(devices):
        where = f"plan.devices[{i}]"
        missing = [k for k in ("phases", "peak_phase", "fit_bytes", "fit_judged_by", "sum_of_components_bytes",
                               "untraced_bytes") if k not in d]
        if missing:
            out.append(f"{where} lacks {', '.join(missing)} (schema 2 plans the phases of the step and the fit)")
            continue
        phases = d["phases"]
        if not isinstance(phases, dict) or not phases or any(p not in PHASES for p in phases):
            out.append(f"{where}.phases must be a table of phases among {', '.join(PHASES)}")
        if d["fit_judged_by"] not in ("analytic", "traced", "reserved"):
            out.append(f"{where}.fit_judged_by is {d['fit_judged_by']!r}; analytic, traced or reserved")
    return out


def spec_table_hash(spec_table: dict[str, Any]) -> str:
    """sha256 of a record's ``spec`` table without its ``hash`` key, as :meth:`RunSpec.spec_hash` computes it."""
    from core.spec import canonical_sha256

    return canonical_sha256({k: v for k, v in spec_table.items() if k != "hash"})


def schema_problems(rec: dict[str, Any]) -> list[str]:
    """What in a parsed record breaks its schema version (docs/record.md); empty when it conforms.

    Checked: ``schema_version``, ``tool``, ``tool_version``; ``created_utc`` / ``started_utc``; every table of
    :data:`TABLES`; the spec's sha256; a ``provenance`` of :data:`PROVENANCES` on every table of numbers (an
    ``estimated`` one with its ``method``); verdict statuses; the sign-off (``status = "unsigned"``, or operator, role,
    decision accept / reject, comment, ``time_utc``); then every value of every table and array against the value rules
    of :func:`core.record.schema.value_problems` (finite floats, UTC date-times only at ``*_utc`` keys, non-empty keys,
    the kind of each key: counts, numbers, strings, digests, the spec's own field types).
    """
    from core.record.schema import value_problems

    out: list[str] = []
    version = rec.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int) or version not in READABLE_VERSIONS:
        out.append(f"schema_version is {rec.get('schema_version')!r}; this gpuaccept reads versions "
                   f"{', '.join(map(str, READABLE_VERSIONS))}")
        return out
    if rec.get("tool") != TOOL or not isinstance(rec.get("tool_version"), str):
        out.append("tool must be \"gpuaccept\" with a tool_version string")
    out.extend(f"{key} is missing" for key in ("created_utc", "started_utc") if key not in rec)
    tables = TABLES + (("accept",) if version >= 4 else ())
    missing = [t for t in tables if not isinstance(rec.get(t), dict)]
    if missing:
        out.append("missing tables: " + ", ".join(missing))
        return out
    out.extend(_onboarding_problems(rec.get("onboarding")))
    if version >= 4:
        out.extend(_accept_problems(rec["accept"]))
    unknown = sorted(set(rec) - set(TOP_LEVEL) - set(tables) - set(OPTIONAL_TABLES))
    if unknown:
        out.append("unknown top-level keys: " + ", ".join(unknown))
    try:
        recomputed = spec_table_hash(rec["spec"])
    except (TypeError, ValueError) as exc:  # a value JSON cannot hold (a date, a NaN): also a value finding below
        out.append(f"spec.hash cannot be recomputed: the spec table holds a value a spec cannot ({exc})")
    else:
        if rec["spec"].get("hash") != recomputed:
            out.append("spec.hash is not the sha256 of the spec table: the spec was edited (and the hash not "
                       "recomputed)")
    if version >= 2:
        out.extend(_version_2_problems(rec))
    allowed = {"environment": ("measured",), "model": ("measured",), "seeds": ("measured",),
               "plan": ("estimated", "not_run"), "probe": ("measured", "not_run"), "data": ("measured", "not_run"),
               "evaluation": ("measured", "not_run")}
    out.extend(provenance_problems(rec, allowed))
    res = rec["resume"]
    if res.get("status") != StageStatus.NOT_APPLICABLE and res.get("provenance") not in ("measured", "not_run"):
        out.append(f"resume.provenance is {res.get('provenance')!r}; measured or not_run (or status not_applicable)")
    out.extend(_verdict_and_signoff_problems(rec))
    return out + value_problems(rec)


def provenance_problems(rec: dict[str, Any], allowed: dict[str, tuple[str, ...]]) -> list[str]:
    """Each table of ``allowed`` has one of its provenances: an ``estimated`` one with its ``method``, a
    ``not_applicable`` one with its ``why`` (the recipe's records and the command's both apply it)."""
    out = []
    for table, provenances in allowed.items():
        prov = rec[table].get("provenance")
        if prov not in provenances:
            out.append(f"{table}.provenance is {prov!r}; for this table one of {', '.join(provenances)}")
        elif prov == "estimated" and not rec[table].get("method"):
            out.append(f"{table} is estimated but says no method")
        elif prov == "not_applicable" and not isinstance(rec[table].get("why"), str):
            out.append(f"{table} is not_applicable but says no why")
    return out


def _accept_problems(table: dict[str, Any]) -> list[str]:
    """The ``accept`` table (schema 4) holds criteria gpuaccept knows, each in its range (:mod:`core.criteria`), and
    ``not_set`` names exactly the criteria without a threshold."""
    import dataclasses

    from core.criteria import AcceptCriteria
    from core.errors import SpecError

    try:
        crit = AcceptCriteria.from_table(table)
    except SpecError as exc:
        return [f"the accept table: {exc}"]
    unset = sorted(f.name for f in dataclasses.fields(crit) if getattr(crit, f.name) is None)
    listed = table.get("not_set", [])
    if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed) or sorted(listed) != unset:
        return [f"accept.not_set is {table.get('not_set')!r}; the criteria without a threshold are {unset}"]
    return []


def _onboarding_problems(attempts: Any) -> list[str]:
    """Each onboarding attempt (the quiz's answers, when added) has an operator, a UTC ``time_utc``, questions whose
    ``correct`` is ``chosen == right``, ``questions_asked`` their number and ``score`` the correct ones."""
    out: list[str] = []
    if attempts is None:
        return out
    for i, a in enumerate(attempts if isinstance(attempts, list) else [attempts]):
        rows = a.get("questions") if isinstance(a, dict) else None
        ok = (isinstance(a, dict) and str(a.get("operator", "")).strip() and isinstance(rows, list)
              and all(isinstance(r, dict) and r.get("correct") == (r.get("chosen") == r.get("right")) for r in rows)
              and a.get("questions_asked") == len(rows) and a.get("score") == sum(r["correct"] for r in rows)
              and _utc_aware(a.get("time_utc")))
        if not ok:
            out.append(f"onboarding[{i}]: needs operator, UTC time_utc, questions whose correct = (chosen == "
                       "right), questions_asked = their number and score = the correct ones")
    return out


def _verdict_and_signoff_problems(rec: dict[str, Any]) -> list[str]:
    """The verdict (pass or fail, exactly the stages of :data:`VERDICT_STAGES`, each with a status and its evidence)
    and the sign-off (``status = "unsigned"`` alone, or operator, role, decision accept / reject, comment, time, and
    for an accept of a verdict that is not pass the override: :func:`_override_problems`)."""
    out: list[str] = []
    if rec["verdict"].get("status") not in (StageStatus.PASS, StageStatus.FAIL):
        out.append(f"verdict.status is {rec['verdict'].get('status')!r}; pass or fail")
    stages = rec["verdict"].get("stages")
    if not isinstance(stages, dict) or sorted(stages) != sorted(VERDICT_STAGES):
        out.append(f"verdict.stages must hold exactly {', '.join(VERDICT_STAGES)}")
    else:
        for name, item in stages.items():
            if not isinstance(item, dict) or item.get("status") not in STAGE_STATUSES or \
                    not isinstance(item.get("evidence"), str):
                out.append(f"verdict.stages.{name} needs a status ({', '.join(STAGE_STATUSES)}) and its evidence")
    so = rec["signoff"]
    if so.get("status") == "unsigned":
        if set(so) != {"status"}:
            out.append("signoff says unsigned but holds " + ", ".join(sorted(set(so) - {"status"})))
    else:
        out.extend(f"signoff.{key} is missing" for key in ("operator", "role", "comment", "time_utc") if key not in so)
        if not so.get("operator"):
            out.append("signoff.operator is empty")
        if so.get("decision") not in ("accept", "reject"):
            out.append(f"signoff.decision is {so.get('decision')!r}; accept or reject")
        out.extend(_override_problems(rec["verdict"], so))
    return out


def stages_not_passed(verdict: Any) -> list[str]:
    """The stages of a record's ``verdict`` table that did not pass: each of :data:`VERDICT_STAGES` whose status is
    not one of :data:`PASSING_STATUSES` (fail, error, cancelled, not_run, or missing), in that order. These are what a
    sign-off that accepts the record overrides (``signoff.overridden``). Empty for a verdict that is not a table."""
    stages = verdict.get("stages") if isinstance(verdict, dict) else None
    if not isinstance(stages, dict):
        return []
    return [name for name in VERDICT_STAGES
            if not (isinstance(stages.get(name), dict) and stages[name].get("status") in PASSING_STATUSES)]


def verdict_passes(verdict: Any) -> bool:
    """Whether a record's ``verdict`` table says pass: ``status = "pass"`` and every stage pass or not_applicable."""
    return isinstance(verdict, dict) and verdict.get("status") == StageStatus.PASS and not stages_not_passed(verdict)


def _override_problems(verdict: dict[str, Any], so: dict[str, Any]) -> list[str]:
    """The sign-off's override, when it has one (docs/record.md, ``signoff``): the operator's reason to accept a record
    whose verdict is not pass (``override``, a non-empty string, with the decision accept) and the stages it accepted
    although they did not pass (``overridden``: exactly :func:`stages_not_passed`)."""
    if "override" not in so and "overridden" not in so:
        return []
    out = []
    reason = so.get("override")
    if not isinstance(reason, str) or not reason.strip():
        out.append(f"signoff.override is {reason!r}; the operator's reason to accept, a non-empty string")
    if so.get("decision") != "accept":
        out.append(f"signoff.override goes with the decision accept, not {so.get('decision')!r}")
    if verdict_passes(verdict):
        out.append("signoff.override overrides nothing: the verdict is pass")
    elif so.get("overridden") != stages_not_passed(verdict):
        out.append(f"signoff.overridden is {so.get('overridden')!r}; the stages that did not pass are "
                   f"{stages_not_passed(verdict)!r}")
    return out


def _clean(value: Any) -> Any:
    """Drop None (TOML has no null), make tuples lists, keys strings and enums their values (a stage's
    :class:`~core.status.StageStatus`), keep UTC-aware datetimes."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value if v is not None]
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)  # TOML allows inf/nan, but readers of the record should see them spelled out
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return value.item()
    return value


def plain_values(value: Any, where: str = "record") -> None:
    """Refuse what must never reach the TOML writer: None, numpy (or torch) scalars, naive or non-UTC date-times.

    Raises:
        TypeError: naming the key path of the first such value.
    """
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} is not a string")
            plain_values(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            plain_values(v, f"{where}[{i}]")
    elif value is None:
        raise TypeError(f"{where} is None: TOML has no null; omit it and say why in its table")
    elif isinstance(value, dt.datetime):
        if value.utcoffset() != dt.timedelta(0):
            raise TypeError(f"{where} = {value!r} is not a UTC-aware date-time")
    elif type(value) not in (str, int, float, bool, dt.date, dt.time):
        raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__name__}, not a plain TOML value")


def write_record(record: dict[str, Any], path: Path) -> Path:
    """Write ``record`` as TOML atomically: temp file in the same directory, fsync, rename.

    Raises:
        TypeError: a value that must not be written (:func:`plain_values`), naming where it is.
    """
    plain_values(record)
    text = tomli_w.dumps(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".record-", suffix=".toml", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def utc_now() -> dt.datetime:
    """The current time, UTC-aware, to the second (naive datetimes read back as local time)."""
    return dt.datetime.now(dt.UTC).replace(microsecond=0)
