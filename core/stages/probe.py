"""Probe stage: real steps in a child process, a measured ledger per device, compared with the plan.

Everything here is **measured** (from the child's live tensors, the CUDA allocator, or the OS), never estimated; the
comparison with the plan states which measured quantity it compares with.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from core.criteria import (
    DeviceUse,
    Judgement,
    device_label,
    judge_health,
    judge_links,
    judge_shares,
    judge_speed,
    missed,
    speed_on,
    step_list,
)
from core.errors import StageError
from core.events import ChildStarted, DeviceBound, Event, FirstStepWait, Message, Progress
from core.plan.fit import UNDER_ESTIMATE_TOLERANCE, UNDER_ESTIMATE_WORD, under_estimate
from core.protocol.events import (
    ChildEvent,
    DeviceMap,
    DeviceUuid,
    Ledger,
    Ledgers,
    LinkCheck,
    ModelBuilt,
    Placement,
    ProbeStep,
)
from core.protocol.job import worker_job
from core.spec import RunSpec
from core.stages.childproc import SINGLE, Launch, check_exit, start_child, watch
from core.stages.links import LinkReport
from core.status import StageStatus


@dataclass(frozen=True)
class DeviceMeasurement:
    """What the probe measured on one device (one rank under torchrun), in bytes.

    ``peak_bytes`` is what is compared with the plan's total: peak allocated on CUDA; on CPU the peak of live tensor
    bytes tracked in the step (the process's peak RSS, which also holds the Python and torch runtime, is kept beside it).
    ``weights_bytes`` is this rank's share of the weights after wrapping (a shard under FSDP, all of them under DDP).
    """

    device: str
    weights_bytes: int
    gradients_bytes: int
    optimizer_states_bytes: int
    peak_bytes: int
    peak_method: str
    peak_reserved_bytes: int | None
    peak_rss_bytes: int
    rss_after_load_bytes: int
    parameters: int
    trainable_parameters: int
    rank: int = 0
    world_size: int = 1
    host: str = ""
    wrapper: str = ""
    threads: int = 0  # torch's CPU threads in this rank's process (torchrun sets 1 per rank unless told)
    quantised_weights_bytes: int | None = None  # QLoRA: the 4-bit weights as stored (packed and constants)
    step_times_s: list[float] = field(default_factory=list)  # this rank's seconds of each probe step, step 1 first


@dataclass(frozen=True)
class ProbeTiming:
    """How the probe's speed (``step_time_s``, ``tokens_per_s``) was timed: the mean of ``timed_steps`` (1-based);
    ``timed_tracked``: those ran under the CPU's memory tracker (only when no untracked step ran after the warm-up);
    ``warmup_excluded``: step 1 (one-off allocations, the optimizer's states created) is not among them;
    ``tracked_steps``: the steps the tracker followed for memory (none on CUDA); ``tracked_step_time_s``: their time,
    after the warm-up when one ran after it (the slowest rank's; None when no step was tracked)."""

    timed_steps: list[int]
    timed_tracked: bool
    warmup_excluded: bool
    tracked_steps: list[int]
    tracked_step_time_s: float | None = None

    def words(self, step_time_s: float) -> str:
        """``0.15 s/step (step 3 untracked, warm-up step 1 left out; steps 1–2 tracked for memory: 0.90 s at step
        2)``: the figure and how it was timed, for the screen and the headless summary."""
        how = [f"{step_list(self.timed_steps)} {'tracked for memory' if self.timed_tracked else 'untracked'}"]
        how.append("warm-up step 1 left out" if self.warmup_excluded else "the warm-up included: the only step")
        if self.tracked_steps and not self.timed_tracked and self.tracked_step_time_s is not None:
            after = [s for s in self.tracked_steps if s > 1] or self.tracked_steps
            how[-1] += (f"; {step_list(self.tracked_steps)} tracked for memory: {self.tracked_step_time_s:.2f} s"
                        + (f" at {step_list(after)}" if after != self.tracked_steps else ""))
        return f"{step_time_s:.2f} s/step ({', '.join(how)})"


def probe_timing(ledgers: list[Ledger]) -> ProbeTiming | None:
    """How the ledgers' speed was timed (every rank runs the same steps the same way), from the slowest rank's ledger;
    None for ledgers that do not say (written before the probe kept it)."""
    slowest = max(ledgers, key=lambda e: e.step_time_s, default=None)
    if slowest is None or slowest.timed_steps is None or slowest.tracked_steps is None:
        return None
    tracked_times = [e.tracked_step_time_s for e in ledgers if e.tracked_step_time_s is not None]
    timed, tracked = list(slowest.timed_steps), list(slowest.tracked_steps)
    return ProbeTiming(timed_steps=timed, timed_tracked=any(s in tracked for s in timed),
                       warmup_excluded=1 not in timed, tracked_steps=tracked,
                       tracked_step_time_s=max(tracked_times) if tracked_times else None)


@dataclass(frozen=True)
class PlanComparison:
    """Plan vs measurement on one device. ``planned_bytes``: the plan's peak of tensors (the bytes its fit is judged
    by, core/plan/fit.py, without the overhead line: peak allocated holds no CUDA context); ``error_pct`` = 100 x (planned -
    measured) / measured; ``under_estimate``: (measured - planned) / planned when above the tolerance, else None."""

    device: str
    planned_bytes: int
    measured_bytes: int
    error_pct: float
    compared: str
    components: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # name -> (planned, measured or None)
    rank: int = 0
    under_estimate: float | None = None
    #: how each component's measured value was obtained, or why there is none (name -> words; see :func:`how_measured`)
    how: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of the probe stage. ``status``: pass (ran, fits on every device, ran as the strategy asked) | fail.

    ``devices`` holds one measurement per rank (one for a single process); ``problems`` says why it failed."""

    status: StageStatus
    steps: int
    step_time_s: float
    tokens_per_s: float
    devices: list[DeviceMeasurement]
    placement: dict[str, dict[str, int]]
    comparisons: list[PlanComparison]
    log_path: str
    summary: str
    problems: list[str] = field(default_factory=list)
    layers: dict[str, list[str]] = field(default_factory=dict)  # device_map: which modules went to which device
    findings: list[str] = field(default_factory=list)  # what passed but must be read: an under-estimating plan
    attention: str = ""  # the attention implementation the model ran with (its config's _attn_implementation)
    lora_targets: list[str] = field(default_factory=list)  # LoRA: the modules peft adapted (all-linear resolved)
    lora_modules: int = 0  # LoRA: how many modules carry an adapter
    judgements: list[Judgement] = field(default_factory=list)  # the criteria it was judged by (core/criteria.py)
    timing: ProbeTiming | None = None  # which steps step_time_s is the mean of, and whether tracked
    health: Any = None  # the health preflight (core/monitor/health.py HealthReport), read before the probe started
    links: LinkReport | None = None  # the links between the ranks (two ranks or more), measured after the steps


#: The wrapper Trainer must have put the model in for each torchrun strategy (the class name of
#: ``trainer.model_wrapped``; FSDP2's ``fully_shard`` makes the class ``FSDP<name>``, FSDP1 wraps in
#: ``FullyShardedDataParallel``).
EXPECTED_WRAPPERS = {"ddp": "DistributedDataParallel", "zero3": "FullyShardedDataParallel"}


def wrapper_problem(strategy: str, wrapper: str) -> str | None:
    """Why the wrapper a rank measured under is not the one ``strategy`` asked for, or None when it is (or when the
    strategy runs without one). Trainer and accelerate fall back without an error: FSDP asked for on the CPU runs
    as DDP (accelerate enables FSDP only on accelerators), so the memory the plan divides by N is not divided."""
    expected = EXPECTED_WRAPPERS.get(strategy)
    name = wrapper.split(" (", 1)[0]  # the class name; what follows says how it ran
    if expected is None or name == expected or (strategy == "zero3" and name.startswith("FSDP")):
        return None
    asked = "zero3 (FSDP full shard)" if strategy == "zero3" else strategy
    why = (" (accelerate enables FSDP only on accelerators; on the CPU Trainer falls back to DDP without an error)"
           if strategy == "zero3" and wrapper.startswith("DistributedDataParallel") else "")
    return f"strategy {asked} was asked for, but the model ran wrapped in {wrapper or 'nothing'}{why}"


def rank_ledgers(events: list[ChildEvent]) -> list[Ledger]:
    """Every rank's ledger, in global rank order: rank 0's ``ledgers`` event (every rank's, gathered over the process
    group, so several nodes' ledgers arrive on node 0) when there is one, else each ``ledger`` event read here."""
    gathered = next((e.ledgers for e in events if isinstance(e, Ledgers)), None)
    ledgers = gathered if gathered is not None else [e for e in events if isinstance(e, Ledger)]
    return sorted(ledgers, key=lambda e: e.global_rank)


def run_probe(
    spec: RunSpec, model_path: Path, job_dir: Path, device: str, plan: Any,
    cancelled: Callable[[], bool] | None = None,
    launch: Launch = SINGLE, traced: dict[str, Any] | None = None, health: Any = None,
) -> Generator[Event, None, ProbeResult]:
    """Run the probe child and yield its progress; return the :class:`ProbeResult`.

    Args:
        launch: :func:`core.stages.childproc.launch_options` for several ranks (torchrun); one process by default.
        traced: the traced plan's table (:func:`core.plan.traced.traced_table`): each device is compared with the plan its
            fit was judged by (the larger of the analytic and traced peaks, core/plan/fit.py).
        health: the health preflight read before the probe (core/monitor/health.py ``HealthReport``); its criteria are
            judged with the probe's (a GPU that misses one fails the stage).

    Raises:
        StageError: the child failed (its error and log are named), or fewer ranks reported than were started.
    """
    names = launch.names(device)
    ranks = f"{launch.nproc} ranks under torchrun on {', '.join(names)}" if launch.nproc > 1 else device
    yield Message("probe", text=f"starting the probe child on {ranks} ({spec.probe_steps} real steps)")
    if spec.torchrun.nnodes > 1:
        t = spec.torchrun
        yield Message("probe", text=f"waiting for all {t.nnodes} nodes at the rendezvous {t.rdzv_endpoint} (id "
                                    f"{t.rdzv_id}): start the same spec on every node; torchrun waits up to 900 s "
                                    "for them to join")
    child = start_child("probe", job_dir, worker_job(spec, "probe", model_path, device, names), launch)
    yield ChildStarted("probe", run="probe", pid=child.pid, log_path=str(child.log_path))
    wait = FirstStepWait("probe", "probe", child.pid, "probe", tracked=not device.startswith("cuda"))
    yield wait.started()
    for event in watch(child, cancelled=cancelled):
        if (waiting := wait.see(event)) is not None:
            yield waiting
        if isinstance(event, DeviceUuid):
            yield DeviceBound("probe", device=event.device, uuid=event.uuid)
        if isinstance(event, ProbeStep) and event.leads:
            yield Progress("probe", run="probe", step=event.step, total=event.total)
    check_exit(child)
    ledgers = rank_ledgers(child.events)
    gathered = any(isinstance(e, Ledgers) for e in child.events)
    # rank 0's node gathers every node's ledgers; another node has its own ranks' (node 0's record holds them all)
    world = spec.world_size(len(names)) if gathered or spec.torchrun.nnodes == 1 else launch.nproc
    if len(ledgers) != world:
        raise StageError(f"probe: {len(ledgers)} rank(s) reported a ledger, {world} were started (see {child.log_path})")
    return probe_result(spec, child.events, ledgers, plan, traced, device, str(child.log_path), health)


def probe_result(spec: RunSpec, events: list[ChildEvent], ledgers: list[Ledger], plan: Any,
                 traced: dict[str, Any] | None, device: str, log_path: str, health: Any = None) -> ProbeResult:
    """The stage's result from the child's events and every rank's ledger: a measurement per device compared with
    its plan; fail when a device is above its capacity, ran in another wrapper than the strategy asks for, or the
    model ran with another attention implementation than planned. An under-estimating plan is a finding."""
    placement: dict[str, dict[str, int]] = {}
    for e in events:
        if isinstance(e, Placement):
            placement.update(e.devices)
    placement = dict(sorted(placement.items()))  # ranks' events arrive in any order: list devices in order
    measurements = [_measurement(ledger, placement) for ledger in _per_device(ledgers)]
    comparisons, problems, findings, judgements = judge_devices(spec, plan, traced, measurements)
    # the slowest rank sets the pace of a synchronous step; each rank's time is of its untracked steps (ProbeTiming)
    step_time_s = max(e.step_time_s for e in ledgers)
    tokens_per_s = sum(e.tokens_per_s for e in ledgers)
    timing = probe_timing(ledgers)
    speed = judge_speed(spec.accept, step_time_s, tokens_per_s,
                        on=speed_on(timing.timed_steps, timing.timed_tracked) if timing is not None else None)
    problems.extend(f"the probe's steps: {r.words()}" for r in missed(speed))
    judgements += speed
    if health is not None:
        rows = judge_health(spec.accept, health.facts())
        problems.extend(f"health preflight: {r.words()}" for r in missed(rows))
        judgements += rows
    check = next((e for e in events if isinstance(e, LinkCheck)), None)
    links = LinkReport.from_event(check) if check is not None else None
    if links is not None:
        findings.extend(f"slow link: {name}" for name in links.slow)
    rows = judge_links(spec.accept, links.facts() if links is not None else None, rank_step_times(ledgers))
    problems.extend(f"the links between ranks: {r.words()}" for r in missed(rows))
    judgements += rows
    used = next((e for e in events if isinstance(e, ModelBuilt)), None)
    attention = used.attention if used is not None else ""
    if attention and attention != spec.attn_implementation:
        problems.append(f"{_where(measurements[0]) if measurements else device}: the model ran with {attention} "
                        f"attention, not the {spec.attn_implementation} the plan is for (transformers fell back): plan "
                        f"it with --attn-implementation {attention}")
    first = ledgers[0]
    return ProbeResult(
        status=StageStatus.judged(not problems),
        steps=first.steps,
        step_time_s=step_time_s,
        tokens_per_s=tokens_per_s,
        devices=measurements,
        placement=placement,
        comparisons=comparisons,
        log_path=log_path,
        summary=_summary(first, measurements, comparisons, problems, findings, timing, step_time_s)
        + (f"; {links.summary()}" if links is not None else ""),
        problems=problems,
        layers=next((e.layers for e in events if isinstance(e, DeviceMap)), {}),
        findings=findings,
        attention=str(attention),
        lora_targets=list((used.lora_targets if used is not None else None) or []),
        lora_modules=int((used.lora_modules if used is not None else None) or 0),
        judgements=judgements,
        timing=timing,
        health=health,
        links=links,
    )


def against_plan(result: ProbeResult, spec: RunSpec, plan: Any, traced: dict[str, Any] | None) -> ProbeResult:
    """``result`` compared with the plan a record holds: each device's comparison and under-estimate finding made
    again with :func:`judge_devices` over ``plan`` and ``traced``, the rest as measured. The one rule for which plan a
    probe is compared with, whatever came first: a probe that started before the traced plan arrived (the wizard's
    Ctrl+N on Plan) is compared, in the record, with the fit the record holds (the larger of the analytic and traced
    peaks; core/plan/fit.py), as headless compares it. Idempotent: a probe judged with ``traced`` is returned equal.
    """
    comparisons, _, findings, _ = judge_devices(spec, plan, traced, result.devices)
    kept = [f for f in result.findings if UNDER_ESTIMATE_WORD not in f]
    return replace(result, comparisons=comparisons, findings=findings + kept)


def rank_step_times(ledgers: list[Ledger]) -> list[tuple[str, float]]:
    """Each rank's step time (the mean of its timed steps) with the rank's name, as the spread criterion judges it."""
    return [(device_label(e.device, e.global_rank, e.world_size), e.step_time_s) for e in ledgers]


def judge_devices(spec: RunSpec, plan: Any, traced: dict[str, Any] | None, measurements: list[DeviceMeasurement],
                  ) -> tuple[list[PlanComparison], list[str], list[str], list[Judgement]]:
    """Each measured device against its plan (the bytes its fit was judged by), against the share of its own
    capacity the criteria allow (``accept.max_device_share``, :func:`core.criteria.judge_probe`; 1.0: it fits), and
    its wrapper against the strategy. Returns (comparisons, problems, findings, the share judgements)."""
    from core.plan.fit import fit_verdicts

    plan_by_name = {d.device.name: d for d in plan.devices}
    fit_by_name = {f.device: f for f in fit_verdicts(plan, traced)}
    comparisons: list[PlanComparison] = []
    problems: list[str] = []
    findings: list[str] = []
    judgements: list[Judgement] = []
    for m in measurements:
        plan_device = plan_by_name.get(m.device)
        if plan_device is not None:
            comparison = compare_with_plan(plan_device, m, fit_by_name[m.device].tensor_bytes, plan.quantised)
            comparisons.append(comparison)
            if comparison.under_estimate is not None:
                findings.append(f"{_where(m)}: {UNDER_ESTIMATE_WORD}: measured peak {_gib(m.peak_bytes)} is "
                                f"{100 * comparison.under_estimate:.1f} % above the plan's {_gib(comparison.planned_bytes)} "
                                f"of tensors (the tolerance is {100 * UNDER_ESTIMATE_TOLERANCE:.0f} %): a device sized "
                                "to the plan would run out of memory")
        capacity = plan_device.device.capacity_bytes if plan_device is not None else None
        share = judge_shares(spec.accept, [DeviceUse(_where(m), measured_use(m), capacity)])
        judgements += share
        if missed(share) and capacity is not None:
            limit = ("its capacity" if spec.accept.max_device_share == 1.0 else
                     f"{100 * spec.accept.max_device_share:g} % of its capacity (accept.max_device_share)")
            problems.append(f"{_where(m)}: measured {_gib(measured_use(m))} is above {limit} {_gib(capacity)}")
        wrong = wrapper_problem(spec.strategy, m.wrapper)
        if wrong:
            problems.append(f"{_where(m)}: {wrong}")
    return comparisons, problems, findings, judgements


def _summary(first: Ledger, measurements: list[DeviceMeasurement], comparisons: list[PlanComparison],
             problems: list[str], findings: list[str], timing: ProbeTiming | None = None,
             step_time_s: float | None = None) -> str:
    step_s = first.step_time_s if step_time_s is None else step_time_s
    speed = timing.words(step_s) if timing is not None else f"{step_s:.2f} s/step"
    summary = (f"{first.steps} steps on {_span_names(measurements)}, {speed}, "
               + "; ".join(f"{_where(m)} measured peak {_gib(m.peak_bytes)}"
                           + (f", plan {_gib(c.planned_bytes)} ({_relation(c)})" if c else "")
                           for m, c in ((m, next((c for c in comparisons if c.rank == m.rank), None))
                                        for m in measurements)))
    if problems:
        summary += "; FAIL: " + "; ".join(dict.fromkeys(p.split(": ", 1)[1] for p in problems))
    if findings:
        summary += "; " + "; ".join(findings)
    return summary


def _per_device(ledgers: list[Ledger]) -> list[Ledger]:
    """One ledger per device: a rank's ledger as it is, or, for one process over several devices (device_map), its
    ledger once per device with that device's weights and peaks (gradients and optimizer states: inference has none)."""
    out = []
    for ledger in ledgers:
        if ledger.per_device is None:
            out.append(ledger)
            continue
        for d in ledger.per_device:
            out.append(replace(ledger, device=d["device"], weights_bytes=d["weights_bytes"],
                               peak_allocated_bytes=d["peak_allocated_bytes"],
                               peak_reserved_bytes=d["peak_reserved_bytes"], wrapper="device_map (accelerate)"))
    return out


def measured_use(m: DeviceMeasurement) -> int:
    """What a device's fit is judged by: peak allocated on CUDA; on the CPU the larger of the tensor peak and the
    process's peak RSS (the whole process competes for host memory, runtime included)."""
    from core.plan.fit import measured_use_bytes

    return measured_use_bytes(m.device, m.peak_bytes, m.peak_rss_bytes)


def _measurement(ledger: Ledger, placement: dict[str, dict[str, int]]) -> DeviceMeasurement:
    name = ledger.device
    place = placement.get(name, {"parameters": 0, "trainable": 0})
    reserved: int | None
    if name.startswith("cuda"):
        peak, method = ledger.peak_allocated_bytes, "peak allocated (torch.cuda.max_memory_allocated)"
        reserved = ledger.peak_reserved_bytes
    else:
        peak, method, reserved = ledger.peak_tracked_tensor_bytes, str(ledger.tracked_method), None
    return DeviceMeasurement(
        device=name,
        weights_bytes=ledger.weights_bytes,
        gradients_bytes=ledger.gradients_bytes,
        optimizer_states_bytes=ledger.optimizer_states_bytes,
        peak_bytes=int(peak or 0),
        peak_method=method,
        peak_reserved_bytes=reserved,
        peak_rss_bytes=ledger.peak_rss_bytes,
        rss_after_load_bytes=ledger.rss_after_load_bytes,
        parameters=place["parameters"],
        trainable_parameters=place["trainable"],
        rank=ledger.global_rank,
        world_size=ledger.world_size,
        host=ledger.host,
        wrapper=ledger.wrapper,
        threads=ledger.torch_threads,
        quantised_weights_bytes=ledger.quantised_weights_bytes,
        step_times_s=list(ledger.step_times_s or []),
    )


def _where(m: DeviceMeasurement) -> str:
    return device_label(m.device, m.rank, m.world_size)


def _span_names(ms: list[DeviceMeasurement]) -> str:
    hosts = {m.host for m in ms}
    names = ", ".join(m.device + (f"@{m.host}" if len(hosts) > 1 else "") for m in ms)
    return names if len(ms) == 1 else f"{len(ms)} ranks ({names})"


def compare_with_plan(plan_device: Any, m: DeviceMeasurement, fit_bytes: int | None = None,
                      quantised: Any = None) -> PlanComparison:
    """Compare a device's plan with its measurement, component by component where measured.

    The plan's peak of tensors (``fit_bytes``, the bytes its fit is judged by, default its analytic peak, without the
    ``overhead`` line: the CUDA context is not in peak allocated, and the CPU's runtime is not a tensor) is compared
    with the peak allocated on CUDA, or the tracked tensor peak on the CPU (not RSS). QLoRA (``quantised``: the plan's
    :class:`~core.plan.quant.QuantisedBase`) adds ``quantised_weights``: the 4-bit weights as stored, planned and
    measured.
    """
    overhead = plan_device.lines["overhead"].bytes
    planned = (plan_device.total_bytes if fit_bytes is None else fit_bytes) - overhead
    components = {
        "weights": (plan_device.lines["weights"].bytes, m.weights_bytes),
        "gradients": (plan_device.lines["gradients"].bytes, m.gradients_bytes),
        "optimizer_states": (plan_device.lines["optimizer_states"].bytes, m.optimizer_states_bytes),
        "overhead": (overhead, runtime_bytes(m)),
    }
    if quantised is not None:
        components["quantised_weights"] = (quantised.quantised_bytes, m.quantised_weights_bytes)
    for name, line in plan_device.lines.items():
        components.setdefault(name, (line.bytes, None))
    error = 100.0 * (planned - m.peak_bytes) / m.peak_bytes if m.peak_bytes else 0.0
    return PlanComparison(
        rank=m.rank,
        device=m.device,
        planned_bytes=planned,
        measured_bytes=m.peak_bytes,
        error_pct=error,
        compared=f"the plan's peak of tensors (without the overhead line) vs {m.peak_method}",
        components=components,
        under_estimate=under_estimate(planned, m.peak_bytes),
        how={name: how_measured(name, m) for name in components},
    )


def runtime_bytes(m: DeviceMeasurement) -> int | None:
    """What a CPU process held beyond its tensors at its peak: peak RSS minus the peak of live tensors, in bytes; the
    measured counterpart of the plan's CPU overhead line. None on CUDA (the CUDA context is outside torch's allocator
    and is not read per process here) and when RSS is below the tensors (pages of a tensor not yet written are not
    resident, so the difference says nothing)."""
    if m.peak_reserved_bytes is not None or m.peak_rss_bytes < m.peak_bytes:
        return None
    return m.peak_rss_bytes - m.peak_bytes


def how_measured(name: str, m: DeviceMeasurement) -> str:
    """Words for how the probe measured component ``name`` on this device, or why it did not."""
    if name in ("weights", "gradients", "optimizer_states"):
        return "summed over the tensors the model and the optimizer hold after a step"
    if name == "quantised_weights" and m.quantised_weights_bytes is not None:
        return "summed over the 4-bit weights (Params4bit) and their quant_state tensors, each once"
    if name == "overhead":
        if m.peak_reserved_bytes is not None:
            return "not measured: the CUDA context is outside torch's allocator, so outside peak allocated"
        if runtime_bytes(m) is None:
            return "not measured: peak RSS is below the peak of live tensors (unwritten pages are not resident)"
        return "peak RSS minus the peak of live tensors (the runtime is not a tensor)"
    return "not measured on its own: inside the peak"


def _relation(c: PlanComparison) -> str:
    """Where the plan stands to the measurement, in words: "plan 0.1 % above the measurement"."""
    if abs(c.error_pct) < 0.05:
        return "plan equal to the measurement within 0.05 %"
    return f"plan {abs(c.error_pct):.1f} % {'above' if c.error_pct > 0 else 'below'} the measurement"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
