"""The resume check's tolerance: a bound from measured noise, not a guessed one (docs/architecture.md §4).

Two runs of the same training are bit-identical on the CPU here (a fixed thread count; docs/architecture.md §6) but not
on a GPU: bf16 kernels reorder reductions (atomics, split-K GEMMs, the attention backward), and two uninterrupted runs
drift apart by a few units in the last bits from their first steps (measured on an H200: the losses of two runs of the
same LoRA job differed by 3e-4 from step 6; benchmarks/results/gpu/). A relative tolerance guessed per dtype cannot
tell that drift from a broken resume: it fails tensors near zero (a LoRA ``lora_B`` starts at zero; Adam's moments are
tiny) and passes faults that happen to be small.

So the noise is measured, where the resumed run diverges. The resumed run starts from the state the interrupted run
started from (the reference's checkpoint before c, or step 0): from there on, it and the reference are two runs of the
same training that differ only by the noise (and by a fault, if the resume has one). **Twins** branch from that same
state (:data:`TWINS` of them, each in a process of its own, uninterrupted, to the last compared step; the recipe's
:func:`core.stages.resume.run_twins`, command mode's twins of the whole command): every pair of them, and each twin
with the reference where both started at step 0 with nothing loaded, is a sample of the noise with no fault in it
(both took the same path: a fault in loading the branch point is in both). The second twin is **nudged**: every
trainable parameter moved by one unit in the last place before its first step (:mod:`core.child.inject.jitter`), so
the family's spread is never 0 even where the kernels happen to be bit-identical: the growth of the smallest possible
difference is the floor of the noise, measured.

The statistics are pooled, so that one multiple holds with known power (benchmarks/README.md, "resume false fails"):

- **losses**: over the (step, rank) points a check compares, the L2 norm of the differences ``sqrt(sum (run -
  reference)^2)``, against the root mean square over the noise pairs of the same norm of their differences
  (:func:`pooled_losses`); the resumed run passes where the norm is at most :func:`loss_multiple_for` x the noise (at least
  the last float32 bit of the largest loss: a float32 loss rounds either way).
- **tensors** (final weights, optimizer moments), per tensor and norm-wise: ``||resumed - reference||_2 <= k *
  max(noise_t, r * ||reference_t||_2)``, ``noise_t`` the root mean square over the noise pairs of their distance in that
  tensor and ``r`` the quantity's relative noise over all its tensors (:func:`bound_tensor_rows`): a tensor the twins
  happened to reproduce exactly is still allowed the noise its share of the whole would have. Norms, not elements: a
  tensor near zero is judged by an absolute distance, never by a relative error.

Without a twin (:func:`required_tier`: the CPU's kernels, ``resume.noise = "off"``, or ``accept.resume_tier =
"exact"``), every quantity must be bit-exact. Quantised optimizer states (bitsandbytes' 8-bit AdamW: uint8 codes, a
256-value code book and an fp32 absmax per block) are compared dequantised (:func:`optimizer_state_tensors`), never as
codes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.protocol.determinism import EXACT_MODE_WORDS
from core.spectables import TWINS

if TYPE_CHECKING:
    import torch

#: how many times the noise (the root mean square of the noise pairs' distances) a tensor of the resumed run may be
#: from the reference's (see the module docstring); its false-fail rate and the planted faults' margins are measured in
#: benchmarks/resume_false_fail.py (benchmarks/README.md).
NOISE_MULTIPLE = 4.0
#: the false-fail rate a loss check (``loss``, ``reproducible``) is allowed, per check: its multiple is the two-sided
#: Student t quantile of this rate with as many degrees of freedom as the noise family has independent contrasts
#: (:func:`loss_multiple_for`). Two runs' loss differences grow along the steps, so a check's points carry about one
#: degree of freedom: measured under the test jitter, a check's distance over its noise followed F(1, contrasts) (with
#: one noise pair, 5 of 100 correct resumes went past 6 x, to 12.6 x: benchmarks/README.md, "resume false fails").
#: With the four checks of a record (two of them tensors, whose ratios stay near 1) a record false-fails below 1 %.
LOSS_ALPHA = 0.0025
#: the multiples of the records of schemas 5 and 6 (one twin from step 0; losses judged step by step by the largest
#: twin difference): ``verify`` holds those records to the rule they were written under
SINGLE_TWIN_MULTIPLES = (4.0, 16.0)
#: the first record schema whose twin tiers pool several twins (:func:`pooled_losses`)
POOLED_SCHEMA = 7
#: the tolerance checks judged by :func:`loss_multiple_for` (losses), not :data:`NOISE_MULTIPLE` (tensors)
LOSS_CHECKS = ("loss", "reproducible")
#: the methods a tier judges by: ``exact`` (bit for bit) or ``twin`` (bounded by the twin's measured noise)
METHODS = ("exact", "twin")


@dataclass(frozen=True)
class Tier:
    """How the resume check's tolerance checks (loss, final weights, optimizer moments) are judged.

    Attributes:
        name: ``<device>-<dtype>-exact``, ``...-exact-required`` (the criteria ask for it) or ``...-twin-noise``.
        method: ``exact`` (bit for bit, no twin run) or ``twin`` (within ``multiple`` times the twin's distance).
        multiple: :data:`NOISE_MULTIPLE` for ``twin``, 0 for ``exact`` (tensors).
        why: the reason, in words.
        loss_multiple: the losses' multiple: 0 for ``exact``, and for a twin tier of this version 0 too: each loss
            check's multiple comes from its noise family (:func:`loss_multiple_for`); records of schemas 5 and 6 say
            the one they were judged by.
        twins: how many twins measure the noise (0: none, an exact tier).
    """

    name: str
    method: str
    multiple: float
    why: str
    loss_multiple: float = 0.0
    twins: int = 0

    @property
    def exact(self) -> bool:
        return self.method == "exact"


def deterministic_kernels(device: str, resume_tier: str = "auto", noise: str = "auto") -> bool:
    """Whether the training runs on ``device`` are asked for CUDA's deterministic kernels (the exact mode,
    core/protocol/determinism.py): their resume is judged bit for bit (``noise`` off, or ``resume_tier`` exact) on
    CUDA, whose kernels are not bit-exact by default."""
    return device.split(":")[0] == "cuda" and (noise == "off" or resume_tier == "exact")


def required_tier(device: str, dtype: str, resume_tier: str = "auto", noise: str = "auto",
                  jittered: bool = False, twins: int = TWINS) -> Tier:
    """The tier a resume is judged in.

    Args:
        device: the device trained on (``cpu``, ``cuda:0``).
        resume_tier: the criterion ``accept.resume_tier``: ``exact`` asks for bit-exact agreement (no twin run).
        noise: the spec's ``resume.noise``: ``auto`` runs the twin where kernels are not bit-exact (CUDA, or
            ``jittered``), ``twin`` always, ``off`` never.
        jittered: the training processes run under the test jitter (:mod:`core.child.inject.jitter`).
        twins: how many twins a twin tier runs (the spec's ``resume.twins``).
    """
    kind = device.split(":")[0]
    exact_mode = f"; {EXACT_MODE_WORDS}" if deterministic_kernels(device, resume_tier, noise) else ""
    if noise == "off" or (noise == "auto" and kind == "cpu" and not jittered):
        why = ("resume.noise = \"off\": bit-exact required, no twin run" if noise == "off" else
               f"CPU {dtype} kernels are deterministic for a fixed thread count (two runs bit-identical, "
               "docs/architecture.md §6): bit-exact required, no twin run; resume.noise = \"twin\" measures the noise "
               "instead")
        return Tier(f"{kind}-{dtype}-exact", "exact", 0.0, why + exact_mode)
    if resume_tier == "exact":
        return Tier(f"{kind}-{dtype}-exact-required", "exact", 0.0,
                    'bit-exact, as the acceptance criteria require (accept.resume_tier = "exact"); no twin run'
                    + exact_mode)
    return Tier(f"{kind}-{dtype}-twin-noise", "twin", NOISE_MULTIPLE,
                f"within {NOISE_MULTIPLE:g} x (tensors) and the t quantile of {LOSS_ALPHA:.2%} (the losses' norm) the noise "
                f"of {twins} "
                "twin runs branched where the resumed run branches (one nudged by one ulp), pooled over their pairs: "
                f"the run-to-run noise of {kind} {dtype} kernels" + (" under the test jitter" if jittered else "")
                + ", measured", 0.0, twins)


#: the end of the name of a tier of a resume at another world size (:func:`resized_tier`)
RESIZED_SUFFIX = "-world-size-twin"


def resized_tier(tier: Tier, trained: int, resumed: int) -> Tier:
    """The tier of a resume at another world size (``resumed`` ranks, the training ``trained``), in place of ``tier``
    (the device's): never bit-exact, as each reduction's sum is split over other ranks; bounded by a twin run at the
    resume's world size, by the multiples of :func:`required_tier`'s twin tier."""
    base = tier.name
    for suffix in ("-exact-required", "-exact", "-twin-noise"):
        base = base.removesuffix(suffix)
    return Tier(f"{base}{RESIZED_SUFFIX}", "twin", NOISE_MULTIPLE,
                f"resumed at world size {resumed} of {trained}: the sum of each reduction is split over other ranks, "
                f"so the run is not bit-exact; the bound is {max(tier.twins, 2)} twin runs' distance from the "
                "reference at the resume's world size", 0.0, max(tier.twins, 2))


def known_tiers(schema: int | None = None) -> dict[str, Tier]:
    """Every tier :func:`required_tier` (and :func:`resized_tier`) can give, by name (what ``gpuaccept verify`` holds a
    record's tier to); for a record of ``schema`` before :data:`POOLED_SCHEMA`, with the multiples it was written
    under (:data:`SINGLE_TWIN_MULTIPLES`)."""
    from core.dtypes import DTYPES

    tiers = [required_tier(d, t, r, n, j) for d in ("cpu", "cuda") for t in DTYPES for r in ("auto", "exact")
             for n in ("auto", "twin", "off") for j in (False, True)]
    tiers += [resized_tier(t, 2, 1) for t in list(tiers)]
    if schema is not None and schema < POOLED_SCHEMA:
        tensors, losses = SINGLE_TWIN_MULTIPLES
        tiers = [dataclasses.replace(t, multiple=tensors, loss_multiple=losses) if t.method == "twin" else t
                 for t in tiers]
    return {t.name: t for t in tiers}


def tier_problems(tier: Mapping[str, Any], schema: int) -> tuple[Tier | None, list[str]]:
    """A record's ``resume.tier`` table (schema 5 on; a command record's from 4) held to the tier gpuaccept applies
    by its name (:func:`known_tiers` of the record's ``schema``): (that tier, or None for a name it never gives; what
    differs, in words: a method or multiple edited changes every bound)."""
    name = tier.get("name")
    known = known_tiers(schema).get(str(name))
    if known is None:
        return None, [f"resume.tier {name!r} is not a tier gpuaccept applies ({', '.join(known_tiers())})"]
    out = []
    for key in ("method", "multiple", "loss_multiple"):
        if key == "loss_multiple" and key not in tier:  # written before losses had their own multiple: judged by multiple
            continue
        if tier.get(key) != getattr(known, key):
            out.append(f"resume.tier {known.name} has {key} {getattr(known, key)!r}, the record says {tier.get(key)!r}")
    return known, out


#: the tiers of records before schema 5 (a relative tolerance per device and dtype), by name -> rtol: ``verify`` still
#: judges those records by the rule they were written under
LEGACY_RTOL: dict[str, float] = {
    **{f"cpu-{t}-exact": 0.0 for t in ("fp32", "bf16", "fp16")},
    **{f"{d}-{t}-exact-required": 0.0 for d in ("cpu", "cuda") for t in ("fp32", "bf16", "fp16")},
    "cuda-fp32-relative": 1e-4, "bf16-relative": 2e-2, "fp16-relative": 2e-2,
}


@dataclass(frozen=True)
class Bounded:
    """One tolerance quantity judged: the resumed run's distance from the reference against its bound.

    Attributes:
        ok: within the bound everywhere (bit-exact for an exact tier).
        distance: the resumed run's largest distance (L2 per tensor; absolute per loss) where it is nearest its
            bound (the worst ratio); for an exact tier, the largest.
        noise: the twin's distance at that place (None: no twin).
        bound: the distance allowed there (``multiple x`` the noise; 0 for exact).
        where: the tensor or step it was at.
        count: tensors or losses compared.
        evidence: the rows it is computed from (see the attribute's comment).
    """

    ok: bool
    distance: float
    noise: float | None
    bound: float
    where: str
    count: int
    #: what the judgement is computed from, kept in the record so that ``gpuaccept verify`` computes it again
    #: (:func:`evidence_problems`): ``{"tensors": [[name, distance, noise, reference_norm], ...]}`` (exact tiers:
    #: ``[name, distance]``), or ``{"losses": [[step, resumed, reference], ...], "noise_losses": [[twin,
    #: reference], ...]}``
    evidence: dict[str, Any] | None = None
    #: the multiple the bound is of the noise (a loss check's comes from its family: :func:`loss_multiple_for`); None:
    #: the caller's
    multiple: float | None = None

    def describe(self, tier: Tier, what: str, multiple: float | None = None) -> str:
        """The evidence: how far the resumed run is, against what bound (``multiple`` x the twin's noise: the tier's
        tensors' multiple unless given), measured how."""
        multiple = self.multiple if self.multiple is not None else tier.multiple if multiple is None else multiple
        if tier.exact:
            return (f"{self.count} {what}: bit-identical" if self.distance == 0.0 and self.ok else
                    f"{self.count} {what}: largest difference {self.distance:.3g} at {self.where} (bit-exact "
                    "required)")
        state = "within" if self.ok else "OUTSIDE"
        pairs = len((self.evidence or {}).get("pairs") or ()) or 1
        noise = f"{multiple:.3g} x the noise {(self.noise or 0.0):.3g} of {pairs} noise pair{'s' if pairs > 1 else ''}"
        if "noise_losses" in (self.evidence or {}):
            return (f"{self.count} {what}: {state} the noise bound; the norm of their differences "
                    f"{self.distance:.3g} = {self.margin:.2g} x the bound {self.bound:.3g} ({noise}); largest at "
                    f"{self.where}")
        return (f"{self.count} {what}: {state} the noise bound; nearest it at {self.where}: distance "
                f"{self.distance:.3g} = {self.margin:.2g} x the bound {self.bound:.3g} ({noise})")

    @property
    def margin(self) -> float:
        """The distance over the bound (:func:`margin_of`)."""
        return margin_of(self.distance, self.bound)


def margin_of(distance: float, bound: float) -> float:
    """A tolerance check's margin: its distance over its bound (at most 1 within it; a planted fault's detection
    margin); 0 where both are 0, infinite where only the bound is."""
    return (distance / bound) if bound > 0 else (0.0 if distance == 0 else math.inf)


@dataclass(frozen=True)
class Family:
    """The runs whose pairwise distances are the noise (see the module docstring).

    Attributes:
        members: their names, in the order their values are kept: ``reference`` (where the twins started where it
            did, with nothing loaded) and ``twin-1`` .. ``twin-n``.
        pairs: the noise pairs, as indices into ``members``: every pair of members, or at another world size each
            twin with the reference only (what the world size moves is the bound there, not the twins' spread).
    """

    members: tuple[str, ...]
    pairs: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, twins: int, with_reference: bool, resized: bool = False) -> Family:
        """The family of ``twins`` twins (and the reference where ``with_reference``); ``resized``: pairs with the
        reference only."""
        members = (("reference",) if with_reference or resized else ()) + tuple(f"twin-{i}" for i in
                                                                               range(1, twins + 1))
        return cls(members, cls.expected_pairs(members, resized))

    @staticmethod
    def expected_pairs(members: Sequence[str], resized: bool) -> tuple[tuple[int, int], ...]:
        """The pairs the rule gives ``members`` (``verify`` holds a record's to them)."""
        if resized:
            return tuple((0, i) for i in range(1, len(members)))
        return tuple(itertools.combinations(range(len(members)), 2))

    def evidence(self) -> dict[str, Any]:
        return {"members": list(self.members), "pairs": [list(p) for p in self.pairs]}

    @property
    def contrasts(self) -> int:
        """The independent contrasts of the family (its members less one): the degrees of freedom of its noise."""
        return max(len(self.members) - 1, 1)


@functools.cache
def loss_multiple_for(contrasts: int, alpha: float = LOSS_ALPHA) -> float:
    """The multiple of a loss check's noise its distance may reach: the two-sided Student t quantile of ``alpha`` with
    ``contrasts`` degrees of freedom (:data:`LOSS_ALPHA`: 2 contrasts, 19.96; 3, 9.47; 4, 6.76; t tables). A check's
    distance over its noise is then ``|t|``-distributed where the noise is Gaussian and its points carry one degree of
    freedom (they grow together), so a correct resume fails it with probability ``alpha``. Computed by bisection on
    the tail ``1 - 2 c int_0^theta cos^(nu-1)`` (the density after ``x = sqrt(nu) tan theta``), Simpson's rule."""
    nu = contrasts
    c = math.exp(math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2)) / math.sqrt(math.pi)

    def tail(theta: float, n: int = 2000) -> float:
        h = theta / n
        weights = (1 if i in (0, n) else 4 if i % 2 else 2 for i in range(n + 1))
        return 1 - 2 * c * h / 3 * sum(w * math.cos(i * h) ** (nu - 1) for i, w in enumerate(weights))

    lo, hi = 0.0, math.pi / 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tail(mid) > alpha else (lo, mid)
    return math.sqrt(nu) * math.tan((lo + hi) / 2)


def judge_tensors(reference: dict[str, torch.Tensor], resumed: dict[str, torch.Tensor],
                  family: Sequence[dict[str, torch.Tensor]] | None, tier: Tier, kin: Family | None = None) -> Bounded:
    """Judge tensors of the same names and shapes (see the module docstring): ``family`` the noise family's states,
    in the order of ``kin.members`` (the reference's own dict where it is a member); None: bit-exact (an exact tier).

    Raises:
        ValueError: the names or a shape differ between the runs (the caller reports it as a failed check)."""
    import torch

    names = sorted(reference)
    others = [(resumed, "resumed")] + [(f, m) for f, m in zip(family or (), kin.members if kin else ())]
    for other, label in others:
        if other.keys() != reference.keys():
            raise ValueError(f"tensor names differ between the {label} run and the reference: "
                             f"{sorted(other.keys() ^ reference.keys())[:3]}")
        bad = [n for n in names if other[n].shape != reference[n].shape]
        if bad:
            raise ValueError(f"shapes differ between the {label} run and the reference: {bad[:3]}")

    def dist(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(a.detach().double() - b.detach().double())) if a.numel() else 0.0

    res = {n: dist(resumed[n], reference[n]) for n in names}
    if tier.exact or family is None or kin is None:
        return bound_tensor_rows([(n, res[n]) for n in names], None)
    size = {n: float(torch.linalg.vector_norm(reference[n].detach().double())) if reference[n].numel() else 0.0
            for n in names}
    rows = [(n, res[n], size[n], *(dist(family[i][n], family[j][n]) for i, j in kin.pairs)) for n in names]
    judged = bound_tensor_rows(rows, tier.multiple)
    return dataclasses.replace(judged, evidence={**(judged.evidence or {}), **kin.evidence()})


#: how ``gpuaccept verify --deep`` reads a file a tensor check compared (:func:`file_rows`): a safetensors file's
#: tensors, or an optimizer's ``state_dict()`` (its moments, :func:`optimizer_state_tensors`)
FILE_LOADERS = ("safetensors", "optimizer")


def file_rows(files: Sequence[tuple[str, Path]], loader: str, prefix: str = "") -> list[list[str]]:
    """What a tensor check read, for ``gpuaccept verify --deep`` to read again: ``[member, path, sha256, loader,
    prefix]`` per file, ``member`` the run (``reference``, ``resumed``, ``twin-1`` ...), ``loader`` one of
    :data:`FILE_LOADERS`, ``prefix`` what the check put before each tensor's name (``adapter.safetensors:`` where it
    joined several files)."""
    from core.protocol.manifest import sha256_file

    return [[member, str(path), sha256_file(path), loader, prefix] for member, path in files]


def _rms(values: Sequence[float]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values)) if values else 0.0


def bound_tensor_rows(rows: Sequence[Sequence[Any]], multiple: float | None) -> Bounded:
    """:func:`judge_tensors` from its per-tensor distances, the one rule both the resume check and ``gpuaccept verify``
    apply. ``rows``: ``(name, distance)`` for an exact tier (``multiple`` None: every distance must be 0), else
    ``(name, distance, reference's norm, each noise pair's distance...)``, all L2 norms; a tensor's noise is the root
    mean square of its pairs' distances, its bound ``multiple x max(its noise, r x its norm)``, r the noise's relative
    size over all the tensors."""
    names = [str(r[0]) for r in rows]
    res = {str(r[0]): float(r[1]) for r in rows}
    if multiple is None:
        worst = max(names, key=lambda n: res[n], default="")
        return Bounded(all(res[n] == 0.0 for n in names), res.get(worst, 0.0), None, 0.0, worst, len(names),
                       {"tensors": [[n, res[n]] for n in names]})
    size = {str(r[0]): float(r[2]) for r in rows}
    noise = {str(r[0]): _rms([float(v) for v in r[3:]]) for r in rows}
    total_ref = math.sqrt(sum(v * v for v in size.values()))
    relative = math.sqrt(sum(v * v for v in noise.values())) / total_ref if total_ref else 0.0
    bounds = {n: multiple * max(noise[n], relative * size[n]) for n in names}
    ok = all(res[n] <= bounds[n] for n in names)

    def ratio(n: str) -> float:
        return res[n] / bounds[n] if bounds[n] > 0 else (0.0 if res[n] == 0 else math.inf)

    worst = max(names, key=ratio, default="")
    evidence = {"tensors": [[str(r[0]), *(float(v) for v in r[1:])] for r in rows]}
    if not worst:
        return Bounded(True, 0.0, 0.0, 0.0, "", 0, evidence)
    return Bounded(ok, res[worst], noise[worst], bounds[worst], worst, len(names), evidence)


def float32_spacing(value: float) -> float:
    """The gap between ``value`` and the next float32 (its last bit): a loss is a float32 tensor's value, so two losses
    that differ at all differ by at least this."""
    return math.ulp(abs(value)) * 2.0 ** 29 if math.isfinite(value) and value else 0.0


def pooled_losses(pairs: Sequence[tuple[int, float, float]], family: Sequence[Sequence[float]] | None,
                  kin: Family | None, multiple: float) -> tuple[Bounded, list[int]]:
    """Judge a run's losses against the reference's, pooled (see the module docstring): ``pairs`` (step, the run's
    loss, the reference's) of every point compared; ``family`` per point the noise family's losses (in the order of
    ``kin.members``); None: bit-exact. The distance is the L2 norm of the differences, the noise the root mean square
    over ``kin.pairs`` of the same norm of theirs, at least the last float32 bit of the largest reference loss
    (:func:`float32_spacing`), the bound ``multiple`` x it (0: the family's, :func:`loss_multiple_for`).

    Returns:
        (the judgement, with its evidence; the steps over their share of the bound, ``bound / sqrt(points)``, or not
        finite: some step is, wherever the norm is over the bound)."""
    finite = all(math.isfinite(a) for _, a, _ in pairs)
    diffs = [abs(a - b) for _, a, b in pairs]
    distance = math.sqrt(sum(d * d for d in diffs)) if finite else math.inf
    evidence: dict[str, Any] = {"losses": [[int(s), float(a), float(b)] for s, a, b in pairs]}
    worst = max(range(len(pairs)), key=lambda i: diffs[i] if math.isfinite(diffs[i]) else math.inf, default=None)
    where = "" if worst is None else f"step {pairs[worst][0]}"
    if family is None or kin is None:  # bit-exact: the largest difference
        bad = sorted({s for s, a, b in pairs if a != b or not math.isfinite(a)})
        return Bounded(not bad, max(diffs, default=0.0) if finite else math.inf, None, 0.0, where, len(pairs),
                       evidence), bad
    norms = [math.sqrt(sum((row[i] - row[j]) ** 2 for row in family)) for i, j in kin.pairs]
    largest = max((abs(b) for _, _, b in pairs if math.isfinite(b)), default=0.0)
    noise = max(_rms(norms), float32_spacing(largest))
    multiple = multiple or loss_multiple_for(kin.contrasts)
    bound = multiple * noise
    ok = finite and distance <= bound
    share = bound / math.sqrt(len(pairs)) if pairs else 0.0
    bad = [] if ok else sorted({s for (s, a, _), d in zip(pairs, diffs) if not math.isfinite(a) or d > share})
    evidence.update(noise_losses=[[float(v) for v in row] for row in family], **kin.evidence())
    return Bounded(ok, distance, noise, bound, where, len(pairs), evidence, multiple), bad


def loss_noise(pairs: list[tuple[float, float]]) -> float:
    """The rule of records of schemas 5 and 6: the twin's largest ``|twin - reference|`` over ``pairs`` of (twin
    loss, reference loss), and at least the last bit of the largest reference loss (:func:`float32_spacing`)."""
    worst = max((abs(a - b) for a, b in pairs), default=0.0)
    largest = max((abs(b) for _, b in pairs if math.isfinite(b)), default=0.0)
    return max(worst, float32_spacing(largest))


def _judge_losses(pairs: list[tuple[int, float, float]], noise: float | None, multiple: float
                  ) -> tuple[Bounded, list[int]]:
    """The loss rule of records of schemas 5 and 6: every step within ``multiple`` x ``noise`` (0: bit-exact)."""
    bound = 0.0 if noise is None else multiple * noise
    bad = sorted({s for s, a, b in pairs if not (a == b if bound == 0.0 else abs(a - b) <= bound)
                  or not math.isfinite(a)})
    worst = max(pairs, key=lambda p: abs(p[1] - p[2]) if math.isfinite(p[1]) else math.inf, default=None)
    if worst is None:
        return Bounded(True, 0.0, noise, bound, "", 0), []
    distance = abs(worst[1] - worst[2]) if math.isfinite(worst[1]) else math.inf
    return Bounded(not bad, distance, noise, bound, f"step {worst[0]}", len(pairs)), bad


# ------------------------------------------------------------------------------------------- optimizer states
#: bitsandbytes' keys of an 8-bit optimizer's quantisation (optimizer.py of bitsandbytes 0.50: ``state1`` / ``state2``
#: uint8 codes of the parameter's shape, ``qmap1`` / ``qmap2`` the 256-value code books, ``absmax1`` / ``absmax2`` one
#: fp32 scale per block), nested under this key in ``state_dict()``
BNB_QUANT_KEY = "__bnb_optimizer_quant_state__"
#: block sizes bitsandbytes' blockwise quantisation takes (functional.py ``quantize_blockwise``); the 8-bit optimizers
#: use 256 (optimizer.py ``init_state``)
BNB_BLOCKSIZES = (256, 64, 128, 512, 1024, 2048, 4096)


def dequantize_bnb(codes: torch.Tensor, qmap: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """An 8-bit state's values: ``qmap[code] * absmax[block]`` (bitsandbytes' ``dequantize_blockwise``), with the block
    size found from the number of absmax values.

    Raises:
        ValueError: no block size of bitsandbytes gives that many blocks."""
    import torch

    n = codes.numel()
    blocks = absmax.numel()
    size = next((b for b in BNB_BLOCKSIZES if -(-n // b) == blocks), None)
    if size is None:
        raise ValueError(f"{blocks} absmax values for {n} codes: no bitsandbytes block size fits")
    scale = absmax.float().repeat_interleave(size)[:n]
    return (qmap.float()[codes.flatten().long()] * scale).reshape(codes.shape).to(torch.float32)


def optimizer_state_tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The moments of an optimizer's ``state`` (its ``state_dict()["state"]``) by path (``"3.exp_avg"``), every tensor of
    more than one element at any depth; bitsandbytes' 8-bit states dequantised (``"3.state1"``: its values, not its
    codes; the code books and scales are then not compared apart). Step counters (one element) are progress, compared
    exactly elsewhere."""
    import torch

    out: dict[str, torch.Tensor] = {}
    if not isinstance(state, dict):
        return out
    flat: dict[str, Any] = {}
    for key, value in state.items():
        if key == BNB_QUANT_KEY and isinstance(value, dict):
            flat.update(value)  # bitsandbytes nests its quantisation for FSDP; its keys are the parameter's state
        else:
            flat[str(key)] = value
    for key, value in flat.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(optimizer_state_tensors(value, path + "."))
        elif torch.is_tensor(value) and value.numel() > 1:
            index = key[-1] if key[:-1] in ("state", "qmap", "absmax") else ""
            if key.startswith("state") and value.dtype == torch.uint8:
                qmap, absmax = flat.get(f"qmap{index}"), flat.get(f"absmax{index}")
                if torch.is_tensor(qmap) and torch.is_tensor(absmax):
                    out[path] = dequantize_bnb(value, qmap, absmax)
                    continue
            if key.startswith(("qmap", "absmax")) and torch.is_tensor(flat.get(f"state{index}")) \
                    and flat[f"state{index}"].dtype == torch.uint8:
                continue  # part of a quantised state, compared through its values
            out[path] = value
    return out


# --------------------------------------------------------------------------------------- a record, judged again
#: the first record schema that keeps what each tolerance check is computed from (both kinds of record)
EVIDENCE_SCHEMA = 6


def same_number(recorded: float | None, computed: float | None) -> bool:
    """A recorded number equals the one computed again (both absent, both NaN, or equal within float rounding; an
    infinity only itself)."""
    if recorded is None or computed is None:
        return recorded is None and computed is None
    if math.isnan(recorded) or math.isnan(computed):
        return math.isnan(recorded) and math.isnan(computed)
    return math.isclose(recorded, computed, rel_tol=1e-12, abs_tol=0.0)


@dataclass(frozen=True)
class RecordedRule:
    """How ``gpuaccept verify`` judges a record's resume numbers again: ``method`` ``exact`` or ``twin`` (with its
    ``multiple``, schema 5, and ``loss_multiple`` for the losses: a record without one judged its losses by
    ``multiple``), or ``legacy`` with the relative tolerance ``rtol`` of a tier of a record before schema 5
    (:data:`LEGACY_RTOL`); from schema :data:`EVIDENCE_SCHEMA` each tolerance check is computed again from the
    evidence the record keeps. Each method returns what is wrong, in words (empty: consistent)."""

    method: str
    multiple: float = 0.0
    rtol: float = 0.0
    loss_multiple: float | None = None
    #: the record keeps what each tolerance check is computed from (schema :data:`EVIDENCE_SCHEMA` on): each is
    #: computed again (:meth:`evidence_problems`)
    evidence_kept: bool = False
    #: the twin tier pools several twins (schema :data:`POOLED_SCHEMA` on: :func:`pooled_losses`, the tensors' noise
    #: over the noise pairs); before, one twin's distance from the reference
    pooled: bool = False
    #: the tier is a resume at another world size (its noise pairs are each twin with the reference)
    resized: bool = False
    #: the twins started at step 0 with nothing loaded, as the reference did (it may then be one of the family)
    twins_from_start: bool = True

    @classmethod
    def of_tier(cls, tier: Tier, twins_from_start: bool = True) -> RecordedRule:
        """The rule of a tier this version applies (a record of the current schema): ``twins_from_start``, the twins
        started at step 0 with nothing loaded."""
        return cls(tier.method, multiple=tier.multiple, loss_multiple=tier.loss_multiple, evidence_kept=True,
                   pooled=True, resized=tier.name.endswith(RESIZED_SUFFIX), twins_from_start=twins_from_start)

    def multiple_of(self, name: str) -> float:
        """The multiple the check ``name`` was bounded by."""
        if name in LOSS_CHECKS and self.loss_multiple is not None:
            return self.loss_multiple
        return self.multiple

    def check_problems(self, name: str, distance: float, noise: float | None, bound: float | None) -> list[str]:
        """What is wrong with a passing tolerance check: bit-exact tiers admit no difference; a twin tier's check
        holds its noise and bound, its distance within the bound, the bound at least ``multiple`` x the noise."""
        if self.method == "exact" or (self.method == "legacy" and self.rtol == 0.0):
            return [] if distance == 0.0 else [f"resume check {name}: passed on an exact tier with largest difference "
                                               f"{distance}"]
        if self.method != "twin":
            return []
        if noise is None or bound is None:
            return [f"resume check {name}: passed on a twin tier without its noise and bound"]
        out = []
        if distance > bound:
            out.append(f"resume check {name}: passed with distance {distance} above its bound {bound}")
        multiple = self.multiple_of(name)
        if bound < multiple * noise * (1 - 1e-9):
            out.append(f"resume check {name}: bound {bound} is below {multiple:g} x the twin's noise {noise}")
        return out

    def evidence_problems(self, name: str, passed: bool, distance: float, noise: float | None, bound: float | None,
                          evidence: dict[str, Any] | None) -> list[str]:
        """What is wrong with a tolerance check against what it is computed from (``evidence``: the rows of
        :attr:`Bounded.evidence`): the check computed again by the resume check's own rule
        (:func:`bound_tensor_rows`, :func:`loss_noise` and the loss bound) gives the same distance, noise and bound,
        and a pass only where the evidence is within the bound; equality, not "at least". A passing check without
        evidence is a finding where the record keeps it, and on a twin tier of an older record, whose noise and bound
        cannot be computed again (it is then not shown consistent)."""
        if self.method not in ("exact", "twin"):
            return []
        if evidence is None:
            if passed and self.evidence_kept:
                return [f"resume check {name}: passed without the evidence its distance, noise and bound are "
                        "computed from"]
            if passed and self.method == "twin":
                return [f"resume check {name}: its noise and bound cannot be computed again from a record written "
                        f"before schema {EVIDENCE_SCHEMA} (which keeps the distances they come from): not shown "
                        "consistent"]
            return []
        try:
            judged = self._judged_again(name, evidence)
        except (TypeError, ValueError, IndexError, KeyError) as exc:
            return [f"resume check {name}: its evidence cannot be read ({exc})"]
        if isinstance(judged, str):
            return [f"resume check {name}: {judged}"]
        out = [f"resume check {name}: passed, but its evidence is outside the bound (largest distance "
               f"{judged.distance} at {judged.where}, bound {judged.bound})"] if passed and not judged.ok else []
        for label, recorded, computed in (("largest_difference", distance, judged.distance),
                                          ("noise", noise, judged.noise), ("bound", bound, judged.bound)):
            if not same_number(recorded, computed):
                out.append(f"resume check {name}: {label} is {recorded}; its evidence gives {computed}")
        return out

    def _judged_again(self, name: str, evidence: dict[str, Any]) -> Bounded | str:
        """The check computed again from its ``evidence`` by the rule it was written under; a str: what is wrong with
        the evidence itself."""
        twin = self.method == "twin"
        kin: Family | None = None
        if twin and self.pooled:
            members = [str(m) for m in evidence.get("members") or []]
            pairs = tuple((int(i), int(j)) for i, j in evidence.get("pairs") or [])
            if len(set(members)) != len(members) or len(members) < 2 or \
                    pairs != Family.expected_pairs(members, self.resized):
                return (f"its noise pairs {[list(p) for p in pairs]} of {members} are not the pairs of the twins "
                        f"{'with the reference' if self.resized else 'and the reference where it is one of them'}")
            if self.resized and members[0] != "reference":
                return f"its noise family {members} lacks the reference a resume at another world size is judged by"
            if "reference" in members and not (self.resized or self.twins_from_start):
                return (f"its noise family {members} holds the reference, but the twins branched from a checkpoint "
                        "(a fault in loading it would be in their distance from the reference)")
            kin = Family(tuple(members), pairs)
        if "tensors" in evidence:
            rows = [tuple(row) for row in evidence["tensors"]]
            if twin and not self.pooled:  # schema 5 and 6: (name, distance, the twin's distance, the reference's norm)
                rows = [(r[0], r[1], r[3], r[2]) for r in rows]
            if twin and any(len(r) != 3 + (len(kin.pairs) if kin else 1) for r in rows):
                return "its tensor rows do not hold one distance per noise pair"
            return bound_tensor_rows(rows, self.multiple if twin else None)
        if "losses" in evidence:
            pairs_ = [(int(s), float(a), float(b)) for s, a, b in evidence["losses"]]
            noise_rows = evidence.get("noise_losses")
            if twin and self.pooled:
                if noise_rows is None or kin is None or len(noise_rows) != len(pairs_) or \
                        any(len(r) != len(kin.members) for r in noise_rows):
                    return "its noise losses do not hold one loss per member of the noise family at each point"
                return pooled_losses(pairs_, [[float(v) for v in r] for r in noise_rows], kin,
                                     self.multiple_of(name))[0]
            if not twin and self.pooled:
                return pooled_losses(pairs_, None, None, 0.0)[0]
            measured = loss_noise([(float(t), float(r)) for t, r in noise_rows]) \
                if twin and noise_rows is not None else None
            return _judge_losses(pairs_, measured, self.multiple_of(name) if twin else 0.0)[0]
        return "its evidence holds neither tensors nor losses"

    def row_problems(self, step: Any, reference: float, difference: float, noise: float | None,
                     bound: float | None, twin: float | None) -> list[str]:
        """What is wrong with a compared step of a passing resume: its loss difference within the tier (legacy: the
        relative tolerance; exact: none; twin: the loss check's bound, which is ``multiple`` x its noise, which is at
        least the twin's own difference at this step)."""
        if self.method == "legacy":
            ok = difference <= self.rtol * max(abs(reference), 1e-12) if self.rtol else difference == 0.0
            return [] if ok else [f"resume step {step}: loss difference {difference} is outside the tier (rtol "
                                  f"{self.rtol}) but the resume passed"]
        if self.method == "exact":
            return [] if difference == 0.0 else [f"resume step {step}: loss difference {difference} on an exact tier, "
                                                 "but the resume passed"]
        noise, bound = noise or 0.0, bound or 0.0
        out = []
        if difference > bound:
            out.append(f"resume step {step}: loss difference {difference} is above the loss bound {bound}, but the "
                       "resume passed")
        multiple = self.multiple_of("loss")
        if not self.pooled and not math.isclose(bound, multiple * noise, rel_tol=1e-9, abs_tol=1e-15):
            out.append(f"resume check loss: bound {bound} is not {multiple:g} x its noise {noise}")
        if not self.pooled and twin is not None and abs(twin - reference) > noise * (1 + 1e-9) + 1e-15:
            out.append(f"resume step {step}: the twin's loss differs from the reference by {abs(twin - reference)}, "
                       f"more than the loss noise {noise} the bound was made from")
        return out
