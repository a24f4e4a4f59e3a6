"""The acceptance record of command mode: ``record.toml`` with ``kind = "command"`` (docs/record.md, "Command mode").

Its tables: ``spec`` (the ``[command]`` table and its sha256), ``command`` (the words as run, the program, every script
file's sha256 and git commit: :mod:`core.command.provenance`), ``environment``, ``ran`` (what the Trainer reported it
ran, or why nothing is known), ``plan``, ``probe``, ``data``, ``evaluation``, ``resume``, ``verdict`` and ``signoff``.
Every table of numbers says where they come from (``provenance``: measured, estimated with its method, not_run or
not_applicable with why); ``gpuaccept verify`` recomputes every verdict from them (:mod:`core.record.command`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any, cast

from core.record.verdicts import RecordValueError, StageVerdict, overall_status
from core.record.written import COMMAND_SCHEMA_VERSION, TOOL, clean, stage_entry, tool_version
from core.status import StageStatus, Stopped

#: what the record names each stage (the pipeline's ``train_eval`` is the record's ``evaluation``)
STAGE_KEYS = (("plan", "plan"), ("probe", "probe"), ("evaluation", "train_eval"), ("resume", "resume"))
NOTE = ("pass means every applicable check passed for this command on this box; it is not a claim about other data, "
        "longer training or other hardware")


def verdict(rec: dict[str, Any], results: dict[str, Any], stopped: dict[str, Stopped]) -> dict[str, Any]:
    """Overall verdict of the record ``rec`` (its tables written, cleaned): each stage's status is the verdict
    engine's over the facts of its table (:func:`core.record.command.command_stage_verdicts`, what ``gpuaccept verify``
    recomputes), set in its table too; its evidence is the stage's summary, and where the stage's own status differs
    from the engine's it says why; its criteria rows are the engine's. A stage without a result has the status it
    stopped with (``stopped``), else not_run. Pass only when every stage passed or does not apply."""
    from core.record.command import command_stage_verdicts

    try:
        judged, _ = command_stage_verdicts(rec)
    except RecordValueError as exc:  # never expected of the builder's own tables: the stages' words, and why
        judged = {}
        unjudged = f"; not recomputed by the record's rules: {exc}"
    else:
        unjudged = ""
    stages = {name: stage_entry(results.get(key), judged.get(name), stopped.get(key), unjudged=unjudged)
              for name, key in STAGE_KEYS}
    for name, key in STAGE_KEYS:  # the tables state the status the verdict does
        if results.get(key) is not None and judged.get(name) is not None:
            rec[name]["status"] = stages[name]["status"]
    overall = overall_status(s["status"] for s in stages.values())  # the one rule (core/record/verdicts.py)
    return cast(dict[str, Any], clean({"status": str(overall), "stages": stages, "note": NOTE}))


def build_command_record(run: Any, *, started: dt.datetime, finished: dt.datetime, env: dict[str, Any]
                         ) -> dict[str, Any]:
    """The record of a :class:`core.command.pipeline.CommandRun` (stages that did not run are marked so): its tables
    (:func:`command_tables`) and the verdict the engine gives them (:func:`verdict`)."""
    rec = command_tables(run, started=started, finished=finished, env=env)
    rec["verdict"] = verdict(rec, run.results, run.stopped)
    return rec


def judged_stage(run: Any, stage: str) -> StageVerdict | None:
    """The verdict engine's verdict of the pipeline's stage ``stage`` (``probe``, ``plan``, ``train_eval``,
    ``resume``) of ``run`` as it stands: over the table the record would hold now
    (:func:`core.record.command.command_stage_verdicts`), so the status a stage ends with live is the one its record
    states. None where the table holds no measurement.

    Raises:
        core.record.verdicts.RecordValueError: the table lacks a value a verdict depends on (never expected of the
            tables this module writes)."""
    from core.record.command import command_stage_verdicts
    from core.record.written import utc_now

    rec = command_tables(run, started=run.started, finished=utc_now(), env={})
    return command_stage_verdicts(rec)[0][dict((key, name) for name, key in STAGE_KEYS)[stage]]


def command_tables(run: Any, *, started: dt.datetime, finished: dt.datetime, env: dict[str, Any]) -> dict[str, Any]:
    """Every table of the record of ``run`` but its verdict, cleaned as written (:func:`core.record.written.clean`)."""
    from core.command.provenance import command_table

    spec, results, ref = run.spec, run.results, run.reference
    resume = results.get("resume")
    resumed = getattr(resume, "runs", {}).get("resumed") if resume is not None else None
    env_added = _env_added(run)
    rec: dict[str, Any] = {
        "schema_version": COMMAND_SCHEMA_VERSION, "kind": "command", "tool": TOOL, "tool_version": tool_version(),
        "created_utc": finished, "started_utc": started, "run_dir": str(run.run_dir.resolve()),
        "spec": {**spec.to_dict(), "hash": spec.spec_hash()},
        "command": command_table(spec, ref.argv if ref else None, resumed.argv if resumed else None, env_added),
        "environment": env,
        "ran": ran_table(ref),
        "plan": plan_table(results.get("plan"), run.stopped.get("plan")),
        "probe": probe_table(results.get("probe")),
        "accept": run.criteria.to_table(),
    }
    rec["data"], rec["evaluation"] = evaluation_tables(spec, results.get("train_eval"), ref)
    rec["resume"] = resume_table(resume)
    return cast(dict[str, Any], clean(rec))


def _env_added(run: Any) -> dict[str, str]:
    import json

    try:
        job = json.loads((run.run_dir / "reference" / "job.json").read_text(encoding="utf-8"))
        return {k: str(v) for k, v in job.get("env_added", {}).items() if k != "GPUACCEPT_JOB"}
    except (OSError, ValueError):
        return {}


def ran_table(ref: Any) -> dict[str, Any]:
    """What the script reported it ran: rank 0's Trainer report (arguments, model, config, parameters, placement), the
    world size and each rank's device; or why nothing is known (measured from outside)."""
    if ref is None:
        return {"provenance": "not_run", "why": "the command did not run"}
    trainer = ref.trainer
    if trainer is None:
        return {"provenance": "not_applicable", "view": "outside",
                "why": "the command ran, but no transformers Trainer reported itself (the Trainer hook saw none): the "
                       "script's model, batch and optimizer are not known; its memory was measured from outside"}
    keep = {k: v for k, v in trainer.items() if k not in ("kind", "t", "pid")}
    widths = sorted({w for b in ref.hook.batches.values() for w in b.get("widths", [])})
    return {"provenance": "measured", "view": "inside",
            "method": "reported by gpuaccept's callback inside the script's own Trainer (core/child/inject): "
                      "TrainingArguments, the model and its parameters at on_train_begin, the widths of the batches "
                      "its forward received", **keep, "batch_widths": widths,
            "ranks": [{"rank": t.get("rank", 0), "device": str(t.get("device")), "local_rank": t.get("local_rank", 0)}
                      for t in sorted(ref.hook.trainers, key=lambda t: t.get("rank", 0))]}


def plan_table(plan: Any, stopped: Stopped | None) -> dict[str, Any]:
    if plan is None:
        return {"provenance": "not_run", "why": stopped.why if stopped else "not run"}
    if plan.ctx is None:
        return {"provenance": "not_applicable", "status": plan.status, "why": plan.reason,
                **({"sources": plan.ran.sources} if plan.ran and plan.ran.sources else {})}
    from core.plan.fit import fit_verdicts

    data = plan.ctx.plan.to_json()
    for device, fit in zip(data["devices"], fit_verdicts(plan.ctx.plan)):
        device.update(fit_bytes=fit.bytes, fit_judged_by=fit.judged_by, fits=fit.fits)
    ran = plan.ran.spec
    return {"provenance": "estimated",
            "method": "gpuaccept's analytic plan (core/plan/memory.py: the peak of the step over its phases) of "
                      f"{plan.ran.made_from}, each setting's source in sources",
            "status": plan.status, "spec": {k: v for k, v in ran.to_dict().items() if k not in ("resume", "data")},
            "sources": plan.ran.sources, **({"ignored": plan.ran.ignored} if plan.ran.ignored else {}), **data,
            "comparison": [dataclasses.asdict(c) for c in plan.comparisons]}


def probe_table(probe: Any) -> dict[str, Any]:
    if probe is None:
        return {"provenance": "not_run"}
    return {"provenance": "measured",
            "method": "the command run once, uninterrupted; " + probe.view,
            "status": probe.status, "exit_code": probe.exit_code if probe.exit_code is not None else "killed",
            "seconds": probe.seconds, "steps": probe.steps,
            **({"expected_steps": probe.expected_steps} if probe.expected_steps else {}),
            **({"step_time_s": probe.step_time_s} if probe.step_time_s else {}),
            **({"tokens_per_s": probe.tokens_per_s} if probe.tokens_per_s else {}),
            "tree_peak_rss_bytes": probe.tree_peak_bytes, "metrics_source": probe.metrics_source,
            "checkpoints": probe.checkpoints, "log": probe.log_path,
            **({"containment": probe.containment} if probe.containment else {}),
            "devices": [dataclasses.asdict(d) for d in probe.devices], "placement": probe.placement,
            "problems": probe.problems, "findings": probe.findings,
            **({"health": probe.health.to_table()} if getattr(probe, "health", None) is not None else {})}


def evaluation_tables(spec: Any, ev: Any, ref: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    if ev is None:
        return {"provenance": "not_run"}, {"provenance": "not_run"}
    if ev.status == StageStatus.NOT_APPLICABLE:
        return {"provenance": "not_applicable", "why": ev.summary}, {"provenance": "not_applicable",
                                                                     "status": ev.status, "why": ev.summary}
    split = {k: v for k, v in ev.data.items() if k != "train_blocks"}  # the evaluation cuts only held-out blocks
    data = {"provenance": "measured", "source": spec.data, "heldout_fraction": spec.heldout_fraction,
            "independence": ev.independence, **split} if ev.data else \
        {"provenance": "not_run", "why": "the evaluation read no data of gpuaccept's (its own command's data)"}
    table: dict[str, Any] = {
        "provenance": "measured", "status": ev.status, "criterion": ev.criterion, "metric": ev.metric,
        "definition": ev.definition, "higher_is_better": ev.higher_is_better, "summary": ev.summary,
        "checkpoint": ev.checkpoint, "base": ev.base or "none", "independence": ev.independence, "log": ev.log_path,
        "before": ev.before if ev.before is not None else {"provenance": "not_run", "why": "no base model known"},
        "after": ev.after if ev.after is not None else {"provenance": "not_run", "why": "not evaluated"},
    }
    if ev.checkpoint_step is not None:
        table["checkpoint_step"] = ev.checkpoint_step
    if ref is not None:
        table["training_time_s"] = ref.seconds
        lead = [s for s in ref.steps if s.rank == 0]
        if lead:
            table["loss_per_step"] = [s.loss for s in lead]
            table["step_per_step"] = [s.step for s in lead]
            if all(s.learning_rate is not None for s in lead):
                table["learning_rate_per_step"] = [s.learning_rate for s in lead]
    return data, table


def resume_table(r: Any) -> dict[str, Any]:
    if r is None:
        return {"status": StageStatus.NOT_RUN.value, "provenance": "not_run"}
    if r.status == StageStatus.NOT_APPLICABLE:
        return {"status": StageStatus.NOT_APPLICABLE.value, "provenance": "not_applicable", "why": r.summary}
    return {"status": r.status, "provenance": "measured", "summary": r.summary,
            "checkpoint_step": r.checkpoint_step, "next_checkpoint_step": r.next_checkpoint_step,
            "kill_step": r.kill_step, "final_checkpoint_step": r.final_checkpoint_step,
            "twin_final_step": r.twin_final_step,
            "tier": dataclasses.asdict(r.tier) if r.tier else {}, "seconds": r.seconds,
            "required_files": r.required_files,
            "checks": [c.row() for c in r.checks],
            "comparison": r.comparison, "not_compared": r.not_compared, "findings": r.findings,
            "checkpoint_manifest": r.manifest,
            "runs": {name: dataclasses.asdict(s) for name, s in r.runs.items()}}
