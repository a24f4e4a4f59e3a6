"""The probe of command mode: the uninterrupted run of the user's command, measured per device.

Each device gets one row (:class:`DeviceUse`), judged by what was measured on it against its capacity
(:func:`core.plan.fit.fits_in`; each device on its own: a server's total memory is not a placement):

- a CUDA device: the peak allocated its rank reported (``torch.cuda.max_memory_allocated``, inside), else the memory
  NVML lists for the job's processes on it (outside, sampled); peak reserved beside it;
- the host: per rank (``cpu:<local rank>`` under torchrun, ``cpu`` for one process) the larger of the rank's peak
  RSS (``getrusage``, inside, kernel-tracked) and the sampled RSS of its processes (outside, its data-loader workers
  included), against the host's available memory (a share per rank under torchrun, as the plan gives it).

The run passes when the command exited 0 within its time, ran every step its Trainer was asked for, and every device
held what it measured. "It ran" is not "it is good": the evaluation and the resume check judge the rest.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from core.command.reports import failure_lines
from core.command.run import RunOutcome
from core.criteria import Judgement
from core.plan.fit import fits_in
from core.status import StageStatus


@dataclass(frozen=True)
class DeviceUse:
    """What one device (one rank's, under torchrun) measured, in bytes; ``measured_bytes`` is what its fit is judged
    by (``method`` says which reading)."""

    device: str
    rank: int
    measured_bytes: int
    method: str
    capacity_bytes: int | None
    capacity_source: str
    fits: bool | None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    peak_rss_bytes: int | None = None
    sampled_bytes: int | None = None


@dataclass(frozen=True)
class CommandProbe:
    """Outcome of the probe stage. ``status``: pass | fail (``problems`` says why); cancelled when the operator
    quit while it ran (what was measured until then)."""

    status: StageStatus
    summary: str
    view: str
    exit_code: int | None
    seconds: float
    steps: int
    expected_steps: int | None
    step_time_s: float | None
    tokens_per_s: float | None
    devices: list[DeviceUse]
    placement: dict[str, dict[str, int]]
    metrics_source: str
    checkpoints: list[str]
    tree_peak_bytes: int
    log_path: str
    argv: list[str]
    problems: list[str] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    containment: str = ""  # how its processes were held: a cgroup, a subreaper (core/command/keeper.py)
    #: the criteria it was judged by (core/criteria.py ``judge_probe``), with the numbers
    criteria: list[Judgement] = field(default_factory=list)
    #: the health preflight read before the command started (core/monitor/health.py HealthReport; every GPU CUDA can
    #: use here: the devices the command used are judged)
    health: Any = None


def rank_peaks(outcome: RunOutcome) -> dict[int, dict[str, int]]:
    """Each rank's peaks as its Trainer reported them last (``train_end``, else its last logged step)."""
    out: dict[int, dict[str, int]] = {}
    for s in outcome.hook.steps:
        out[s.rank] = {**out.get(s.rank, {}), **s.memory}
    for rank, end in outcome.hook.ends.items():
        out[rank] = {**out.get(rank, {}), **{k: int(v) for k, v in end.items() if k.startswith("peak_")}}
    return out


def reported_devices(outcome: RunOutcome) -> dict[int, str]:
    """The device each rank reported (``cpu:<local rank>`` for CPU ranks under torchrun), in rank order (the ranks'
    reports arrive in any order)."""
    world = outcome.hook.world_size
    out: dict[int, str] = {}
    for t in sorted(outcome.hook.trainers, key=lambda t: int(t.get("rank", 0))):
        device = str(t.get("device", "cpu"))
        if not device.startswith("cuda"):
            device = f"cpu:{t.get('local_rank', 0)}" if world > 1 else "cpu"
        out.setdefault(int(t.get("rank", 0)), device)
    return out


def build_probe(outcome: RunOutcome, capacities: dict[str, tuple[int | None, str]]) -> CommandProbe:
    """The probe result of the uninterrupted run (see the module docstring).

    Args:
        capacities: device label -> (capacity in bytes or None, where it comes from), for every device label the
            run can have (:func:`core.plan.devices.detect_devices`).
    """
    inside, devices = rank_peaks(outcome), reported_devices(outcome)
    rows: list[DeviceUse] = []
    for rank in sorted(devices):
        rows.append(_row(devices[rank], rank, inside.get(rank, {}), outcome.peaks, capacities))
    seen = {r.device for r in rows}
    for label in sorted(outcome.peaks):  # what only the outside view saw: a script without Trainer, NVML's GPUs
        if label in seen or label in ("tree", "launcher") or (label == "cpu" and any(d.startswith("cpu:") for d in seen)):
            continue
        rows.append(_row(label, int(label.split(":")[1]) if label.startswith("cpu:") else 0, {}, outcome.peaks,
                         capacities))
    trainer = outcome.trainer
    args = (trainer or {}).get("arguments") or {}
    expected = int(args.get("max_steps") or 0) or None
    ends = [int(e.get("global_step", 0)) for e in outcome.hook.ends.values()]
    steps = max(ends) if ends else outcome.last_step()
    problems = _problems(outcome, rows, expected, steps)
    step_time = _step_time(outcome)
    tokens = _tokens_per_s(outcome, step_time)
    findings = list(outcome.problems)
    if not outcome.steps:
        findings.append(f"no per-step metrics were found ({outcome.metrics_source}): the loss curve and the resume "
                        "check's step comparison have nothing to read")
    if not outcome.checkpoints:
        findings.append("the run wrote no checkpoint matching the spec's glob in its output folder")
    if outcome.log_cut_bytes:
        findings.append(f"its output passed the log's cap: the first {outcome.log_cut_bytes} bytes were cut from "
                        f"{outcome.log_path}, its tail kept")
    view = ("inside (the Trainer hook: arguments, model, steps, peaks per rank) and outside (the process tree's RSS, "
            "sampled every 0.25 s; NVML per process on GPUs)" if trainer else
            "outside only (the process tree's RSS sampled every 0.25 s, NVML per process on GPUs): no transformers "
            "Trainer reported itself, so no peak allocated, placement or model is known")
    status = StageStatus.judged(not problems)
    where = "; ".join(f"{r.device} {r.measured_bytes / 2**30:.2f} GiB of "
                      + (f"{r.capacity_bytes / 2**30:.2f} GiB ({r.capacity_source})" if r.capacity_bytes else
                         "an unknown capacity") if r.fits is not None or r.measured_bytes else
                      f"{r.device} not sampled" for r in rows)
    counted = f"{steps} steps" if outcome.steps or outcome.hook.ends else "steps not known (no per-step metrics)"
    summary = (f"exit {outcome.exit_code} after {outcome.seconds:.1f} s, {counted}; measured peak {where}"
               if status == StageStatus.PASS else "; ".join(problems))
    placement = {f"rank {t.get('rank', 0)}": dict(t.get("placement_bytes") or {}) for t in outcome.hook.trainers}
    return CommandProbe(status=status, summary=summary, view=view, exit_code=outcome.exit_code,
                        seconds=outcome.seconds, steps=steps, expected_steps=expected, step_time_s=step_time,
                        tokens_per_s=tokens, devices=rows, placement=placement,
                        metrics_source=outcome.metrics_source, checkpoints=[c.name for c in outcome.checkpoints],
                        tree_peak_bytes=int(outcome.peaks.get("tree", 0)), log_path=str(outcome.log_path),
                        argv=list(outcome.argv), problems=problems, findings=findings,
                        containment=outcome.containment)


def _row(device: str, rank: int, inside: dict[str, int], outside: dict[str, int],
         capacities: dict[str, tuple[int | None, str]]) -> DeviceUse:
    capacity, source = capacities.get(device) or capacities.get(device.split(":")[0], (None, "unknown here"))
    sampled = outside.get(device)
    if device.startswith("cuda"):
        allocated = inside.get("peak_allocated_bytes")
        if allocated is not None:
            measured, method = allocated, "peak allocated of the rank (torch.cuda.max_memory_allocated, inside)"
        else:
            measured, method = int(sampled or 0), "NVML's memory of the job's processes on it (outside, sampled)"
    else:
        rss = inside.get("peak_rss_bytes")
        measured = max(int(rss or 0), int(sampled or 0))
        method = ("the larger of the rank's peak RSS (getrusage, inside) and its processes' sampled RSS (outside)"
                  if rss is not None else "the sampled RSS of the job's processes on the host (outside)")
    if not measured:  # a run shorter than the first sample: nothing was read, which is not 0 bytes
        method = "not sampled: the run ended before its memory was first read (every 0.25 s)"
    return DeviceUse(device=device, rank=rank, measured_bytes=measured, method=method, capacity_bytes=capacity,
                     capacity_source=source, fits=fits_in(measured, capacity) if measured else None,
                     peak_allocated_bytes=inside.get("peak_allocated_bytes"),
                     peak_reserved_bytes=inside.get("peak_reserved_bytes"),
                     peak_rss_bytes=inside.get("peak_rss_bytes"), sampled_bytes=sampled)


def _problems(outcome: RunOutcome, rows: list[DeviceUse], expected: int | None, steps: int) -> list[str]:
    out = []
    if outcome.timed_out:
        out.append(f"the command ran past command.timeout_s and was killed after {outcome.seconds:.0f} s")
    elif outcome.exit_code is None:
        out.append("the command was killed before it ended")
    elif outcome.exit_code != 0:
        said = failure_lines(outcome.log_path) or "it wrote nothing to its log"
        out.append(f"the command exited with status {outcome.exit_code}{outcome.exit_note} after "
                   f"{outcome.seconds:.1f} s; its last words: {said} (see {outcome.log_path})")
    elif expected and steps < expected:
        out.append(f"the command exited 0 after {steps} of the {expected} steps its Trainer was asked for "
                   "(max_steps): it ended early")
    out += [f"{r.device}: measured {r.measured_bytes / 2**30:.2f} GiB, above its capacity "
            f"{(r.capacity_bytes or 0) / 2**30:.2f} GiB ({r.capacity_source})" for r in rows if r.fits is False]
    return out


def _step_time(outcome: RunOutcome) -> float | None:
    """The median time between consecutive logged steps of rank 0 (seconds per step; the hook's clock, or when
    gpuaccept read each metrics line), or None with fewer than 3 steps."""
    times = sorted((s.step, s.t) for s in outcome.steps if s.rank == 0 and s.t)
    gaps = [(t2 - t1) / (s2 - s1) for (s1, t1), (s2, t2) in zip(times, times[1:]) if s2 > s1]
    return float(statistics.median(gaps[1:] if len(gaps) > 2 else gaps)) if len(gaps) >= 2 else None


def _tokens_per_s(outcome: RunOutcome, step_time: float | None) -> float | None:
    """Tokens per second over every rank: micro-batch x widest batch x accumulation x world size / step time
    (Trainer-based scripts only: nothing else says what a step holds)."""
    trainer = outcome.trainer
    if trainer is None or not step_time:
        return None
    args: dict[str, Any] = trainer.get("arguments") or {}
    widths = [int(w) for b in outcome.hook.batches.values() for w in b.get("widths", [])]
    if not widths:
        return None
    tokens: int = int(args.get("per_device_train_batch_size") or 1) * max(widths) * \
        int(args.get("gradient_accumulation_steps") or 1) * outcome.hook.world_size
    return tokens / step_time
