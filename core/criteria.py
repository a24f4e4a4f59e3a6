"""Acceptance criteria: the thresholds a team agrees on, and the one home of every rule that judges a stage by them.

A spec's ``[accept]`` table (flags ``--max-perplexity`` and the rest; the wizard's Setup section "Acceptance criteria")
sets them; what is not set is today's rule (the defaults)::

    [accept]
    max_perplexity = 40.0      # held-out perplexity after training (inference: of the fixed weights) at most this
    min_improvement = 0.05     # training: (before - after) / before above this (default 0: after < before)
    min_accuracy = 0.30        # held-out next-token accuracy (argmax = target) at least this, after training
    max_device_share = 0.90    # each device's measured use at most this share of its own capacity (headroom; 1.0)
    max_step_time_s = 2.5      # the probe's optimizer step (the slowest rank's) at most this many seconds
    min_tokens_per_s = 5000    # the probe's tokens per second (every rank) at least this
    resume_tier = "exact"      # auto (the dtype's tier on the device) or exact: every resumed loss bit for bit
    max_plan_error_pct = 25.0  # the plan's own acceptance: |measured - planned| / planned at most this, per device

Each rule is a function of plain numbers (:func:`judge_quality`, :func:`judge_probe`, :func:`judge_plan_error`,
:func:`judge_resume_tier`) returning :class:`Judgement` rows; the stages judge by them and ``gpuaccept verify``
recomputes the same rows from a record's own numbers (core/record/verify.py), so a tampered threshold or value is
caught. A criterion not set writes no row; the record's ``accept`` table says which are ``not_set``.

The headroom rule is per device (case P5 of docs: a server's total memory is not a placement): a device above its share
fails even when the sum over devices would fit the sum of their capacities.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from core.errors import SpecError
from core.settings import setting

#: ``resume_tier``: ``auto`` judges the resumed run in the tier of the device (core/stages/noise.py ``required_tier``:
#: bit-exact on the CPU; within a multiple of a twin run's measured distance where kernels are not bit-exact);
#: ``exact`` requires bit-exact agreement on every device.
ResumeTier = Literal["auto", "exact"]
RESUME_TIERS: tuple[ResumeTier, ...] = get_args(ResumeTier)


@dataclass(frozen=True)
class AcceptCriteria:
    """The thresholds a run is accepted by (the module docstring shows the TOML). ``None``: not set (no threshold).

    Attributes:
        max_perplexity: held-out perplexity after training (inference: of the fixed weights) must be <= this.
        min_improvement: training: the relative improvement ``(before - after) / before`` of held-out perplexity
            must be > this, both finite (0.0: after < before, the rule before criteria existed). In [0, 1).
        min_accuracy: held-out next-token accuracy (argmax of the logits = the target, over the counted targets)
            after training (inference: of the fixed weights) must be >= this. In (0, 1].
        max_device_share: each device's measured use (CUDA: peak allocated; CPU: the larger of peak tensors and
            peak RSS) must be <= this share of that device's capacity. In (0, 1]; 1.0 is "fits".
        max_step_time_s: the probe's step time (seconds per optimizer step, the slowest rank) must be <= this: the
            mean of its untracked steps after the warm-up (core/child/probe.py ``step_timing``; the memory tracker's
            steps are slower and not judged).
        min_tokens_per_s: the probe's tokens per second (summed over ranks) must be >= this, over the same steps.
        resume_tier: one of :data:`RESUME_TIERS`.
        max_plan_error_pct: per device, ``|measured - planned| / planned x 100`` (the probe's plan comparison) must
            be <= this; the plan stage fails otherwise (an under-estimate is also named as a finding).
    """

    # Each criterion is declared once, here (core/settings.py): its flag, form field and docs row are made from it.
    max_perplexity: float | None = setting(
        None, metavar="P", label="Max perplexity", form_order=300, stage="evaluation",
        help="held-out perplexity after training (inference: of the fixed weights) at most P",
        doc="held-out perplexity after training (inference: of the fixed weights) <= P")
    min_improvement: float = setting(
        0.0, metavar="F", label="Min improvement 0-1", form_order=310, group="training", stage="evaluation",
        help="training: (before - after) / before of held-out perplexity above F (default 0: after < before)",
        doc="training: (before - after) / before > F, both finite", doc_default="0: after < before")
    min_accuracy: float | None = setting(
        None, metavar="F", label="Min accuracy 0-1", form_order=320, stage="evaluation",
        help="held-out next-token accuracy at least F (a share, 0-1)",
        doc="held-out next-token accuracy (argmax = target, the same targets as perplexity) >= F")
    max_device_share: float = setting(
        1.0, metavar="F", label="Max device share", form_order=330, stage="probe",
        help="each device's measured peak at most F of its own capacity (headroom; default 1.0)",
        doc="on each device by itself: measured use (CUDA: peak allocated; CPU: the larger of peak tensors and peak "
            "RSS) <= F x that device's capacity", doc_default="1.0: it fits")
    max_step_time_s: float | None = setting(
        None, flag="--max-step-time", metavar="S", label="Max step time, s", form_order=340, stage="probe",
        help="the probe's optimizer step at most S seconds",
        doc="seconds per optimizer step (the slowest rank) <= S")
    min_tokens_per_s: float | None = setting(
        None, metavar="N", label="Min tokens/s", form_order=350, stage="probe",
        help="the probe's tokens per second (every rank) at least N", doc="tokens per second over every rank >= N")
    resume_tier: ResumeTier = setting(
        "auto", label="Resume tier", form_order=360, group="training", stage="resume",
        help="the resumed losses in the dtype's tier on the device (auto) or bit for bit (exact)",
        doc="`auto`: the device's tier (bit-exact on the CPU; on CUDA within 4 × (tensors) and a t quantile (the "
            "losses' norm) of the twins' measured noise); `exact`: bit for bit on any device (no twin)")
    max_plan_error_pct: float | None = setting(
        None, flag="--max-plan-error", metavar="PCT", label="Max plan error %", form_order=370, stage="plan",
        help="the plan's error against each device's measured peak at most PCT percent",
        doc="per device, |planned - measured peak| / measured peak x 100 <= PCT (the plan's own acceptance; an "
            "under-estimate is also a finding)")

    # The health preflight's criteria (core/monitor/health.py): in force by default; judged on each GPU the probe uses
    # when NVML could read it, not judged (and not written) where the preflight did not run.
    max_ecc_uncorrected: float = setting(
        0.0, metavar="N", stage="probe",
        help="uncorrected ECC errors since the driver loaded, per GPU, at most N (default 0)",
        doc="per GPU, uncorrected ECC errors since the driver loaded (NVML's volatile count) <= N; ECC off or "
            "unreadable: not judged", doc_default="0")
    max_pending_repairs: float = setting(
        0.0, metavar="N", stage="probe",
        help="memory repairs waiting for a GPU reset (retired pages, remapped rows), per GPU, at most N (default 0); "
             "a failed row remap always misses",
        doc="per GPU, page retirements (before A100) or row remaps (A100 on) pending a reset <= N; a failed row "
            "remap misses whatever N", doc_default="0")
    max_fault_clock_events: float = setting(
        0.0, metavar="N", stage="probe",
        help="clock event reasons that mean a fault (HW slowdown, HW/SW thermal, power brake) active per GPU, at "
             "most N (default 0)",
        doc="per GPU, active clock event reasons among HW slowdown, HW thermal, SW thermal and HW power brake "
            "slowdown <= N (idle, power cap and the others are recorded, not judged)", doc_default="0")
    min_pcie_width_share: float = setting(
        1.0, metavar="F", stage="probe",
        help="each GPU's PCIe link width at least F of the widest it can train to here (default 1.0)",
        doc="per GPU, PCIe link width now / the widest the GPU and its slot allow >= F (the generation drops at "
            "idle: recorded, not judged)", doc_default="1.0: full width")

    # The links between ranks (core/child/links.py; two ranks or more, under torchrun): not set by default, as no
    # bandwidth is right for every interconnect.
    min_busbw_gbps: float | None = setting(
        None, metavar="GBPS", stage="probe",
        help="the probe's link check: bus bandwidth (GB/s, nccl-tests' definition) of the all-reduce and the "
             "all-gather over every rank and of the slowest link between two nodes (one node: two ranks) at least "
             "GBPS",
        doc="bus bandwidth in GB/s (10^9 bytes/s, as nccl-tests defines it) >= GBPS: the all-reduce and the "
            "all-gather over every rank, and the slowest one-way link between two nodes (one node: two ranks)")
    max_step_time_spread: float | None = setting(
        None, metavar="F", stage="probe",
        help="the ranks' probe step times: slowest / fastest - 1 at most F (a straggler)",
        doc="over the ranks, the slowest rank's step time / the fastest's - 1 <= F (each the mean of the timed "
            "steps; a synchronous step waits for the slowest, so a straggler shows where its wait is not timed)")

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_table(cls, raw: Mapping[str, Any] | None) -> AcceptCriteria:
        """Criteria from an ``[accept]`` table (a record's too: its ``not_set`` list is read as absent keys).

        Raises:
            SpecError: an unknown key (naming the known ones), a value of the wrong type or out of its range.
        """
        raw = dict(raw or {})
        raw.pop("not_set", None)
        known = {f.name for f in dataclasses.fields(cls)}
        for key, value in raw.items():
            if key not in known:
                raise SpecError(f"accept.{key}", f"unknown criterion; known criteria are: {', '.join(sorted(known))}")
            if key == "resume_tier":
                if not isinstance(value, str):
                    raise SpecError("accept.resume_tier", f"{value!r} is not one of {', '.join(RESUME_TIERS)}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SpecError(f"accept.{key}", f"{value!r} is not a number; give a number or leave it out")
        values: dict[str, Any] = {k: (float(v) if k != "resume_tier" else v) for k, v in raw.items()}
        return cls(**values)

    def validate(self) -> None:
        """Each threshold in its range.

        Raises:
            SpecError: naming the criterion (``accept.<name>``) and what to give.
        """
        ranges = {"max_perplexity": (1.0, math.inf, "at least 1 (a perplexity is exp of a mean NLL >= 0)"),
                  "min_improvement": (0.0, 1.0, "in [0, 1): a share of the perplexity before training"),
                  "min_accuracy": (0.0, 1.0, "in (0, 1]: a share of the held-out targets"),
                  "max_device_share": (0.0, 1.0, "in (0, 1]: a share of each device's capacity"),
                  "max_step_time_s": (0.0, math.inf, "above 0 seconds"),
                  "min_tokens_per_s": (0.0, math.inf, "above 0"),
                  "max_plan_error_pct": (0.0, math.inf, "at least 0 (percent)"),
                  "max_ecc_uncorrected": (0.0, math.inf, "at least 0 (a count of errors)"),
                  "max_pending_repairs": (0.0, math.inf, "at least 0 (a count of repairs)"),
                  "max_fault_clock_events": (0.0, math.inf, "at least 0 (a count of reasons)"),
                  "min_pcie_width_share": (0.0, 1.0, "in (0, 1]: a share of the widest link"),
                  "min_busbw_gbps": (0.0, math.inf, "above 0 (GB/s)"),
                  "max_step_time_spread": (0.0, math.inf, "at least 0 (a share of the fastest rank's step time)")}
        for name, (low, high, what) in ranges.items():
            value = getattr(self, name)
            if value is None:
                continue
            ok = math.isfinite(value) and low <= value <= high
            if name in ("min_accuracy", "max_device_share", "max_step_time_s", "min_tokens_per_s",
                        "min_pcie_width_share", "min_busbw_gbps"):
                ok = ok and value > low
            if name == "min_improvement":
                ok = ok and value < high
            if not ok:
                raise SpecError(f"accept.{name}", f"{value!r} is out of range; give a number {what}")
        if self.resume_tier not in RESUME_TIERS:
            raise SpecError("accept.resume_tier", f"{self.resume_tier!r} is not one of {', '.join(RESUME_TIERS)} "
                                                  "(auto: the dtype's tier on the device; exact: bit for bit)")

    def is_default(self) -> bool:
        """No criterion set: today's rules."""
        return self == AcceptCriteria()

    def set_values(self) -> dict[str, float | str]:
        """The criteria that are set, by name (what a spec file's ``[accept]`` table holds; defaults included only
        when changed)."""
        default = AcceptCriteria()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None and getattr(self, f.name) != getattr(default, f.name)}

    def to_table(self) -> dict[str, Any]:
        """The record's ``accept`` table: every criterion in force (defaults too) and ``not_set``: those without a
        threshold (TOML has no null)."""
        table: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                 if getattr(self, f.name) is not None}
        table["not_set"] = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is None]
        return table


@dataclass(frozen=True)
class Judgement:
    """One criterion applied to one measured value (a row of a stage's ``criteria`` in the record's verdict).

    Attributes:
        criterion: the :class:`AcceptCriteria` field (or ``finite_perplexity``, the inference rule no threshold sets).
        threshold: the criterion's value (a number, or a name for ``resume_tier``).
        value: what was measured and compared (the unit is the criterion's: a share, seconds, percent); None when
            nothing was measured (``why`` says).
        met: whether the value meets the threshold; None: not judged (no value, or no capacity to share).
        on: what it was measured on: a device name (``cuda:0``, ``rank 1 (cpu:1)``), ``after training``.
        why: when ``met`` is None, why.
    """

    criterion: str
    threshold: float | str
    value: float | str | None
    met: bool | None
    on: str = ""
    why: str = ""

    def to_row(self) -> dict[str, Any]:
        """The record row (None and empty strings left out: TOML has no null)."""
        row: dict[str, Any] = {"criterion": self.criterion, "threshold": self.threshold}
        if self.value is not None:
            row["value"] = self.value
        if self.met is not None:
            row["met"] = self.met
        if self.on:
            row["on"] = self.on
        if self.why:
            row["why"] = self.why
        return row

    def words(self) -> str:
        """One line: ``max_device_share 0.9 on cuda:0: 0.95: missed``."""
        where = f" on {self.on}" if self.on else ""
        value = self.why if self.value is None else _show(self.value)
        verdict = {True: "met", False: "MISSED", None: "not judged"}[self.met]
        return f"{self.criterion} {_show(self.threshold)}{where}: {value}: {verdict}"


def _show(value: float | str) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def missed(rows: Sequence[Judgement]) -> list[Judgement]:
    """The rows whose criterion was not met (a stage with one fails)."""
    return [r for r in rows if r.met is False]


def summary(rows: Sequence[Judgement]) -> str:
    """The rows in words, the missed ones first: what a stage's evidence appends (empty without rows)."""
    ordered = sorted(rows, key=lambda r: r.met is not False)
    return "; ".join(r.words() for r in ordered)


# --------------------------------------------------------------------------------------------- the rules
def judge_quality(c: AcceptCriteria, training: bool, before_perplexity: float, after_perplexity: float | None,
                  accuracy: float | None) -> list[Judgement]:
    """The evaluation stage's criteria.

    Training: ``min_improvement`` (the relative improvement of held-out perplexity, > threshold, both finite: with
    the default 0 it is after < before); inference: ``finite_perplexity`` (the fixed weights' perplexity is finite).
    Both: ``max_perplexity`` on the final perplexity (after training; inference: the one measured) and
    ``min_accuracy`` on the final next-token accuracy, when set.

    Args:
        before_perplexity: held-out perplexity before training (inference: the only one).
        after_perplexity: after training (None for inference).
        accuracy: held-out next-token accuracy of the final model (after training; inference: the fixed weights),
            a share in [0, 1]; None when not measured.
    """
    rows: list[Judgement] = []
    final = after_perplexity if training and after_perplexity is not None else before_perplexity
    if training:
        after = after_perplexity if after_perplexity is not None else math.nan
        finite = math.isfinite(before_perplexity) and math.isfinite(after) and before_perplexity > 0
        gain = (before_perplexity - after) / before_perplexity if finite else math.nan
        rows.append(Judgement("min_improvement", c.min_improvement, gain, finite and gain > c.min_improvement,
                              on="held-out perplexity, before to after training"))
    else:
        rows.append(Judgement("finite_perplexity", "finite", before_perplexity, math.isfinite(before_perplexity),
                              on="held-out perplexity of the fixed weights"))
    when = "after training" if training else "of the fixed weights"
    if c.max_perplexity is not None:
        rows.append(Judgement("max_perplexity", c.max_perplexity, final,
                              math.isfinite(final) and final <= c.max_perplexity, on=f"held-out perplexity {when}"))
    if c.min_accuracy is not None:
        if accuracy is None:
            rows.append(Judgement("min_accuracy", c.min_accuracy, None, False, on=f"next-token accuracy {when}",
                                  why="not measured"))
        else:
            rows.append(Judgement("min_accuracy", c.min_accuracy, accuracy, accuracy >= c.min_accuracy,
                                  on=f"next-token accuracy {when}"))
    return rows


def quality_criterion(c: AcceptCriteria, training: bool) -> str:
    """The evaluation's criteria in words (the record's ``evaluation.criterion``)."""
    when = "after training" if training else "of the fixed weights"
    if training:
        parts = ["held-out perplexity after training < before training, both finite" if c.min_improvement == 0 else
                 f"held-out perplexity after training below before training by more than {100 * c.min_improvement:g} "
                 "% of it, both finite"]
    elif c.max_perplexity is None and c.min_accuracy is None:
        parts = ["measured on fixed weights: pass when finite (inference sets no threshold; read the value; a "
                 "non-finite perplexity means the model's outputs are broken)"]
    else:
        parts = ["held-out perplexity of the fixed weights finite"]
    if c.max_perplexity is not None:
        parts.append(f"held-out perplexity {when} <= {c.max_perplexity:g} (accept.max_perplexity)")
    if c.min_accuracy is not None:
        parts.append(f"next-token accuracy {when} >= {100 * c.min_accuracy:g} % (accept.min_accuracy)")
    return "; ".join(parts)


@dataclass(frozen=True)
class DeviceUse:
    """One probed device: its name as the record says it (``cuda:0``, ``rank 1 (cpu:1)``), its measured use and its
    capacity in bytes (None: unknown)."""

    on: str
    used_bytes: int
    capacity_bytes: int | None


def judge_probe(c: AcceptCriteria, devices: Sequence[DeviceUse], step_time_s: float | None,
                tokens_per_s: float | None, on: str | None = None) -> list[Judgement]:
    """The probe stage's criteria: ``max_device_share`` on every device by itself (its measured use over its own
    capacity; a device of unknown capacity is not judged), and ``max_step_time_s`` / ``min_tokens_per_s`` when set.

    The share rule is ``used_bytes <= max_device_share x capacity_bytes`` (at 1.0: the fit rule of core/plan/fit.py);
    the row's value is the share used, ``used / capacity``.
    """
    return judge_shares(c, devices) + judge_speed(c, step_time_s, tokens_per_s, on)


def judge_shares(c: AcceptCriteria, devices: Sequence[DeviceUse]) -> list[Judgement]:
    """``max_device_share`` on each device by itself (:func:`judge_probe`'s first rows)."""
    rows: list[Judgement] = []
    for d in devices:
        if d.capacity_bytes is None or d.capacity_bytes <= 0:
            rows.append(Judgement("max_device_share", c.max_device_share, None, None, on=d.on,
                                  why="capacity unknown"))
            continue
        rows.append(Judgement("max_device_share", c.max_device_share, d.used_bytes / d.capacity_bytes,
                              d.used_bytes <= c.max_device_share * d.capacity_bytes, on=d.on))
    return rows


def step_list(steps: Sequence[int]) -> str:
    """``step 3``, ``steps 2–3`` (a run), ``steps 1, 3``: 1-based step numbers in words."""
    steps = list(steps)
    if len(steps) == 1:
        return f"step {steps[0]}"
    if steps and steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}–{steps[-1]}"
    return "steps " + ", ".join(map(str, steps))


def speed_on(timed_steps: Sequence[int], tracked: bool) -> str:
    """What a speed row is judged on: ``the probe's untracked steps 2–3`` (the steps its step time is the mean of,
    and whether the memory tracker slowed them); the stage and ``gpuaccept verify`` say it alike."""
    return f"the probe's {'tracked' if tracked else 'untracked'} {step_list(timed_steps)}"


def judge_speed(c: AcceptCriteria, step_time_s: float | None, tokens_per_s: float | None,
                on: str | None = None) -> list[Judgement]:
    """``max_step_time_s`` and ``min_tokens_per_s``, when set (:func:`judge_probe`'s last rows); a speed asked for
    and not measured is missed. ``on``: the steps judged (:func:`speed_on`; by default "the probe's steps", as
    records that do not say how the probe was timed are judged)."""
    on = on or "the probe's steps"
    rows: list[Judgement] = []
    for name, value, ok in (("max_step_time_s", step_time_s, lambda v, t: v <= t),
                            ("min_tokens_per_s", tokens_per_s, lambda v, t: v >= t)):
        threshold = getattr(c, name)
        if threshold is None:
            continue
        if value is None or not math.isfinite(value):
            rows.append(Judgement(name, threshold, None, False, on=on, why="not measured"))
        else:
            rows.append(Judgement(name, threshold, float(value), ok(float(value), threshold), on=on))
    return rows


def device_label(device: str, rank: int, world_size: int) -> str:
    """How a row names a probed device: its name (``cuda:0``), or ``rank R (cuda:0)`` when several ranks ran."""
    return device if world_size <= 1 else f"rank {rank} ({device})"


def judge_plan_error(c: AcceptCriteria, compared: Sequence[tuple[str, int, int]]) -> list[Judgement]:
    """The plan stage's criterion ``max_plan_error_pct``: per compared device ``(on, planned_bytes,
    measured_bytes)``, the plan's error against the measured peak, ``|planned - measured| / measured x 100`` (the
    record's ``error_pct`` without its sign), <= the threshold. Without a probe's comparison the row is not judged
    (the probe did not measure)."""
    if c.max_plan_error_pct is None:
        return []
    if not compared:
        return [Judgement("max_plan_error_pct", c.max_plan_error_pct, None, None, on="every device",
                          why="no measured peak to compare the plan with (the probe did not measure)")]
    rows = []
    for on, planned, measured in compared:
        if measured <= 0:
            rows.append(Judgement("max_plan_error_pct", c.max_plan_error_pct, None, False, on=on,
                                  why="nothing measured on this device"))
            continue
        error = 100 * abs(planned - measured) / measured
        rows.append(Judgement("max_plan_error_pct", c.max_plan_error_pct, error, error <= c.max_plan_error_pct,
                              on=on))
    return rows


#: the criteria command mode applies (the user's own command): its measured devices, its logged step time and tokens,
#: a perplexity evaluation, the resume tier. The others need what only gpuaccept's recipe measures (the accuracy, the
#: plan comparison of its probe, the improvement judged apart from the before/after rule) and are refused there.
COMMAND_CRITERIA = ("max_device_share", "max_step_time_s", "min_tokens_per_s", "max_perplexity", "resume_tier")
#: the health preflight's criteria (:func:`judge_health`), applied in both modes: set by flag or ``[accept]``, not on
#: the forms
HEALTH_CRITERIA = ("max_ecc_uncorrected", "max_pending_repairs", "max_fault_clock_events", "min_pcie_width_share")
#: what command mode's speed is judged on (the record's criteria rows and ``verify`` say the same)
COMMAND_SPEED_ON = "the command's logged steps (the median time between them)"


def command_criteria(table: Mapping[str, Any] | None) -> AcceptCriteria:
    """Criteria for command mode from an ``[accept]`` table (a spec file's, or the flags'), each one of
    :data:`COMMAND_CRITERIA` or :data:`HEALTH_CRITERIA`.

    Raises:
        SpecError: a criterion command mode does not apply (naming those it does), or any error of
            :meth:`AcceptCriteria.from_table`.
    """
    criteria = AcceptCriteria.from_table(table)
    applied = COMMAND_CRITERIA + HEALTH_CRITERIA
    other = sorted(k for k in criteria.set_values() if k not in applied)
    if other:
        raise SpecError(f"accept.{other[0]}", f"{', '.join(other)} judge what only gpuaccept's own recipe measures; "
                                              f"your own command is judged by {', '.join(applied)}: remove it")
    return criteria


def judge_metric(c: AcceptCriteria, metric: str, after: float | None) -> list[Judgement]:
    """Command mode's evaluation criterion: ``max_perplexity`` on the final checkpoint's held-out perplexity, when set
    and the metric is perplexity (an evaluation command's own metric is judged by the before/after rule only)."""
    if c.max_perplexity is None or metric != "perplexity":
        return []
    if after is None or not math.isfinite(after):
        return [Judgement("max_perplexity", c.max_perplexity, None, False, on="held-out perplexity after training",
                          why="not measured")]
    return [Judgement("max_perplexity", c.max_perplexity, after, after <= c.max_perplexity,
                      on="held-out perplexity after training")]


def judge_resume_tier(c: AcceptCriteria, tier_name: str, tier_multiple: float) -> list[Judgement]:
    """The resume stage's criterion ``resume_tier``: the tier the resumed run was judged in (its name) meets ``exact``
    only when it is bit-exact (no noise multiple: 0); ``auto`` is the device's tier, met by construction (the row says
    which tier judged)."""
    met = tier_multiple == 0.0 if c.resume_tier == "exact" else True
    return [Judgement("resume_tier", c.resume_tier, tier_name, met, on="the resumed steps' losses")]


# --------------------------------------------------------------------------------------------- the GPU's health
@dataclass(frozen=True)
class HealthFacts:
    """One GPU's health readings as the criteria judge them (core/monitor/health.py ``DeviceHealth.facts``).

    Attributes:
        on: the device (``cuda:0``).
        ecc_uncorrected: uncorrected ECC errors since the driver loaded; None: not counted (``ecc_why``).
        ecc_aggregate: the lifetime count (evidence beside the judged one; None: not read).
        pending_repairs: page retirements or row remaps waiting for a reset; None: not read (``repairs_why``).
        remap_failed: a row remap failed (the GPU needs service).
        fault_clock_events: the active clock event reasons that mean a fault; None: not read (``clock_why``).
        clock_events: every active reason (evidence).
        pcie_width, pcie_width_max: the link's width now and the widest it can train to; None: not read.
    """

    on: str
    ecc_uncorrected: int | None = None
    ecc_why: str = ""
    ecc_aggregate: int | None = None
    pending_repairs: int | None = None
    repairs_why: str = ""
    remap_failed: bool = False
    fault_clock_events: tuple[str, ...] | None = None
    clock_events: tuple[str, ...] = ()
    clock_why: str = ""
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    pcie_why: str = ""


def judge_health(c: AcceptCriteria, devices: Sequence[HealthFacts]) -> list[Judgement]:
    """The health preflight's criteria, per GPU: ``max_ecc_uncorrected``, ``max_pending_repairs`` (a failed row
    remap misses whatever the threshold), ``max_fault_clock_events``, ``min_pcie_width_share`` (width now / the
    widest). A reading NVML did not give is not judged, with its reason; each row's ``on`` holds the evidence."""
    rows: list[Judgement] = []
    for d in devices:
        if d.ecc_uncorrected is None:
            rows.append(Judgement("max_ecc_uncorrected", c.max_ecc_uncorrected, None, None, on=d.on, why=d.ecc_why))
        else:
            life = f", {d.ecc_aggregate} over its life" if d.ecc_aggregate is not None else ""
            rows.append(Judgement("max_ecc_uncorrected", c.max_ecc_uncorrected, float(d.ecc_uncorrected),
                                  d.ecc_uncorrected <= c.max_ecc_uncorrected,
                                  on=f"{d.on} (uncorrected ECC errors since the driver loaded{life})"))
        if d.remap_failed:
            rows.append(Judgement("max_pending_repairs", c.max_pending_repairs, "failed", False,
                                  on=f"{d.on} (a row remap failed: no spare row left, the GPU needs service)"))
        elif d.pending_repairs is None:
            rows.append(Judgement("max_pending_repairs", c.max_pending_repairs, None, None, on=d.on,
                                  why=d.repairs_why))
        else:
            rows.append(Judgement("max_pending_repairs", c.max_pending_repairs, float(d.pending_repairs),
                                  d.pending_repairs <= c.max_pending_repairs,
                                  on=f"{d.on} (memory repairs waiting for a GPU reset)"))
        if d.fault_clock_events is None:
            rows.append(Judgement("max_fault_clock_events", c.max_fault_clock_events, None, None, on=d.on,
                                  why=d.clock_why))
        else:
            active = ", ".join(d.clock_events) or "none"
            rows.append(Judgement("max_fault_clock_events", c.max_fault_clock_events,
                                  float(len(d.fault_clock_events)),
                                  len(d.fault_clock_events) <= c.max_fault_clock_events,
                                  on=f"{d.on} (clock event reasons active: {active})"))
        if d.pcie_width is None or not d.pcie_width_max:
            rows.append(Judgement("min_pcie_width_share", c.min_pcie_width_share, None, None, on=d.on,
                                  why=d.pcie_why))
        else:
            share = d.pcie_width / d.pcie_width_max
            rows.append(Judgement("min_pcie_width_share", c.min_pcie_width_share, share,
                                  share >= c.min_pcie_width_share,
                                  on=f"{d.on} (PCIe link x{d.pcie_width} of x{d.pcie_width_max})"))
    return rows


# ---------------------------------------------------------------------------------------- the links between ranks
#: a link is named slow below this share of the fastest link measured between the same kind of members (the fastest
#: is what this fabric gives; a median would be slow itself where one bad node of three touches 4 of the 6 links)
SLOW_LINK_SHARE = 0.5

def bus_factor(op: str, n: int) -> float:
    """nccl-tests' correction from algorithm to bus bandwidth for ``op`` over ``n`` ranks
    (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md, "Summary"): ``all_reduce`` 2(n-1)/n,
    ``all_gather`` (n-1)/n (S: the whole output), ``send`` (point to point) 1.

    Raises:
        ValueError: an operation not listed.
    """
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "send": 1.0}
    if op not in factors:
        raise ValueError(f"no bus bandwidth factor for {op!r}; known: {', '.join(factors)}")
    return factors[op]


def algbw_gbps(size: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (10^9 bytes per second, nccl-tests' unit): ``size / seconds``; 0 when no time was
    measured."""
    return size / seconds / 1e9 if seconds > 0 else 0.0


def busbw_gbps(op: str, n: int, size: int, seconds: float) -> float:
    """Bus bandwidth in GB/s of ``op`` moving ``size`` bytes over ``n`` ranks in ``seconds``: :func:`algbw_gbps` x
    :func:`bus_factor`."""
    return algbw_gbps(size, seconds) * bus_factor(op, n)


@dataclass(frozen=True)
class LinkFacts:
    """The probe's link check as the criteria judge it (core/stages/links.py ``LinkReport.facts``).

    Attributes:
        collectives: (what, bus bandwidth in GB/s) of the all-reduce and the all-gather over every rank.
        pairs: (``from -> to``, bus bandwidth in GB/s) of each one-way link measured between two members.
    """

    collectives: tuple[tuple[str, float], ...] = ()
    pairs: tuple[tuple[str, float], ...] = ()


def slow_members(names: Sequence[str], pairs: Sequence[tuple[int, int, float]]) -> list[str]:
    """The members whose links are slow, each with its evidence: a link is slow below :data:`SLOW_LINK_SHARE` of the
    fastest link (``pairs``: ``(from, to, GB/s)``, indices into ``names``; the probe passes what each link can carry,
    its fastest operation, core/stages/links.py ``capacity``). A member is named when every link out of
    it is slow (what it sends: its NIC, its cable, a shaper on its side); then one whose every link in is slow,
    counting only links from senders not named already (with two members a slow direction names its sender)."""
    if len(pairs) < 2:
        return []
    fastest = max(bw for _, _, bw in pairs)
    slow = {(a, b) for a, b, bw in pairs if bw < SLOW_LINK_SHARE * fastest}
    named: list[str] = []
    senders: set[int] = set()
    for i, name in enumerate(names):
        out = [(a, b, bw) for a, b, bw in pairs if a == i]
        if out and all((a, b) in slow for a, b, _ in out):
            named.append(f"{name}: every link out of it is slow (down to {min(bw for *_, bw in out):.3g} GB/s; the "
                         f"fastest link {fastest:.3g} GB/s)")
            senders.add(i)
    for i, name in enumerate(names):
        into = [(a, b, bw) for a, b, bw in pairs if b == i and a not in senders]
        if i not in senders and into and all((a, b) in slow for a, b, _ in into):
            named.append(f"{name}: every link into it is slow (down to {min(bw for *_, bw in into):.3g} GB/s; the "
                         f"fastest link {fastest:.3g} GB/s)")
    return named


def judge_links(c: AcceptCriteria, links: LinkFacts | None, rank_step_times: Sequence[tuple[str, float]]
                ) -> list[Judgement]:
    """The link criteria: ``min_busbw_gbps`` on the all-reduce, the all-gather and the slowest link (``links``; None:
    not measured, one rank); ``max_step_time_spread`` on the ranks' step times ((on, seconds) each). A criterion not
    set writes no row; one set on a single rank is not judged, with the reason."""
    rows: list[Judgement] = []
    if c.min_busbw_gbps is not None:
        if links is None:
            rows.append(Judgement("min_busbw_gbps", c.min_busbw_gbps, None, None, on="the links between ranks",
                                  why="not measured: one rank, no link between ranks"))
        else:
            for on, bw in links.collectives:
                rows.append(Judgement("min_busbw_gbps", c.min_busbw_gbps, bw, bw >= c.min_busbw_gbps, on=on))
            if links.pairs:
                on, bw = min(links.pairs, key=lambda p: p[1])
                rows.append(Judgement("min_busbw_gbps", c.min_busbw_gbps, bw, bw >= c.min_busbw_gbps,
                                      on=f"the slowest of {len(links.pairs)} links: {on}"))
    if c.max_step_time_spread is not None:
        timed = [(on, t) for on, t in rank_step_times if t > 0]
        if len(timed) < 2:
            rows.append(Judgement("max_step_time_spread", c.max_step_time_spread, None, None, on="the ranks",
                                  why="one rank: no spread"))
        else:
            (fast_on, fast), (slow_on, slow) = min(timed, key=lambda r: r[1]), max(timed, key=lambda r: r[1])
            spread = slow / fast - 1
            rows.append(Judgement("max_step_time_spread", c.max_step_time_spread, spread,
                                  spread <= c.max_step_time_spread,
                                  on=f"{slow_on} {slow:.3g} s a step against {fast_on} {fast:.3g} s"))
    return rows
