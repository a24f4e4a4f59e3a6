"""The verdict engine: each stage's status, and the record's overall one, from typed facts (issue 36).

One rule per stage for the record's verdicts:

- :mod:`core.record.build` builds the facts from the recipe's stage results and writes the verdicts it gets back (where
  a stage's own status differs from the engine's, the record says the engine's and its evidence says why);
- ``gpuaccept verify`` parses a record's own tables into the same facts (:mod:`core.record.verify` for the recipe's
  records, :mod:`core.record.command` for command mode's; a key a verdict depends on that is missing or of the wrong
  type is a named problem, :class:`RecordValueError`) and recomputes with the same functions; a stated status that
  differs from the recomputed one is a finding (:func:`stated_problems`). Command mode's record
  (core/command/record.py) states the statuses this engine gives its own tables, read by the function verify reads
  them with (:func:`core.record.command.command_stage_verdicts`): one rule, at one moment, for both kinds.

The facts are small frozen dataclasses holding exactly what a verdict depends on:

- plan (:class:`PlanFacts`): per device the bytes its fit is judged by and its capacity (core/plan/fit.py); the
  plan's own criterion ``max_plan_error_pct`` over the probe's peaks. Pass: every device fits (an unknown capacity is
  not held against it) and the criterion is met;
- probe (:class:`ProbeFacts`): per device its measured use, capacity and wrapper; the speed; the ranks; the
  attention implementation; command mode's exit and steps. Pass: it ended as asked, every device within its share
  of its capacity (the recipe: a device without a capacity cannot pass), in the strategy's wrapper, one per rank,
  the speed and attention as planned;
- evaluation: the recipe's held-out perplexities and accuracy (:class:`QualityFacts`; pass: every criterion of
  :func:`core.criteria.judge_quality` met), or command mode's metric before and after (:class:`MetricFacts`; pass:
  both finite and after better in the metric's direction);
- resume (:class:`ResumeFacts`): the checks, the checks a pass must hold (command mode's), the tier's rule and
  criterion, the compared steps, command mode's kill-point steps. Pass: every check passed, the required ones are
  there, and the numbers of a pass lie within the tier (:class:`core.stages.noise.RecordedRule`);
- a stage that does not apply is :class:`NotApplicable`; overall (:func:`overall_status`): pass exactly when every
  stage is pass or not_applicable.

Each function returns a :class:`StageVerdict`: the status (:class:`core.status.StageStatus`, whose values are the
record's strings), the reasons it did not pass, and the criteria rows it was judged by.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from core.criteria import (
    AcceptCriteria,
    DeviceUse,
    HealthFacts,
    Judgement,
    LinkFacts,
    busbw_gbps,
    judge_health,
    judge_links,
    judge_metric,
    judge_plan_error,
    judge_probe,
    judge_quality,
    judge_resume_tier,
    missed,
)
from core.plan.fit import fits_in
from core.stages.noise import RecordedRule, margin_of, same_number
from core.status import PASSING, StageStatus

#: The record's stages, in order.
STAGES = ("plan", "probe", "evaluation", "resume")


@dataclass(frozen=True)
class StageVerdict:
    """A stage's verdict: its status, why it did not pass (empty for a pass) and the criteria rows it was judged by."""

    status: StageStatus
    reasons: tuple[str, ...] = ()
    criteria: tuple[Judgement, ...] = ()

    @property
    def passed(self) -> bool:
        """pass or not_applicable."""
        return self.status in PASSING


@dataclass(frozen=True)
class NotApplicable:
    """A stage that does not apply to the run (inference has no resume; a command without a plan or evaluation)."""

    why: str = ""


def _judged(reasons: Iterable[str], rows: Iterable[Judgement] = ()) -> StageVerdict:
    """pass exactly when there is no reason against it and no criterion missed."""
    rows = tuple(rows)
    reasons = (*reasons, *(r.words() for r in missed(rows)))
    return StageVerdict(StageStatus.FAIL if reasons else StageStatus.PASS, reasons, rows)


# ------------------------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class PlannedDevice:
    """One planned device: the bytes its fit is judged by (:attr:`core.plan.fit.Fit.bytes`) and its capacity (None:
    unknown)."""

    device: str
    fit_bytes: int
    capacity_bytes: int | None


@dataclass(frozen=True)
class ComparedPeak:
    """The plan's tensor bytes against the probe's measured peak on one device (``on``: its row label)."""

    on: str
    planned_bytes: int
    measured_bytes: int


@dataclass(frozen=True)
class PlanFacts:
    devices: tuple[PlannedDevice, ...]
    compared: tuple[ComparedPeak, ...] = ()
    criteria: AcceptCriteria = field(default_factory=AcceptCriteria)


def plan_verdict(facts: PlanFacts | NotApplicable) -> StageVerdict:
    """pass exactly when every device fits (:func:`core.plan.fit.fits_in`: a device of unknown capacity is not held
    against it) and the plan's error against the probe's peaks meets ``accept.max_plan_error_pct`` when set."""
    if isinstance(facts, NotApplicable):
        return StageVerdict(StageStatus.NOT_APPLICABLE, (facts.why,) if facts.why else ())
    over = [f"{d.device}: planned {d.fit_bytes} B, above its capacity {d.capacity_bytes} B" for d in facts.devices
            if fits_in(d.fit_bytes, d.capacity_bytes) is False]
    rows = judge_plan_error(facts.criteria, [(c.on, c.planned_bytes, c.measured_bytes) for c in facts.compared])
    return _judged(over, rows)


# ------------------------------------------------------------------------------------------------------------ probe
@dataclass(frozen=True)
class ProbedDevice:
    """One probed device (one per rank): its row label, its measured use (:func:`core.plan.fit.measured_use_bytes`),
    its capacity (None: unknown) and why its wrapper is not the strategy's (None: it is)."""

    on: str
    used_bytes: int
    capacity_bytes: int | None
    wrapper_problem: str | None = None


@dataclass(frozen=True)
class ProbeFacts:
    """What the probe's verdict depends on.

    Attributes:
        devices: one per rank (a device map: one per device).
        criteria: the speed and headroom thresholds.
        step_time_s, tokens_per_s: the speed judged (None: not measured); ``speed_on`` what it was judged on.
        expected_devices: the devices the spec runs (None: not known).
        capacity_required: a device without a capacity cannot pass (the recipe judges each device against its
            planned device; command mode, measured from outside, does not hold an unknown capacity against it).
        attention, planned_attention: the attention implementation the model ran with and the one the plan is for
            (empty: not known).
        exit_code: how the process ended (0: it exited cleanly; ``"killed"``: it was killed).
        steps, expected_steps: the steps it ran and those it was asked for (None: not known).
        quit: measured until the operator quit (command mode): not judged, cancelled.
        health: the health preflight's facts per GPU (none: it did not run, or the record predates it).
        links: the links between the ranks, measured after the steps (None: one rank, or a record before them).
        rank_step_times: (rank, seconds) each rank's step time over the timed steps (the spread criterion's).
    """

    devices: tuple[ProbedDevice, ...]
    criteria: AcceptCriteria = field(default_factory=AcceptCriteria)
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    speed_on: str | None = None
    expected_devices: int | None = None
    capacity_required: bool = True
    attention: str = ""
    planned_attention: str = ""
    exit_code: int | str = 0
    steps: int | None = None
    expected_steps: int | None = None
    quit: bool = False
    health: tuple[HealthFacts, ...] = ()
    links: LinkFacts | None = None
    rank_step_times: tuple[tuple[str, float], ...] = ()


def probe_verdict(facts: ProbeFacts) -> StageVerdict:
    """pass exactly when the probe ended as asked (exit 0, every step it was asked for), measured at least one device,
    each within ``accept.max_device_share`` of its capacity (1.0: it fits), in the strategy's wrapper, one device per
    rank the spec runs, with the planned attention implementation, the speed criteria and the health preflight's
    criteria and the link criteria met; cancelled when the operator quit it."""
    if facts.quit:
        return StageVerdict(StageStatus.CANCELLED, ("measured until the operator quit: not judged",))
    reasons: list[str] = []
    if facts.exit_code != 0:
        reasons.append(f"the process ended with {facts.exit_code!r}, not exit 0")
    if facts.steps is not None and facts.expected_steps is not None and facts.steps < facts.expected_steps:
        reasons.append(f"it ran {facts.steps} of the {facts.expected_steps} steps it was asked for")
    if not facts.devices:
        reasons.append("no device was measured")
    for d in facts.devices:
        if d.wrapper_problem:
            reasons.append(f"{d.on}: {d.wrapper_problem}")
        if d.capacity_bytes is None and facts.capacity_required:
            reasons.append(f"{d.on}: no planned device with a capacity, so its fit cannot be judged")
    if facts.devices and facts.expected_devices is not None and len(facts.devices) != facts.expected_devices:
        reasons.append(f"{len(facts.devices)} device(s) measured (one per rank), the spec runs "
                       f"{facts.expected_devices}")
    if facts.attention and facts.planned_attention and facts.attention != facts.planned_attention:
        reasons.append(f"the model ran with {facts.attention} attention, the plan is for {facts.planned_attention}")
    rows = judge_probe(facts.criteria, [DeviceUse(d.on, d.used_bytes, d.capacity_bytes) for d in facts.devices],
                       facts.step_time_s, facts.tokens_per_s, facts.speed_on)
    rows += judge_health(facts.criteria, facts.health)
    rows += judge_links(facts.criteria, facts.links, facts.rank_step_times)
    return _judged(reasons, rows)


def expected_world_size(spec: Mapping[str, Any], planned_devices: int) -> int | None:
    """The ranks a spec table runs (one per planned device of a node for ddp / zero*, unless ``nproc_per_node``
    says; x ``nnodes``; a device map: one measurement per planned device), or None when the table does not say."""
    from core.spectables import TORCHRUN_STRATEGIES

    torchrun = spec.get("torchrun")
    if not isinstance(torchrun, dict):
        return None
    if spec.get("strategy") == "device_map":
        return planned_devices  # one process, a measurement per device
    if spec.get("strategy") not in TORCHRUN_STRATEGIES:
        return 1
    nproc, nnodes = torchrun.get("nproc_per_node"), torchrun.get("nnodes")
    if not isinstance(nproc, int) or not isinstance(nnodes, int):
        return None
    return (nproc or planned_devices) * nnodes


def expected_probe_devices(spec: Mapping[str, Any], planned_devices: int) -> int | None:
    """The devices one node's probe must have measured (:class:`ProbeFacts` ``expected_devices``): every rank the spec
    runs on one node; None on several nodes, where a node's record holds every rank or only its own
    (:func:`node_ranks_problem` checks which)."""
    torchrun = spec.get("torchrun")
    if isinstance(torchrun, dict) and torchrun.get("nnodes", 1) != 1:
        return None
    return expected_world_size(spec, planned_devices)


def node_ranks_problem(spec: Mapping[str, Any], planned_devices: int, ranks: list[int]) -> str | None:
    """What is wrong with the ranks a record's probe lists (``probe.devices[].rank``), or None. One node: every rank
    the spec runs, 0..N-1, once each. Several nodes: the record of the node holding rank 0 lists every node's ranks
    (gathered over the process group); another node's lists its own, one block of ``nproc_per_node`` consecutive
    ranks (torchrun's global rank = node rank x ranks per node + local rank)."""
    world = expected_world_size(spec, planned_devices)
    torchrun = spec.get("torchrun")
    nnodes = torchrun.get("nnodes", 1) if isinstance(torchrun, dict) else 1
    if world is None or spec.get("strategy") == "device_map":
        return None
    ranks = sorted(ranks)
    if nnodes > 1 and isinstance(nnodes, int) and len(ranks) == world // nnodes and ranks:
        if ranks == list(range(ranks[0], ranks[0] + len(ranks))) and ranks[0] % len(ranks) == 0:
            return None
        return f"probe.devices ranks are {ranks}: one node's ranks are {len(ranks)} consecutive ranks from a multiple of it"
    if len(ranks) != world:
        return f"probe lists {len(ranks)} device(s) (one per rank), but the spec runs {world} rank(s)"
    if world > 1 and ranks != list(range(world)):
        return f"probe.devices ranks are {ranks}: each rank 0..{world - 1} must appear once"
    return None


# ------------------------------------------------------------------------------------------------------- evaluation
@dataclass(frozen=True)
class QualityFacts:
    """The recipe's held-out evaluation: perplexity before training (inference: the only one), after training (None:
    not measured), the final next-token accuracy (None: not measured)."""

    training: bool
    before_perplexity: float
    after_perplexity: float | None
    accuracy: float | None
    criteria: AcceptCriteria = field(default_factory=AcceptCriteria)


@dataclass(frozen=True)
class MetricFacts:
    """Command mode's evaluation: the metric of the base model (None: no base known) and of the final checkpoint
    (None: not evaluated), and its direction; ``metric`` its name and ``criteria`` the thresholds
    (:func:`core.criteria.judge_metric`)."""

    higher_is_better: bool
    before: float | None
    after: float | None
    metric: str = ""
    criteria: AcceptCriteria = field(default_factory=AcceptCriteria)


def evaluation_verdict(facts: QualityFacts | MetricFacts | NotApplicable) -> StageVerdict:
    """The recipe's: pass exactly when every criterion of :func:`core.criteria.judge_quality` is met (by default
    training: both perplexities finite and after < before; inference: finite). Command mode's: pass exactly when both
    values are there, finite, and after is better than before in the metric's direction."""
    if isinstance(facts, NotApplicable):
        return StageVerdict(StageStatus.NOT_APPLICABLE, (facts.why,) if facts.why else ())
    if isinstance(facts, QualityFacts):
        return _judged((), judge_quality(facts.criteria, facts.training, facts.before_perplexity,
                                         facts.after_perplexity, facts.accuracy))
    rows = judge_metric(facts.criteria, facts.metric, facts.after)
    if facts.after is None or facts.before is None:
        return _judged(["the final checkpoint was not evaluated" if facts.after is None else
                        "nothing to compare the value after training with: no base model was evaluated"], rows)
    a, b = facts.after, facts.before
    better = math.isfinite(a) and math.isfinite(b) and (a > b if facts.higher_is_better else a < b)
    return _judged([] if better else [f"after training {a} is not better than before {b} "
                                      f"({'higher' if facts.higher_is_better else 'lower'} is better)"], rows)


# ----------------------------------------------------------------------------------------------------------- resume
@dataclass(frozen=True)
class CheckFact:
    """One check of the resume comparison: passed or not (``not_applicable``, a check this run cannot make and says why
    in its evidence, counts as passed), its kind (exact, tolerance, completeness), and for a
    tolerance check its largest difference, the twin's noise and the bound (None: not recorded)."""

    name: str
    passed: bool
    kind: str = "exact"
    largest_difference: float = 0.0
    noise: float | None = None
    bound: float | None = None
    #: what a tolerance check is computed from (core.stages.noise.Bounded.evidence; None: not kept)
    evidence: dict[str, Any] | None = None
    #: its margin as recorded (distance / bound: core.stages.noise.margin_of; None: not recorded, before schema 7)
    margin: float | None = None


@dataclass(frozen=True)
class ComparedStep:
    """One compared step: the uninterrupted run's loss, the resumed run's, the twin's (None: no twin)."""

    step: int | None
    reference: float
    resumed: float
    twin: float | None = None


@dataclass(frozen=True)
class KillSteps:
    """Command mode's kill point: checkpoint c, the kill at step k, the next checkpoint n, the last one compared."""

    checkpoint: int
    kill: int
    next_checkpoint: int
    final: int


@dataclass(frozen=True)
class ResumeFacts:
    """What the resume check's verdict depends on.

    Attributes:
        checks: every check, in order.
        required: the checks a pass holds (command mode's; the recipe's stage result is its own list of checks, and
            which checks a record of it must show is a finding of ``gpuaccept verify``, not its verdict).
        rule: the tier's rule the numbers of a pass are held to.
        steps: the compared steps.
        tier: the tier's (name, multiple), for the ``resume_tier`` criterion (None: no tier recorded).
        kill_steps: command mode's kill-point steps (None: not recorded); ``kill_steps_expected``: the record holds
            them, so a passing kill point without them cannot pass.
    """

    checks: tuple[CheckFact, ...]
    required: tuple[str, ...] = ()
    rule: RecordedRule = field(default_factory=lambda: RecordedRule("exact"))
    steps: tuple[ComparedStep, ...] = ()
    tier: tuple[str, float] | None = None
    criteria: AcceptCriteria = field(default_factory=AcceptCriteria)
    kill_steps: KillSteps | None = None
    kill_steps_expected: bool = False


def check_evidence(row: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    """A record's resume check row's ``evidence_rows`` table (None: the row has none).

    Raises:
        RecordValueError: it is there but not a table of arrays of rows (``members``: of names) (named)."""
    if "evidence_rows" not in row:
        return None
    table = row["evidence_rows"]
    if not isinstance(table, dict) or not all(
            isinstance(v, list) and all(isinstance(r, str if k == "members" else list) for r in v)
            for k, v in table.items()):
        raise RecordValueError(f"{where}.evidence_rows is not a table of arrays of rows (and the names of its members)")
    return table


def resume_verdict(facts: ResumeFacts | NotApplicable) -> StageVerdict:
    """pass exactly when there are checks and every one passed, the kill point's steps are in order (c < k < n <= the
    last compared, where recorded), nothing the numbers say contradicts a pass (:func:`resume_contradictions`), and
    the ``resume_tier`` criterion is met."""
    if isinstance(facts, NotApplicable):
        return StageVerdict(StageStatus.NOT_APPLICABLE, (facts.why,) if facts.why else ())
    reasons: list[str] = []
    failed = [c.name for c in facts.checks if not c.passed]
    if not facts.checks:
        reasons.append("no check ran")
    if failed:
        reasons.append("failed: " + ", ".join(failed))
    reasons += _kill_steps_reasons(facts) + resume_contradictions(facts)
    rows = judge_resume_tier(facts.criteria, *facts.tier) if facts.tier is not None else []
    return _judged(reasons, rows)


def resume_contradictions(facts: ResumeFacts) -> list[str]:
    """What the resume's own numbers say against a pass, in words: each passing tolerance check outside the tier
    (:meth:`core.stages.noise.RecordedRule.check_problems`); when every check passed, the required checks missing and
    each compared step outside the tier (:meth:`core.stages.noise.RecordedRule.row_problems`, with the loss check's
    noise and bound)."""
    out: list[str] = []
    by_name = {c.name: c for c in facts.checks}
    passed = bool(facts.checks) and all(c.passed for c in facts.checks)
    missing = [name for name in facts.required if name not in by_name]
    if passed and missing:
        out.append(f"resume passes without the checks {', '.join(missing)}")
    for c in facts.checks:
        if c.kind == "tolerance" and c.passed:
            out.extend(facts.rule.check_problems(c.name, c.largest_difference, c.noise, c.bound))
        if c.kind == "tolerance":
            out.extend(facts.rule.evidence_problems(c.name, c.passed, c.largest_difference, c.noise, c.bound,
                                                    c.evidence))
        if c.margin is not None and c.bound is not None and not same_number(
                c.margin, margin_of(c.largest_difference, c.bound)):
            out.append(f"resume check {c.name}: margin {c.margin} is not its distance {c.largest_difference} over its "
                       f"bound {c.bound}")
    out.extend(compared_steps_problems(facts))
    if passed:
        loss = by_name.get("loss")
        noise, bound = (loss.noise, loss.bound) if loss is not None else (None, None)
        for s in facts.steps:
            out.extend(facts.rule.row_problems(s.step, s.reference, abs(s.reference - s.resumed), noise, bound,
                                               s.twin))
    return out


def compared_steps_problems(facts: ResumeFacts) -> list[str]:
    """The compared steps the record shows (``resume.comparison``) are among the losses the ``loss`` check was computed
    from (its ``evidence_rows.losses``: step, resumed, reference), where it keeps them: a loss edited in the table shown
    is named. A step judged on several ranks (the table shows their mean) is left to the check's own numbers."""
    loss = next((c for c in facts.checks if c.name == "loss"), None)
    if loss is None or not loss.evidence or "losses" not in loss.evidence:
        return []

    def key(step: Any, resumed: Any, reference: Any) -> tuple[str, str, str]:
        return str(step), repr(float(resumed)), repr(float(reference))  # repr: nan equals nan here

    try:
        kept = [key(*row) for row in loss.evidence["losses"]]
    except (TypeError, ValueError):
        return ["resume check loss: its evidence's losses cannot be read"]
    ranks = Counter(k[0] for k in kept)
    return [f"resume step {s.step}: the losses shown (resumed {s.resumed}, reference {s.reference}) are not the ones "
            "the loss check was computed from" for s in facts.steps
            if ranks[str(s.step)] <= 1 and key(s.step, s.resumed, s.reference) not in kept]


def _kill_steps_reasons(facts: ResumeFacts) -> list[str]:
    k = facts.kill_steps
    if k is None:
        if facts.kill_steps_expected and any(c.name == "kill_point" and c.passed for c in facts.checks):
            return ["it passes its kill point without the steps c, k, n and the last checkpoint"]
        return []
    if k.checkpoint < k.kill < k.next_checkpoint <= k.final:
        return []
    return [f"its steps are out of order: checkpoint {k.checkpoint}, kill at {k.kill}, next checkpoint "
            f"{k.next_checkpoint}, compared up to {k.final}"]


# ---------------------------------------------------------------------------------------------------------- overall
def overall_status(statuses: Iterable[StageStatus | str]) -> StageStatus:
    """pass exactly when every stage is pass or not_applicable (an unknown status is not a pass)."""
    return StageStatus.PASS if all(s in PASSING for s in statuses) else StageStatus.FAIL


def stated_problems(stated: Mapping[str, Any], recomputed: Mapping[str, StageStatus | None], stated_overall: Any,
                    provenance: Mapping[str, Any], unmeasured_may_say: Collection[StageStatus]) -> list[str]:
    """Each stage's stated status against the recomputed one, then the overall status; the differences, in words.

    Args:
        stated: stage -> the status the record's verdict states.
        recomputed: stage -> the status recomputed from its table (None: its table holds no measurement, so the
            stage cannot have passed: the stated status must be one of ``unmeasured_may_say``). A stage recomputed
            not_run may also say cancelled or error (why it did not run).
        stated_overall: the record's ``verdict.status``.
        provenance: stage -> its table's provenance (for the words).
    """
    problems: list[str] = []
    for name in STAGES:
        status, said = recomputed.get(name), stated[name]
        if status is None:
            if said not in unmeasured_may_say:
                problems.append(f"verdict.stages.{name} says {said}, but its table holds no measurement "
                                f"(provenance {provenance.get(name)!r})")
        elif said != status and not (status == StageStatus.NOT_RUN
                                     and said in (StageStatus.CANCELLED, StageStatus.ERROR)):
            problems.append(f"verdict.stages.{name} says {said}, its data says {status}")
    final = [recomputed.get(name) or stated[name] for name in STAGES]
    overall = overall_status(final)
    if stated_overall != overall:
        problems.append(f"verdict.status says {stated_overall}, the stages say {overall}")
    return problems


# -------------------------------------------------------------------------------- reading a record's values as facts
class RecordValueError(TypeError):
    """A value a verdict depends on is missing from the record or of the wrong type; the message names it by its key
    path (``probe.devices[0].peak_bytes is missing``). ``gpuaccept verify`` reports it as a schema finding."""


def entry(table: Mapping[str, Any], key: str, where: str) -> Any:
    """``table[key]``, or a :class:`RecordValueError` naming ``where.key`` when it is missing."""
    if key not in table:
        raise RecordValueError(f"{where}.{key} is missing")
    return table[key]


def subtable(value: Any, where: str) -> Mapping[str, Any]:
    """A table of the record.

    Raises:
        RecordValueError: not a table, naming ``where``.
    """
    if not isinstance(value, dict):
        raise RecordValueError(f"{where} is {value!r}, not a table")
    return cast(Mapping[str, Any], value)


def tables(value: Any, where: str) -> list[Mapping[str, Any]]:
    """An array of tables of the record.

    Raises:
        RecordValueError: not an array of tables, naming ``where``.
    """
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise RecordValueError(f"{where} is not an array of tables")
    return [cast(Mapping[str, Any], v) for v in value]


def number(value: Any, where: str) -> float:
    """A number of the record as a float; ``"inf"``, ``"-inf"``, ``"nan"`` are how the writer spells non-finite ones.

    Raises:
        RecordValueError: not a number (booleans are not numbers here), naming ``where``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise RecordValueError(f"{where} is {value!r}, not a number")
    if isinstance(value, str) and value not in ("inf", "-inf", "nan"):
        raise RecordValueError(f"{where} is {value!r}, not a number")
    return float(value)


def count(value: Any, where: str) -> int:
    """A byte, token or step count: an int >= 0.

    Raises:
        RecordValueError: anything else, naming ``where``.
    """
    from core.record.schema import KINDS

    test, what = KINDS["count"]  # one rule for a count, shared with the schema check
    if not test(value):
        raise RecordValueError(f"{where} is {value!r}, not {what}")
    return cast(int, value)


def flag(value: Any, where: str) -> bool:
    """A yes / no of the record.

    Raises:
        RecordValueError: not true or false, naming ``where``.
    """
    if not isinstance(value, bool):
        raise RecordValueError(f"{where} is {value!r}, not true or false")
    return value


def text(value: Any, where: str) -> str:
    """A string of the record.

    Raises:
        RecordValueError: not a string, naming ``where``.
    """
    if not isinstance(value, str):
        raise RecordValueError(f"{where} is {value!r}, not a string")
    return value


#: the health preflight's readings the criteria judge, by kind (a device row's other keys are evidence only)
_HEALTH_COUNTS = ("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate", "pcie_width", "pcie_width_max")
_HEALTH_FLAGS = ("retired_pages_pending", "row_remap_pending", "row_remap_failed")


def health_facts(probe: Mapping[str, Any], used: Iterable[str] | None = None) -> tuple[HealthFacts, ...]:
    """The health preflight's facts from ``probe.health`` (none when it did not run or the record predates it),
    each judged reading checked for its kind first (a count, true / false, a list of names); ``used``: only the
    devices of these names (command mode reads every visible GPU and judges those the command used).

    Raises:
        RecordValueError: a judged reading of the wrong kind, named by its key path.
    """
    from core.monitor.health import HealthReport

    if "health" not in probe:
        return ()
    table = subtable(probe["health"], "probe.health")
    if table.get("status") != "measured":
        return ()
    rows = tables(entry(table, "devices", "probe.health"), "probe.health.devices")
    for i, row in enumerate(rows):
        where = f"probe.health.devices[{i}]"
        text(entry(row, "device", where), f"{where}.device")
        for key in _HEALTH_COUNTS:
            if key in row:
                count(row[key], f"{where}.{key}")
        for key in _HEALTH_FLAGS:
            if key in row:
                flag(row[key], f"{where}.{key}")
        if "clock_events" in row and not (isinstance(row["clock_events"], list)
                                          and all(isinstance(e, str) for e in row["clock_events"])):
            raise RecordValueError(f"{where}.clock_events is {row['clock_events']!r}, not a list of names")
    report = HealthReport.from_table(table)
    facts = report.facts() if report is not None else []
    wanted = None if used is None else set(used)
    return tuple(f for f in facts if wanted is None or f.on in wanted)


def timed_means(step_times: Iterable[tuple[str, list[float]]], timed: Collection[int]) -> tuple[tuple[str, float], ...]:
    """Each rank's mean seconds over the ``timed`` steps (1-based), by its name: the step times the spread criterion
    judges (core/child/probe.py ``step_timing`` takes the same mean in the child). A rank that ran fewer steps than
    ``timed`` names is left out."""
    return tuple((on, sum(times[s - 1] for s in timed) / len(timed)) for on, times in step_times
                 if timed and max(timed) <= len(times))


def links_facts(probe: Mapping[str, Any]) -> tuple[LinkFacts | None, list[str]]:
    """The link check's facts from ``probe.links`` (None when it did not run or the record predates it), every
    bandwidth recomputed from its bytes and seconds (core/criteria.py ``busbw_gbps``), and what disagrees: a recorded
    bandwidth that is not its recomputed one, or a ``slow`` list that is not what the links say.

    Raises:
        RecordValueError: a key of the wrong kind, named by its key path.
    """
    from core.stages.links import LinkReport

    if "links" not in probe:
        return None, []
    table = subtable(probe["links"], "probe.links")
    names = entry(table, "names", "probe.links")
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise RecordValueError(f"probe.links.names is {names!r}, not a list of names")
    count(entry(table, "bytes", "probe.links"), "probe.links.bytes")
    count(entry(table, "iterations", "probe.links"), "probe.links.iterations")
    text(entry(table, "backend", "probe.links"), "probe.links.backend")
    problems: list[str] = []
    collectives = []
    for i, c in enumerate(tables(entry(table, "collectives", "probe.links"), "probe.links.collectives")):
        where = f"probe.links.collectives[{i}]"
        op = text(entry(c, "op", where), f"{where}.op")
        if op not in ("all_reduce", "all_gather"):
            raise RecordValueError(f"{where}.op is {op!r}, not all_reduce or all_gather")
        ranks = count(entry(c, "ranks", where), f"{where}.ranks")
        busbw = busbw_gbps(op, ranks, count(entry(c, "bytes", where), f"{where}.bytes"),
                           number(entry(c, "seconds", where), f"{where}.seconds"))
        _recomputed(problems, where, number(entry(c, "busbw_gbps", where), f"{where}.busbw_gbps"), busbw)
        collectives.append({**c, "busbw_gbps": busbw})
    pairs = []
    for i, p in enumerate(tables(entry(table, "pairs", "probe.links"), "probe.links.pairs")):
        where = f"probe.links.pairs[{i}]"
        ends = [count(entry(p, k, where), f"{where}.{k}") for k in ("from", "to")]
        if any(e >= len(names) for e in ends):
            raise RecordValueError(f"{where} joins {ends}, but probe.links.names has {len(names)} members")
        size = count(table["bytes"], "probe.links.bytes")
        busbw = busbw_gbps("send", 2, size, number(entry(p, "seconds", where), f"{where}.seconds"))
        _recomputed(problems, where, number(entry(p, "busbw_gbps", where), f"{where}.busbw_gbps"), busbw)
        pair = {**p, "busbw_gbps": busbw}
        if "best_seconds" in p or "best_busbw_gbps" in p:  # both absent in records written before links kept it
            best = busbw_gbps("send", 2, size, number(entry(p, "best_seconds", where), f"{where}.best_seconds"))
            _recomputed(problems, where, number(entry(p, "best_busbw_gbps", where), f"{where}.best_busbw_gbps"),
                        best, "best_busbw_gbps")
            pair["best_busbw_gbps"] = best
        pairs.append(pair)
    report = LinkReport.from_table({**table, "collectives": collectives, "pairs": pairs})
    if table.get("slow", []) != report.slow:
        problems.append(f"probe.links.slow is {table.get('slow')!r}, but the links measured name {report.slow!r}")
    return report.facts(), problems


def _recomputed(problems: list[str], where: str, recorded: float, recomputed: float, key: str = "busbw_gbps"
                ) -> None:
    if not math.isclose(recorded, recomputed, rel_tol=1e-9, abs_tol=1e-12):
        problems.append(f"{where}.{key} is {recorded!r}, but its bytes and seconds give {recomputed!r}")
