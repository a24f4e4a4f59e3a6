"""The step-by-step comparison of the resume check, one for both modes: the recipe's resume stage
(:mod:`core.stages.resume`) and command mode (:mod:`core.command.resume`, the user's own training command).

Each mode reads its runs' logged steps into a :class:`StepSeries` of :class:`StepPoint` (one per optimizer step, or
one per step and rank where the ranks log apart), puts the uninterrupted, interrupted, resumed and twin runs' series
into a :class:`ResumeSeries` and calls :func:`compare_series`, which returns the same typed :class:`Check` list in
both. What differs between the modes is data, :class:`StepRules`: the exact fields compared (the recipe's child logs
the epoch; a user's metrics do not), whether a run's steps are all there to compare (the recipe's child logs every
field of every step: what one run logged and the other did not is a difference; a user's metrics may hold no learning
rate or sample ids: those are listed as not compared, never counted as passed), and each check's wording
(:class:`StepWords`: the records keep it): both subjects' rules are here, :data:`RECIPE_RULES` and
:data:`COMMAND_RULES`. The trainable set is compared once for both too (:class:`TrainableSet`,
:func:`trainable_check`).

The tier (:mod:`core.stages.noise`) judges the losses: bit-exact, or the norm of their differences from the
uninterrupted run's within ``loss_multiple`` x the noise of the twins over the same points
(:func:`core.stages.noise.pooled_losses`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from core.stages.noise import Bounded, Family, Tier, margin_of, pooled_losses
from core.status import PASSING, StageStatus

#: (rank, step): a point's place in its run
Key = tuple[int, int]


@dataclass(frozen=True)
class Check:
    """One check of the resume comparison with its evidence. A tolerance check also says the resumed run's distance
    from the reference (``largest_difference``: L2 per tensor, absolute per loss; where it is nearest its bound), the
    twin's distance there (``noise``; None without a twin) and the distance allowed (``bound``; 0: bit-exact)
    (:mod:`core.stages.noise`)."""

    name: str
    status: StageStatus  # pass | fail
    evidence: str
    kind: str = "exact"  # exact | tolerance | completeness
    tier: str | None = None
    largest_difference: float | None = None
    noise: float | None = None
    bound: float | None = None
    #: what a tolerance check is computed from (:attr:`core.stages.noise.Bounded.evidence`): ``gpuaccept verify``
    #: computes the check again from it
    evidence_rows: dict[str, Any] | None = None

    def row(self) -> dict[str, Any]:
        """The check as a record's ``resume.checks`` row (both kinds of record): its fields, the tier it was judged in
        (an exact check: ``exact``, a completeness check: ``all-present``) and a tolerance check's ``margin`` (its
        distance over its bound, :func:`core.stages.noise.margin_of`)."""
        out = {**dataclasses.asdict(self),
               "tier": self.tier or {"exact": "exact", "completeness": "all-present"}.get(self.kind, self.kind)}
        if self.kind == "tolerance" and self.bound is not None and self.largest_difference is not None:
            out["margin"] = margin_of(self.largest_difference, self.bound)
        return out


def span(steps: list[int]) -> str:
    """Steps in words: ``5-8`` for a run of consecutive steps, ``6`` for one, else the first eight listed."""
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])
    return ", ".join(map(str, steps[:8])) + (" ..." if len(steps) > 8 else "")


def verdict(checks: Sequence[Check]) -> tuple[StageStatus, list[Check]]:
    """The resume check's status from its checks (``pass``: at least one check and every one passed, a check this
    run cannot make, ``not_applicable``, counting as passed; else ``fail``) and the checks that failed: both modes'
    results are judged by this one rule (the record's, core.record.verdicts.resume_verdict, is the same)."""
    failed = [ch for ch in checks if ch.status not in PASSING]
    return StageStatus.judged(bool(checks) and not failed), failed


# ------------------------------------------------------------------------------------------- the typed series
@dataclass(frozen=True)
class StepPoint:
    """One optimizer step of one run as the comparison reads it.

    Attributes:
        loss: the step's loss (under torchrun in the recipe: the mean of the ranks' losses).
        rank: the rank that logged it (0 where the ranks' steps are merged into one point).
        learning_rate, sample_ids, epoch: None where the run's log does not say.
        rank_losses: every rank's own loss where one point holds several ranks (their mean could hide two differences
            that cancel); None: the point's ``loss`` is its one rank's.
    """

    step: int
    loss: float
    rank: int = 0
    learning_rate: float | None = None
    sample_ids: tuple[Any, ...] | None = None
    epoch: float | None = None
    rank_losses: tuple[float, ...] | None = None

    @property
    def key(self) -> Key:
        return self.rank, self.step

    @property
    def losses(self) -> tuple[float, ...]:
        """The losses judged: every rank's of the point, else its loss."""
        return self.rank_losses or (self.loss,)


@dataclass(frozen=True)
class StepSeries:
    """One run's steps in the order it logged them."""

    points: tuple[StepPoint, ...] = ()

    @classmethod
    def of(cls, points: Iterable[StepPoint]) -> StepSeries:
        return cls(tuple(points))

    def by_key(self) -> dict[Key, StepPoint]:
        """The points by (rank, step); a step logged twice by a rank: its last point."""
        return {p.key: p for p in self.points}

    def __len__(self) -> int:
        return len(self.points)


@dataclass(frozen=True)
class ResumeSeries:
    """The runs of one kill-and-resume check as series.

    Attributes:
        c: the checkpoint resumed from (its step).
        expected: the (rank, step) the resumed run must log, each exactly once: the recipe's steps c+1 .. the last
            compared; in command mode every step the uninterrupted run logged after c, on every rank.
        twins: the twin runs' (uninterrupted runs branched where the resumed run branches); empty: none ran.
        family: whose pairwise distances are the noise (:class:`core.stages.noise.Family`: ``reference`` is this
            series' reference, ``twin-i`` its ``twins[i - 1]``); None: no twin.
        resumed_trainer: the resumed run is a Trainer that reported the global step it began at
            (``trainer_start``, which must be c).
    """

    reference: StepSeries
    interrupted: StepSeries
    resumed: StepSeries
    c: int
    expected: tuple[Key, ...]
    twins: tuple[StepSeries, ...] = ()
    family: Family | None = None
    resumed_trainer: bool = False
    trainer_start: int | None = None


# ------------------------------------------------------------------------------------------- the rules of a mode
class StepWords:
    """The evidence of the step checks in one mode's words (records keep them); :class:`StepRules` names its words."""

    #: the one failed check when the uninterrupted run logged no step at all
    no_reference = "the uninterrupted run logged no step to compare with"
    #: the interrupted run logged no step the uninterrupted run logged: a failed ``reproducible`` (rules that
    #: require every step) or a note
    nothing_before = "the interrupted run logged no step the uninterrupted run logged"
    nothing_before_note = "the interrupted run before the kill: it logged no step the uninterrupted run logged"

    def global_steps(self, got: list[Key], want: list[Key], series: ResumeSeries) -> str:
        return f"resumed steps {span([s for _, s in got])}; expected {span([s for _, s in want])}"

    def reproducible(self, steps: list[int], exact: list[int], bad: list[int], judged: Bounded, tier: Tier) -> str:
        """``steps``: compared; ``exact``: where an exact field differs; ``bad``: where a loss is outside the bound."""
        if exact or bad:
            what = ("samples, learning rate or epoch" if exact else "") + (" and " if exact and bad else "") + \
                   ("losses outside the bound" if bad else "")
            return (f"before its kill, the interrupted run, which wrote the checkpoint resumed from, differs from the "
                    f"uninterrupted run at steps {span(sorted(set(exact) | set(bad)))} ({what}): the checkpoint "
                    f"resumed from is not this run's; {judged.describe(tier, 'losses', tier.loss_multiple)}")
        return (f"before its kill, the interrupted run equals the uninterrupted run at steps {span(steps)} "
                f"(samples, learning rates and epochs exactly); {judged.describe(tier, 'losses', tier.loss_multiple)}")

    def field_equal(self, label: str, compared: int, steps: list[int]) -> str:
        return f"{label} equal at the {compared} resumed steps ({span(steps)})"

    def field_absent(self, label: str, name: str) -> str:
        """The note of an exact field neither run's steps hold (rules that do not require every field)."""
        return f"{label}: the steps hold none"

    def loss(self, bad: list[int], unmatched: list[int], judged: Bounded | None, tier: Tier) -> str:
        """``judged`` None: no resumed step had a reference to compare with."""
        return ((f"loss of the resumed run outside the bound at steps {span(bad)}; " if bad else "")
                + (f"other ranks than the reference's at steps {span(unmatched)}; " if unmatched else "")
                + (judged.describe(tier, "resumed losses", tier.loss_multiple) if judged is not None else
                   "the resumed run logged no step the uninterrupted run logged"))


#: the exact fields of a step and their words
FIELD_LABELS = {"epoch": "epoch", "learning_rate": "learning rate", "sample_ids": "sample ids"}


@dataclass(frozen=True)
class StepRules:
    """What one mode's comparison asks of its series.

    Attributes:
        fields: the exact fields compared step by step (:data:`FIELD_LABELS`), in the order of their checks.
        complete: True where every run logs every field of every step (the recipe's child): what one run logged
            and the other did not (a None, a step without a reference) is a difference, and an interrupted run with
            no step to compare fails ``reproducible``. False (a user's metrics): a field is compared where both runs
            logged it, and what neither logged is listed as not compared.
        words: the evidence in the mode's words.
    """

    fields: tuple[str, ...]
    complete: bool
    words: StepWords


#: the recipe's rules: its child logs the epoch, learning rate and sample ids of every step
RECIPE_RULES = StepRules(("epoch", "learning_rate", "sample_ids"), complete=True, words=StepWords())


class CommandWords(StepWords):
    """The step checks' evidence in command mode's words."""

    no_reference = ("the uninterrupted run wrote no per-step metrics (none found: command.metrics), so nothing shows "
                    "the resumed run continues as it did; write JSON lines with step and loss, or train with "
                    "transformers' Trainer")

    def global_steps(self, got: list[Key], want: list[Key], series: ResumeSeries) -> str:
        start = f"; the resumed Trainer began at global step {series.trainer_start}" if series.resumed_trainer else ""
        return (f"resumed steps {span(sorted({s for _, s in got}))}, expected {span(sorted({s for _, s in want}))} "
                f"(every step the uninterrupted run logged after {series.c}, {len({r for r, _ in want})} rank(s))"
                f"{start}")

    def reproducible(self, steps: list[int], exact: list[int], bad: list[int], judged: Bounded, tier: Tier) -> str:
        if exact or bad:
            return (f"before any kill, the interrupted run differs from the uninterrupted one at steps "
                    f"{span(sorted(set(bad) | set(exact)))} ({judged.describe(tier, 'losses', tier.loss_multiple)}): the command does "
                    "not give the same run twice, so no resume can be shown to continue it; seed everything it draws "
                    "(e.g. transformers.set_seed before building the model and its adapters) or make it "
                    "deterministic")
        return (f"before the kill, the interrupted run equals the uninterrupted one at steps {span(steps)} (learning "
                f"rate and samples exactly; {judged.describe(tier, 'losses', tier.loss_multiple)})")

    def field_equal(self, label: str, compared: int, steps: list[int]) -> str:
        return f"{label} of the resumed run equal at {compared} step(s)"

    def field_absent(self, label: str, name: str) -> str:
        return f"{label}: the metrics hold none" + (
            " (sample ids: a metrics line's sample_ids, or the Trainer hook's batch digests)" if name == "sample_ids"
            else "")

    def loss(self, bad: list[int], unmatched: list[int], judged: Bounded | None, tier: Tier) -> str:
        return ((f"resumed loss outside the bound at steps {span(bad)}; " if bad else "")
                + (f"other ranks than the reference's at steps {span(unmatched)}; " if unmatched else "")
                + (judged.describe(tier, "resumed losses (every rank)", tier.loss_multiple) if judged is not None else
                   "the resumed run logged no step the uninterrupted run logged"))


#: command mode's rules: a user's metrics hold a step and its loss, maybe its learning rate and sample ids (no epoch)
COMMAND_RULES = StepRules(("learning_rate", "sample_ids"), complete=False, words=CommandWords())


@dataclass(frozen=True)
class StepComparison:
    """What :func:`compare_series` found.

    Attributes:
        checks: ``global_steps``, ``reproducible``, one exact check per field compared, ``loss``.
        rows: one per resumed step of rank 0 with a reference: step, learning_rate, loss_reference, loss_resumed,
            difference, and loss_twin where the first twin logged the step.
        not_compared: what could not be compared (rules that do not require every field), in words.
    """

    checks: list[Check]
    rows: list[dict[str, Any]]
    not_compared: list[str]


# ------------------------------------------------------------------------------------------- the comparison
Pair = tuple[StepPoint, StepPoint]  # (a run's point, the reference's at the same rank and step)


def compare_series(series: ResumeSeries, tier: Tier, rules: StepRules) -> StepComparison:
    """The step-by-step checks of a resume, in order:

    - ``global_steps``: the resumed run logged each ``expected`` (rank, step) exactly once and nothing else (and a
      resumed Trainer began at global step c);
    - ``reproducible``: before its kill the interrupted run (which wrote the checkpoint resumed from) equals the
      reference: the exact fields exactly, the losses within the bound;
    - per exact field of ``rules``, the resumed run equals the reference at every step (exact);
    - ``loss``: every resumed step and rank within the bound.

    Without a noise measurement the tier needs (no twin, or one that did not log a step compared) ``loss`` and
    ``reproducible`` fail saying so.
    """
    words = rules.words
    if not series.reference:
        return StepComparison([Check("loss", StageStatus.FAIL, words.no_reference, kind="tolerance", tier=tier.name)],
                              [], [])
    ref = series.reference.by_key()
    before = _pairs(series.interrupted, ref)
    after = _pairs(series.resumed, ref)
    not_compared: list[str] = []
    checks = [_global_steps(series, words)]
    _, why_not = _family_losses(before + after, series, tier)
    noise_before, noise_after = _family_losses(before, series, tier)[0], _family_losses(after, series, tier)[0]
    if why_not:
        checks += [Check(name, StageStatus.FAIL, why_not, kind="tolerance", tier=tier.name)
                   for name in ("loss", "reproducible")]
    else:
        checks += _reproducible(before, rules, tier, (noise_before, series.family), not_compared)
    unmatched = sorted({p.step for p in (*series.resumed.points, *series.interrupted.points) if p.key not in ref})
    for name in rules.fields:
        checks += _exact_field(name, after, series, rules, unmatched, not_compared)
    if not why_not:
        checks.append(_loss(after, rules, tier, (noise_after, series.family)))
    return StepComparison(checks, _rows(series, ref), not_compared)


def _pairs(run: StepSeries, ref: dict[Key, StepPoint]) -> list[Pair]:
    return [(p, ref[p.key]) for p in run.points if p.key in ref]


def _global_steps(series: ResumeSeries, words: StepWords) -> Check:
    got = sorted(p.key for p in series.resumed.points)
    want = sorted(series.expected)
    ok = got == want and (not series.resumed_trainer or series.trainer_start == series.c)
    return Check("global_steps", StageStatus.judged(ok), words.global_steps(got, want, series))


#: the noise family's losses at each point a check compares and the family (None, None: an exact tier)
Noise = tuple[list[list[float]] | None, Family | None]


def _family_losses(pairs: list[Pair], series: ResumeSeries, tier: Tier) -> tuple[list[list[float]] | None, str]:
    """(per point of ``pairs``, in the order of :func:`_loss_triples`, the losses of the noise family's members, "")
    for a twin tier; (None, "") for an exact one; (None, why) without twins or when a twin did not log a point
    compared."""
    if tier.exact:
        return None, ""
    if not series.twins or series.family is None:
        return None, "no twin run to measure the noise with"
    runs = [series.reference.by_key() if m == "reference" else series.twins[int(m.rsplit("-", 1)[1]) - 1].by_key()
            for m in series.family.members]
    missing = sorted({a.step for a, b in pairs for run in runs
                      if a.key not in run or len(run[a.key].losses) < min(len(a.losses), len(b.losses))})
    if missing:
        return None, f"a twin run logged no loss at steps {span(missing)}, so no noise bound could be measured"
    return [[run[a.key].losses[i] for run in runs] for a, b in pairs
            for i in range(min(len(a.losses), len(b.losses)))], ""


def _loss_triples(pairs: list[Pair]) -> list[tuple[int, float, float]]:
    """(step, the run's loss, the reference's) of every rank of every pair."""
    return [(a.step, x, y) for a, b in pairs for x, y in zip(a.losses, b.losses)]


def _differ(name: str, a: StepPoint, b: StepPoint) -> bool:
    return bool(getattr(a, name) != getattr(b, name))


def _logged(name: str, pairs: list[Pair], complete: bool) -> list[Pair]:
    """The pairs where field ``name`` is compared: all of them where every field is logged (``complete``: a None is
    a value like any other), else those where both runs logged it."""
    if complete:
        return pairs
    return [(a, b) for a, b in pairs if getattr(a, name) is not None and getattr(b, name) is not None]


def _reproducible(before: list[Pair], rules: StepRules, tier: Tier, noise: Noise,
                  not_compared: list[str]) -> list[Check]:
    """``reproducible``: the interrupted run before its kill equals the reference; no step to compare: a failed check
    (``rules.complete``) or a note."""
    if not before:
        if rules.complete:
            return [Check("reproducible", StageStatus.FAIL, rules.words.nothing_before, kind="tolerance",
                          tier=tier.name)]
        not_compared.append(rules.words.nothing_before_note)
        return []
    exact = sorted({a.step for name in rules.fields for a, b in _logged(name, before, rules.complete)
                    if _differ(name, a, b)})
    judged, bad = pooled_losses(_loss_triples(before), noise[0], noise[1], tier.loss_multiple)
    return [Check("reproducible", StageStatus.judged(not (exact or bad)),
                  rules.words.reproducible(sorted({a.step for a, _ in before}), exact, bad, judged, tier),
                  kind="tolerance", tier=tier.name, largest_difference=judged.distance, noise=judged.noise,
                  bound=judged.bound, evidence_rows=judged.evidence)]


def _exact_field(name: str, after: list[Pair], series: ResumeSeries, rules: StepRules, unmatched: list[int],
                 not_compared: list[str]) -> list[Check]:
    """The check of one exact field over the resumed steps; a field no step holds (rules that do not require every
    field): a note instead. With ``rules.complete`` a step without a reference (``unmatched``) fails it too."""
    label = FIELD_LABELS[name]
    have = _logged(name, after, rules.complete)
    if not have and not rules.complete:
        not_compared.append(rules.words.field_absent(label, name))
        return []
    diff = sorted({a.step for a, b in have if _differ(name, a, b)})
    missing = unmatched if rules.complete else []
    if diff or missing:
        return [Check(name, StageStatus.FAIL, f"{label} of the resumed run differs at steps {span(diff)}"
                      + (f"; no reference for {missing}" if missing else ""))]
    return [Check(name, StageStatus.PASS,
                  rules.words.field_equal(label, len(have), [p.step for p in series.resumed.points]))]


def _loss(after: list[Pair], rules: StepRules, tier: Tier, noise: Noise) -> Check:
    """``loss``: every resumed step and rank within the bound; a step logged by other ranks than the reference's, or
    no step to compare, fails."""
    judged, bad = pooled_losses(_loss_triples(after), noise[0], noise[1], tier.loss_multiple)
    unmatched = sorted({a.step for a, b in after if len(a.losses) != len(b.losses)})
    ok = judged.ok and not unmatched and bool(after)
    return Check("loss", StageStatus.judged(ok),
                 rules.words.loss(bad, unmatched, judged if after else None, tier),
                 kind="tolerance", tier=tier.name, largest_difference=judged.distance, noise=judged.noise,
                 bound=judged.bound, evidence_rows=judged.evidence)


def _rows(series: ResumeSeries, ref: dict[Key, StepPoint]) -> list[dict[str, Any]]:
    twins = series.twins[0].by_key() if series.twins else {}
    return [{"step": p.step, "learning_rate": p.learning_rate, "loss_reference": ref[p.key].loss,
             "loss_resumed": p.loss, "difference": abs(p.loss - ref[p.key].loss),
             **({"loss_twin": twins[p.key].loss} if p.key in twins else {})}
            for p in series.resumed.points if p.rank == 0 and p.key in ref]


# -------------------------------------------------------------------------------------------- the trainable set
@dataclass(frozen=True)
class TrainableSet:
    """The tensors a run trains: how many, their parameters, the sha256 of their sorted names joined by newlines (the
    Trainer hook's ``trainable_names_sha256``, core/child/inject/trainer_hook.py) and the names where the run reported
    them (the recipe's worker does; the hook sends their digest only)."""

    tensors: int
    parameters: int
    names_sha256: str
    names: tuple[str, ...] = ()

    @classmethod
    def of_names(cls, names: Iterable[str], parameters: int) -> TrainableSet:
        """From the names of the trainable tensors and their parameters (the recipe's ``trainable`` event)."""
        import hashlib

        ordered = tuple(sorted(names))
        return cls(len(ordered), parameters, hashlib.sha256("\n".join(ordered).encode("utf-8")).hexdigest(), ordered)

    @classmethod
    def of_trainer(cls, trainer: dict[str, Any] | None) -> TrainableSet | None:
        """From the Trainer hook's report of a run (None: it reported none, or not the trainable set)."""
        if not trainer or "trainable_names_sha256" not in trainer:
            return None
        return cls(int(trainer.get("trainable_tensors") or 0), int(trainer.get("trainable_parameters") or 0),
                   str(trainer["trainable_names_sha256"]))


def trainable_check(reference: TrainableSet | None, resumed: TrainableSet | None) -> Check:
    """``trainable_set``: the resumed run trains exactly the reference's tensors (the digest of their names and their
    parameters; exact), both subjects. A resume that rebuilt the model differently (other LoRA targets, a frozen layer
    unfrozen) trains another set from the same checkpoint; where the names are known, the first that differ are
    named."""
    if reference is None or resumed is None:
        return Check("trainable_set", StageStatus.FAIL, "no trainable set reported by the "
                     + ("reference" if reference is None else "resumed") + " run")
    if (reference.names_sha256, reference.parameters) == (resumed.names_sha256, resumed.parameters):
        return Check("trainable_set", StageStatus.PASS,
                     f"the same {resumed.tensors} trainable tensors, {resumed.parameters:,} parameters, as the "
                     "uninterrupted run")
    a, b = set(resumed.names), set(reference.names)
    only = sorted(a - b)[:3] + sorted(b - a)[:3] if a and b else []  # names known on both sides
    return Check("trainable_set", StageStatus.FAIL,
                 f"resumed {resumed.tensors} tensors / {resumed.parameters:,} parameters vs reference "
                 f"{reference.tensors} / {reference.parameters:,}; "
                 + (f"differ: {', '.join(only)}" if only else "their names differ (sha256)"))
