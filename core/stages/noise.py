"""The resume check's tolerance: a bound from measured noise, not a guessed one (docs/architecture.md §4).

Two runs of the same training are bit-identical on the CPU here (a fixed thread count; docs/architecture.md §6) but not
on a GPU: bf16 kernels reorder reductions (atomics, split-K GEMMs, the attention backward), and two uninterrupted runs
drift apart by a few units in the last bits from their first steps (measured on an H200: the losses of two runs of the
same LoRA job differed by 3e-4 from step 6; benchmarks/results/gpu/). A relative tolerance guessed per dtype cannot
tell that drift from a broken resume: it fails tensors near zero (a LoRA ``lora_B`` starts at zero; Adam's moments are
tiny) and passes faults that happen to be small.

So the noise is measured. The **twin** is a second uninterrupted run of the same job from step 0 to the last compared
step, in a process of its own, never resumed: its distance from the reference (the training run) is the noise of
this box, kernels and job over those steps. The resumed run passes a tolerance check when its distance from the
reference is at most :data:`NOISE_MULTIPLE` times the twin's:

- **tensors** (final weights, optimizer moments), per tensor and norm-wise: ``||resumed - reference||_2 <= k *
  max(||twin - reference||_2, r * ||reference||_2)``, where ``r`` is the quantity's relative noise over all its tensors
  (``||twin - reference|| / ||reference||``): a tensor the twin happened to reproduce exactly is still allowed the
  noise its share of the whole would have. Norms, not elements: a tensor near zero is judged by an absolute distance,
  never by a relative error.
- **losses**, per step and rank: ``|resumed - reference| <= k_loss * max over the compared steps of |twin -
  reference|``, with its own multiple :data:`LOSS_MULTIPLE`: a loss is one number per step, and the ratio of one
  number's distance to another run's is heavy-tailed (two draws of the same noise: its ratio has a Cauchy-like tail,
  P(ratio > k) falling as 1/k), where a tensor's norm sums thousands of elements' noise and its ratio stays near 1.

The twin has drifted from step 1, the resumed run only from the checkpoint it (or the interrupted run before it) was
loaded from, so the twin's distance is the larger in expectation; ``k`` covers the spread of two noise realisations.
Where the twin is bit-identical to the reference (the noise measured is 0), every bound is 0: bit-exact.

Without a twin (:func:`required_tier`: the CPU's kernels, ``resume.noise = "off"``, or ``accept.resume_tier =
"exact"``), every quantity must be bit-exact. Quantised optimizer states (bitsandbytes' 8-bit AdamW: uint8 codes, a
256-value code book and an fp32 absmax per block) are compared dequantised (:func:`optimizer_state_tensors`), never as
codes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: how many times the twin's distance from the reference the resumed run may be (see the module docstring). Measured:
#: the resumed run's distance over the twin's was at most 1.2 under the CPU test jitter (LoRA, full, bf16 LoRA; QLoRA:
#: tests/integration/test_resume_noise.py) and at most 1.21 on an H200 (LoRA on a 1.2B shape, full, QLoRA with paged
#: 8-bit AdamW: benchmarks/results/gpu/2026-12-04-issue41/); planted faults were 18 x the bound or more, or failed an
#: exact check.
NOISE_MULTIPLE = 4.0
#: the same multiple for the losses (the ``loss`` and ``reproducible`` checks). Measured under the CPU test jitter (bf16
#: LoRA, 33 runs of tests/integration/test_resume_noise.py's setup, 2026-12-06): the resumed loss's distance over the
#: twin's ranged 0.37-3.28, and one run in the suite reached 7.9 (a correct resume failed at 4; the tensors' ratios in the
#: same runs stayed at or below 2.75). 16 is twice the largest seen; planted faults moved the losses 18 x the old bound
#: (72 x the noise) or more.
LOSS_MULTIPLE = 16.0
#: the tolerance checks judged by :data:`LOSS_MULTIPLE` (losses per step), not :data:`NOISE_MULTIPLE` (tensors)
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
        loss_multiple: :data:`LOSS_MULTIPLE` for ``twin``, 0 for ``exact`` (losses per step).
    """

    name: str
    method: str
    multiple: float
    why: str
    loss_multiple: float = 0.0

    @property
    def exact(self) -> bool:
        return self.method == "exact"


def required_tier(device: str, dtype: str, resume_tier: str = "auto", noise: str = "auto",
                  jittered: bool = False) -> Tier:
    """The tier a resume is judged in.

    Args:
        device: the device trained on (``cpu``, ``cuda:0``).
        resume_tier: the criterion ``accept.resume_tier``: ``exact`` asks for bit-exact agreement (no twin run).
        noise: the spec's ``resume.noise``: ``auto`` runs the twin where kernels are not bit-exact (CUDA, or
            ``jittered``), ``twin`` always, ``off`` never.
        jittered: the training processes run under the test jitter (:mod:`core.child.inject.jitter`).
    """
    kind = device.split(":")[0]
    if noise == "off" or (noise == "auto" and kind == "cpu" and not jittered):
        why = ("resume.noise = \"off\": bit-exact required, no twin run" if noise == "off" else
               f"CPU {dtype} kernels are deterministic for a fixed thread count (two runs bit-identical, "
               "docs/architecture.md §6): bit-exact required, no twin run; resume.noise = \"twin\" measures the noise "
               "instead")
        return Tier(f"{kind}-{dtype}-exact", "exact", 0.0, why)
    if resume_tier == "exact":
        return Tier(f"{kind}-{dtype}-exact-required", "exact", 0.0,
                    'bit-exact, as the acceptance criteria require (accept.resume_tier = "exact"); no twin run')
    return Tier(f"{kind}-{dtype}-twin-noise", "twin", NOISE_MULTIPLE,
                f"within {NOISE_MULTIPLE:g} x (tensors) and {LOSS_MULTIPLE:g} x (losses per step) the distance of a "
                f"twin run (uninterrupted, from step 0) from the reference: the run-to-run noise of {kind} {dtype} "
                "kernels" + (" under the test jitter" if jittered else "") + ", measured", LOSS_MULTIPLE)


def resized_tier(tier: Tier, trained: int, resumed: int) -> Tier:
    """The tier of a resume at another world size (``resumed`` ranks, the training ``trained``), in place of ``tier``
    (the device's): never bit-exact, as each reduction's sum is split over other ranks; bounded by a twin run at the
    resume's world size, by the multiples of :func:`required_tier`'s twin tier."""
    base = tier.name
    for suffix in ("-exact-required", "-exact", "-twin-noise"):
        base = base.removesuffix(suffix)
    return Tier(f"{base}-world-size-twin", "twin", NOISE_MULTIPLE,
                f"resumed at world size {resumed} of {trained}: the sum of each reduction is split over other ranks, "
                "so the run is not bit-exact; the bound is a twin run's distance at the resume's world size",
                LOSS_MULTIPLE)


def known_tiers() -> dict[str, Tier]:
    """Every tier :func:`required_tier` (and :func:`resized_tier`) can give, by name (what ``gpuaccept verify`` holds a
    record's tier to)."""
    from core.dtypes import DTYPES

    tiers = [required_tier(d, t, r, n, j) for d in ("cpu", "cuda") for t in DTYPES for r in ("auto", "exact")
             for n in ("auto", "twin", "off") for j in (False, True)]
    tiers += [resized_tier(t, 2, 1) for t in list(tiers)]
    return {t.name: t for t in tiers}


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

    def describe(self, tier: Tier, what: str, multiple: float | None = None) -> str:
        """The evidence: how far the resumed run is, against what bound (``multiple`` x the twin's noise: the tier's
        tensors' multiple unless given), measured how."""
        multiple = tier.multiple if multiple is None else multiple
        if tier.exact:
            return (f"{self.count} {what}: bit-identical" if self.distance == 0.0 and self.ok else
                    f"{self.count} {what}: largest difference {self.distance:.3g} at {self.where} (bit-exact "
                    "required)")
        ratio = (self.distance / self.bound) if self.bound > 0 else (0.0 if self.distance == 0 else math.inf)
        state = "within" if self.ok else "OUTSIDE"
        return (f"{self.count} {what}: {state} the noise bound; nearest it at {self.where}: distance "
                f"{self.distance:.3g} = {ratio:.2g} x the bound {self.bound:.3g} ({multiple:g} x the twin's "
                f"{(self.noise or 0.0):.3g})")


def judge_tensors(reference: dict[str, torch.Tensor], resumed: dict[str, torch.Tensor],
                  twin: dict[str, torch.Tensor] | None, tier: Tier) -> Bounded:
    """Judge tensors of the same names and shapes (see the module docstring). ``twin`` None: bit-exact (an exact tier).

    Raises:
        ValueError: the names or a shape differ between the runs (the caller reports it as a failed check)."""
    import torch

    names = sorted(reference)
    for other, label in ((resumed, "resumed"), (twin, "twin")):
        if other is None:
            continue
        if other.keys() != reference.keys():
            raise ValueError(f"tensor names differ between the {label} run and the reference: "
                             f"{sorted(other.keys() ^ reference.keys())[:3]}")
        bad = [n for n in names if other[n].shape != reference[n].shape]
        if bad:
            raise ValueError(f"shapes differ between the {label} run and the reference: {bad[:3]}")

    def dist(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(a.detach().double() - b.detach().double())) if a.numel() else 0.0

    res = {n: dist(resumed[n], reference[n]) for n in names}
    if tier.exact or twin is None:
        return bound_tensor_rows([(n, res[n]) for n in names], None)
    size = {n: float(torch.linalg.vector_norm(reference[n].detach().double())) if reference[n].numel() else 0.0
            for n in names}
    return bound_tensor_rows([(n, res[n], dist(twin[n], reference[n]), size[n]) for n in names], tier.multiple)


def bound_tensor_rows(rows: list[tuple[Any, ...]], multiple: float | None) -> Bounded:
    """:func:`judge_tensors` from its per-tensor distances, the one rule both the resume check and ``gpuaccept verify``
    apply. ``rows``: ``(name, distance)`` for an exact tier (``multiple`` None: every distance must be 0), else
    ``(name, distance, twin's distance, reference's norm)``, all L2 norms; the bound of a tensor is ``multiple x
    max(its twin's distance, r x its norm)``, r the twin's relative distance over all the tensors."""
    names = [str(r[0]) for r in rows]
    res = {str(r[0]): float(r[1]) for r in rows}
    if multiple is None:
        worst = max(names, key=lambda n: res[n], default="")
        return Bounded(all(res[n] == 0.0 for n in names), res.get(worst, 0.0), None, 0.0, worst, len(names),
                       {"tensors": [[n, res[n]] for n in names]})
    noise = {str(r[0]): float(r[2]) for r in rows}
    size = {str(r[0]): float(r[3]) for r in rows}
    total_ref = math.sqrt(sum(v * v for v in size.values()))
    relative = math.sqrt(sum(v * v for v in noise.values())) / total_ref if total_ref else 0.0
    bounds = {n: multiple * max(noise[n], relative * size[n]) for n in names}
    ok = all(res[n] <= bounds[n] for n in names)

    def ratio(n: str) -> float:
        return res[n] / bounds[n] if bounds[n] > 0 else (0.0 if res[n] == 0 else math.inf)

    worst = max(names, key=ratio, default="")
    evidence = {"tensors": [[n, res[n], noise[n], size[n]] for n in names]}
    if not worst:
        return Bounded(True, 0.0, 0.0, 0.0, "", 0, evidence)
    return Bounded(ok, res[worst], noise[worst], bounds[worst], worst, len(names), evidence)


def float32_spacing(value: float) -> float:
    """The gap between ``value`` and the next float32 (its last bit): a loss is a float32 tensor's value, so two losses
    that differ at all differ by at least this."""
    return math.ulp(abs(value)) * 2.0 ** 29 if math.isfinite(value) and value else 0.0


def loss_noise(pairs: list[tuple[float, float]]) -> float:
    """The twin's largest ``|twin - reference|`` over ``pairs`` of (twin loss, reference loss) of the steps (and ranks)
    compared, and at least the last bit of the largest reference loss (:func:`float32_spacing`): where runs drift at
    all, a float32 loss rounds either way, and a twin whose few losses happened to round alike has not measured that
    there is no noise."""
    worst = max((abs(a - b) for a, b in pairs), default=0.0)
    largest = max((abs(b) for _, b in pairs if math.isfinite(b)), default=0.0)
    return max(worst, float32_spacing(largest))


def judge_losses(pairs: list[tuple[int, float, float]], noise: float | None, tier: Tier,
                 noise_pairs: list[tuple[float, float]] | None = None) -> tuple[Bounded, list[int]]:
    """Judge per-step losses: ``pairs`` of (step, resumed, reference); ``noise`` the twin's :func:`loss_noise` (None:
    exact; the bound is the tier's :data:`LOSS_MULTIPLE` x it) of ``noise_pairs`` (twin, reference), kept with
    ``pairs`` as the evidence. Returns the judgement and the steps outside the bound."""
    judged, bad = _judge_losses(pairs, noise, 0.0 if tier.exact or noise is None else tier.loss_multiple)
    evidence: dict[str, Any] = {"losses": [list(p) for p in pairs]}
    if noise_pairs is not None:
        evidence["noise_losses"] = [list(p) for p in noise_pairs]
    return dataclasses.replace(judged, evidence=evidence), bad


def _judge_losses(pairs: list[tuple[int, float, float]], noise: float | None, multiple: float
                  ) -> tuple[Bounded, list[int]]:
    """:func:`judge_losses`'s rule: the bound is ``multiple`` x ``noise`` (0: bit-exact)."""
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


def _same(recorded: float | None, computed: float | None) -> bool:
    """A recorded number equals the one computed again (both absent, both NaN, or equal within float rounding)."""
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
        twin = self.method == "twin"
        try:
            if "tensors" in evidence:
                judged = bound_tensor_rows([tuple(row) for row in evidence["tensors"]], self.multiple if twin else None)
            elif "losses" in evidence:
                pairs = [(int(s), float(a), float(b)) for s, a, b in evidence["losses"]]
                rows = evidence.get("noise_losses")
                measured = loss_noise([(float(t), float(r)) for t, r in rows]) if twin and rows is not None else None
                judged, _ = _judge_losses(pairs, measured, self.multiple_of(name) if twin else 0.0)
            else:
                return [f"resume check {name}: its evidence holds neither tensors nor losses"]
        except (TypeError, ValueError, IndexError) as exc:
            return [f"resume check {name}: its evidence cannot be read ({exc})"]
        out = [f"resume check {name}: passed, but its evidence is outside the bound (largest distance "
               f"{judged.distance} at {judged.where}, bound {judged.bound})"] if passed and not judged.ok else []
        for label, recorded, computed in (("largest_difference", distance, judged.distance),
                                          ("noise", noise, judged.noise), ("bound", bound, judged.bound)):
            if not _same(recorded, computed):
                out.append(f"resume check {name}: {label} is {recorded}; its evidence gives {computed}")
        return out

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
        if not math.isclose(bound, multiple * noise, rel_tol=1e-9, abs_tol=1e-15):
            out.append(f"resume check loss: bound {bound} is not {multiple:g} x its noise {noise}")
        if twin is not None and abs(twin - reference) > noise * (1 + 1e-9) + 1e-15:
            out.append(f"resume step {step}: the twin's loss differs from the reference by {abs(twin - reference)}, "
                       f"more than the loss noise {noise} the bound was made from")
        return out
