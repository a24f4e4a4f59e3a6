"""The onboarding check: 4-6 multiple-choice questions built from one acceptance record's own numbers.

Each question tests a conclusion, not a term: whether the plan fits (per device, never by the box's total), what grows
when the micro-batch doubles, what LoRA changes, what peak allocated / reserved / RSS are, what a finished run says about
quality, what a checkpoint and the resume comparison show. Every right answer is computed from the record (the keys it
reads are named in ``Question.evidence``); a kind whose data the record does not hold is not asked (inference records
get no training or resume question). Nothing here imports textual (the wizard's quiz screen and ``gpuaccept quiz`` draw
these questions).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from core.errors import GpuAcceptError
from core.methods import METHODS, trains
from core.plan.fit import fits_in
from core.status import PASSING

GiB = 2**30
#: the most questions a quiz asks; fewer when the record lacks the data of a kind
MAX_QUESTIONS = 6


@dataclass(frozen=True)
class Question:
    """One question: ``choices[answer]`` is right; ``explanation`` points at the evidence (``evidence``: record keys)."""

    id: str
    prompt: str
    choices: tuple[str, ...]
    answer: int
    explanation: str
    evidence: tuple[str, ...] = field(default_factory=tuple)


def _gib(n: float) -> str:
    """Bytes in GiB (2^30) with 3 significant digits below 10 GiB (a tiny model's lines stay readable)."""
    g = n / GiB
    if 0 < g < 0.001:
        return "<0.001 GiB"
    return f"{g:.1f} GiB" if g >= 10 else f"{g:.2f} GiB" if g >= 1 else f"{g:.3g} GiB"


def _gib_exact(n: int) -> str:
    """:func:`_gib`, with the bytes beside a size under 0.001 GiB (a tiny model's lines would all read the same)."""
    return _gib(n) if n >= 0.001 * GiB else f"{_gib(n)} ({n:,} B)"


def _ordered(qid: str, seed: str, right: str, wrong: list[str]) -> tuple[tuple[str, ...], int]:
    """The choices in an order fixed by the record and the question (so the right one is not always first)."""
    choices = [right, *wrong]
    rng = random.Random(hashlib.sha256(f"{seed}:{qid}".encode()).digest())
    rng.shuffle(choices)
    return tuple(choices), choices.index(right)


def _q(qid: str, seed: str, prompt: str, right: str, wrong: list[str], explanation: str,
       evidence: tuple[str, ...]) -> Question:
    choices, answer = _ordered(qid, seed, right, wrong)
    return Question(qid, prompt, choices, answer, explanation, evidence)


#: the fewest questions a quiz asks: a record that answers fewer is refused
MIN_QUESTIONS = 4


def build_quiz(record: dict[str, Any]) -> list[Question]:
    """The questions for ``record`` (a parsed record.toml, schema version 1), in a fixed order, 4 to
    :data:`MAX_QUESTIONS`. A kind whose data is missing or malformed in the record is not asked.

    Raises:
        GpuAcceptError: the record is not a mapping, holds no plan, or answers fewer than :data:`MIN_QUESTIONS`
            questions.
    """
    if not isinstance(record, dict):
        raise GpuAcceptError("not a record: give the record.toml of a run")
    plan = record.get("plan")
    if not isinstance(plan, dict) or plan.get("provenance") != "estimated" or not isinstance(plan.get("devices"), list) \
            or not plan["devices"]:
        raise GpuAcceptError("this record holds no plan, so there is nothing its numbers can answer; quiz a record "
                             "whose plan stage ran")
    found = record.get("spec")
    spec: dict[str, Any] = found if isinstance(found, dict) else {}
    seed = str(spec.get("hash", ""))
    method = METHODS.get(str(spec.get("mode")))
    training = method is not None and method.trains
    makers = [_fit_by_device, _batch_doubles]
    if training:
        makers.append(_qlora_saves if method is not None and method.takes("quant") else _lora_vs_full)
    makers += [_memory_readings, _finished_vs_quality]
    if training:
        makers.append(_checkpoint_vs_resume)
    questions = []
    for make in makers:
        try:
            q = make(record, seed)
        except (KeyError, TypeError, AttributeError, ValueError, IndexError, ZeroDivisionError):
            q = None  # the record's data for this kind is malformed: not asked
        if q is not None:
            questions.append(q)
    if len(questions) < MIN_QUESTIONS:
        raise GpuAcceptError(f"this record's numbers answer only {len(questions)} question(s) (the check asks at least "
                             f"{MIN_QUESTIONS}): its probe, evaluation or resume did not run or lack data; quiz a "
                             "record whose stages ran")
    return _spread_answers(questions[:MAX_QUESTIONS], seed)


def _spread_answers(questions: list[Question], seed: str) -> list[Question]:
    """Move each right answer to a position drawn without replacement from shuffled rounds of A-D (fixed by the
    record), so no letter is right more than ⌈n/4⌉ times in n questions (shuffling each question alone gave A as the
    answer to 4 of 6); the wrong choices keep their shuffled order."""
    rng = random.Random(hashlib.sha256(f"{seed}:answers".encode()).digest())
    slots: list[int] = []
    while len(slots) < len(questions):
        block = list(range(4))
        rng.shuffle(block)
        slots += block
    out = []
    for q, slot in zip(questions, slots):
        wrong = [c for i, c in enumerate(q.choices) if i != q.answer]
        at = min(slot, len(wrong))
        choices = (*wrong[:at], q.choices[q.answer], *wrong[at:])
        out.append(dataclasses.replace(q, choices=choices, answer=at))
    return out


# ------------------------------------------------------------------------------------------------------------ kinds
def _fit_by_device(rec: dict[str, Any], seed: str) -> Question | None:
    devices = [d for d in rec["plan"]["devices"] if isinstance(d.get("capacity_bytes"), int) and d["capacity_bytes"] > 0]
    if not devices:
        return None
    total = sum(int(d["total_bytes"]) for d in devices)
    capacity = sum(d["capacity_bytes"] for d in devices)
    over = [d for d in devices if not fits_in(d["total_bytes"], d["capacity_bytes"])]
    tightest = max(devices, key=lambda d: d["total_bytes"] / d["capacity_bytes"])
    host_ranks = len(devices) > 1 and all(str(d["name"]).startswith("cpu") for d in devices)
    if host_ranks:  # CPU ranks: processes sharing one host's memory, each planned against an equal share of it
        prompt = (f"The plan gives each of {len(devices)} CPU ranks an equal share of the host's available memory "
                  f"({_gib(devices[0]['capacity_bytes'])} each) and needs {_gib(total)} in all. Does the plan say "
                  "it fits?")
    elif len(devices) > 1:
        prompt = (f"The plan needs {_gib(total)} over {len(devices)} devices; together they have {_gib(capacity)}. "
                  "Does the plan say this setup fits?")
    else:
        d = devices[0]
        which = f" ({d['capacity_source']})" if isinstance(d.get("capacity_source"), str) and d["capacity_source"] else ""
        prompt = (f"The plan needs {_gib(d['total_bytes'])} on {d['name']}, which has {_gib(d['capacity_bytes'])}"
                  f"{which}. Does the plan say this setup fits?")
    if over:
        d = over[0]
        right = f"No: {d['name']} needs {_gib(d['total_bytes'])}, above its own {_gib(d['capacity_bytes'])}"
    else:
        right = (f"Yes: each device fits on its own (tightest {tightest['name']}: "
                 f"{_gib(tightest['total_bytes'])} of {_gib(tightest['capacity_bytes'])})")
    weights = sum(int(d["components"].get("weights", 0)) for d in devices)
    wrong = [
        (f"Yes: the {len(devices)} devices' {_gib(capacity)} in all hold the {_gib(total)}, as CUDA pools memory"
         if len(devices) > 1 and not host_ranks else
         f"No: {len(devices)} ranks cannot share the {_gib(capacity)} of one host's memory" if host_ranks else
         f"Yes: what does not fit in the {_gib(capacity)} is swapped to disk, so any plan fits a CPU"
         if str(devices[0]["name"]).startswith("cpu") else
         f"It depends on the host's RAM added to the {_gib(capacity)} of {devices[0]['name']}"),
        f"It cannot say: only the probe's measurement decides fit, not a plan's estimate of {_gib(total)}",
        f"Yes: only the weights ({_gib(weights)}) have to fit; the rest is allocated on demand",
    ]
    shares = "; ".join(f"{d['name']} {_gib(d['total_bytes'])} of {_gib(d['capacity_bytes'])} "
                       f"({'fits' if fits_in(d['total_bytes'], d['capacity_bytes']) else 'does not fit'})" for d in devices)
    if host_ranks:
        explanation = ("Each rank is a process with its own weights, gradients, optimizer states and activations; "
                       "the plan judges each against its share of the host's available memory. From the record: "
                       f"{shares}. The plan says fit or not from its estimates; the probe then measures each rank.")
    else:
        explanation = ("Fit is judged per device: a unified CUDA address space does not pool physical memory, so a "
                       "device whose share exceeds its capacity fails however much the others have free. From the "
                       f"record: {shares}. The plan says fit or not from its estimates; the probe then measures.")
    return _q("fit_by_device", seed, prompt, right, wrong, explanation,
              ("plan.devices[].total_bytes", "plan.devices[].capacity_bytes"))


def _batch_doubles(rec: dict[str, Any], seed: str) -> Question | None:
    d = rec["plan"]["devices"][0]
    comps = d["components"]
    if not comps.get("activations"):
        return None
    dominant = max(comps, key=lambda k: comps[k])
    inference = not trains(rec.get("spec", {}).get("mode"))
    act = comps["activations"]
    kv = comps.get("kv_cache", 0)
    methods = d.get("methods", {}) if isinstance(d.get("methods"), dict) else {}
    prompt = (f"On {d['name']} the largest line of the plan is {dominant} ({_gib(comps[dominant])} of "
              f"{_gib(d['total_bytes'])}). If the micro-batch doubled (same sequence length), what would grow?")
    if inference and kv:
        right = f"Activations and KV cache ~2x ({_gib(act + kv)} → {_gib(2 * act + 2 * kv)}); the weights stay"
    else:
        right = f"Activations ~2x ({_gib(act)} → {_gib(2 * act)}), with the logits; the weights stay"
    wrong = [
        f"Weights ({_gib(comps.get('weights', 0))} → {_gib(2 * comps.get('weights', 0))}): more samples touch more "
        "parameters, the rest stays",
        f"Every line ~2x ({_gib(d['total_bytes'])} → {_gib(2 * d['total_bytes'])}): the whole step handles twice "
        "the data",
        (f"Optimizer states ({_gib(comps.get('optimizer_states', 0))} → "
         f"{_gib(2 * comps.get('optimizer_states', 0))}): a moment per sample, the rest stays") if not inference else
        f"Nothing: inference memory ({_gib(d['total_bytes'])}) is set by the weights alone, whatever the batch",
    ]
    explanation = ("Activations are kept per token of the micro-batch, so they are linear in it; so are the "
                   "logits and their gradient among the temporaries. Weights, gradients and optimizer states follow "
                   "the parameters only. The record's own formulas: activations "
                   f"({comps['activations']:,} B): {methods.get('activations', 'not stated')}; temporaries: "
                   f"{methods.get('temporaries', 'not stated')}")
    return _q("batch_doubles", seed, prompt, right, wrong, explanation,
              ("plan.devices[0].components", "plan.devices[0].methods"))


def _lora_vs_full(rec: dict[str, Any], seed: str) -> Question | None:
    mode = rec["spec"].get("mode")
    device = rec["plan"]["devices"][0]
    comps = device["components"]
    grads_opt = comps.get("gradients", 0) + comps.get("optimizer_states", 0)
    total_p = rec.get("model", {}).get("parameters_total")
    trained_p = rec.get("model", {}).get("parameters_trainable")
    if not isinstance(total_p, int) or not isinstance(trained_p, int) or not total_p or not trained_p:
        return None
    per_param, how = _state_bytes_per_parameter(rec["spec"])
    method = METHODS.get(str(mode))
    if method is not None and method.trains_base:
        prompt = (f"This full fine-tuning trains all {total_p:,} parameters. If LoRA replaced it (frozen base, small "
                  "adapters), which lines would shrink most?")
        right = f"Gradients and optimizer states ({_gib(grads_opt)} now): only trained parameters have them"
        wrong = [f"Activations ({_gib(comps.get('activations', 0))} now): a frozen base keeps no activations at all",
                 f"Weights ({_gib(comps.get('weights', 0))} now): LoRA replaces the base matrices by low-rank ones",
                 "None of them: LoRA changes the learning rate and the update, not what is held in memory"]
    else:
        name = method.label if method is not None else "LoRA"  # a variant by its own name ("DoRA (LoRA variant)")
        prompt = (f"This {name} run trains {trained_p:,} of {total_p:,} parameters. With full fine-tuning instead, "
                  "which lines would grow most?")
        right = f"Gradients and optimizer states ({_gib(grads_opt)} now): every parameter would have them"
        if per_param:
            right += f", about {_gib(total_p * per_param)} ({how})"
        wrong = [f"Activations ({_gib(comps.get('activations', 0))} now): only full fine-tuning keeps them at all",
                 f"Weights ({_gib(comps.get('weights', 0))} now): LoRA keeps the base model compressed in memory",
                 f"The KV cache ({_gib(comps.get('kv_cache', 0))} now): full fine-tuning keeps one per layer"]
    explanation = ("Gradients (one per trained parameter) and optimizer states (AdamW: two moments per trained "
                   "parameter) follow the trained parameters; the weights are all held either way. Activations follow "
                   "the tokens through every layer, frozen or not; LoRA saves only part of them (the record's "
                   "activations method says which). From the record: "
                   f"{trained_p:,} trained of {total_p:,}; gradients + optimizer states {_gib(grads_opt)} on "
                   f"{device['name']}." + (f" Per trained parameter of this base: {how}." if per_param else ""))
    return _q("lora_vs_full", seed, prompt, right, wrong, explanation,
              ("model.parameters_total", "model.parameters_trainable", "plan.devices[0].components"))


def _qlora_saves(rec: dict[str, Any], seed: str) -> Question | None:
    """QLoRA: what the 4-bit base saves (the decoder's linear weights) and what it does not (activations, the adapters'
    gradients and optimizer states, the parameters left unquantised)."""
    from core.dtypes import dtype_bytes

    q = rec["plan"]["quantised"]
    dtype = rec["spec"].get("dtype", "fp32")
    stored = int(q["packed_bytes"]) + int(q["constants_bytes"])
    unpacked = int(q["quantised_parameters"]) * dtype_bytes(dtype)
    comps = rec["plan"]["devices"][0]["components"]
    measured = next((row["components"]["quantised_weights"].get("measured_bytes")
                     for row in rec.get("probe", {}).get("plan_comparison", [])
                     if "quantised_weights" in row.get("components", {})), None)
    prompt = (f"This QLoRA run stores {q['layers']} decoder linear layers ({int(q['quantised_parameters']):,} "
              f"parameters) in 4 bits ({q['quant_type']}). Compared with basic LoRA on the same base in {dtype}, what "
              "does the 4-bit base save?")
    right = (f"Those layers' weights: {_gib_exact(stored)} stored instead of {_gib_exact(unpacked)} in {dtype}; activations, "
             "the adapters' gradients and optimizer states stay as LoRA's")
    wrong = [f"The activations ({_gib(comps.get('activations', 0))} now) as well: a 4-bit layer keeps 4-bit inputs "
             "for backward",
             f"The adapters' gradients and optimizer states ({_gib(comps.get('gradients', 0) + comps.get('optimizer_states', 0))}"
             " now): they are stored in 4 bits too",
             f"Every weight, embeddings and LM head included ({_gib(q['unquantised_bytes'])} of them now, unquantised)"]
    explanation = ("Only the frozen base's linear weights are stored in 4 bits (0.5 B per parameter plus per-block "
                   "constants) and dequantised to the compute dtype layer by layer as they run; embeddings, norms and "
                   "the LM head stay unquantised (fp32 after peft's prepare_model_for_kbit_training). The adapters "
                   "are trained in fp32 as in LoRA, and the activations follow the tokens as in LoRA. From the "
                   f"record: plan.quantised {stored:,} B of 4-bit weights"
                   + (f", measured {int(measured):,} B by the probe" if measured is not None else "") + ".")
    return _q("qlora_saves", seed, prompt, right, wrong, explanation,
              ("plan.quantised", "spec.dtype", "plan.devices[0].components", "probe.plan_comparison[].components"))


def _state_bytes_per_parameter(spec: dict[str, Any]) -> tuple[int, str]:
    """Bytes of gradient + optimizer states per trained parameter of the record's base, in the dtype its parameters
    were held in (precision pure: the spec's dtype; amp, and records of schema 1, which had no precision: fp32), and
    the formula; (0, "") for Adafactor (factored states: not per parameter)."""
    from core.dtypes import dtype_bytes

    dtype = spec.get("dtype", "fp32") if spec.get("precision", "amp") == "pure" else "fp32"
    b = dtype_bytes(dtype)  # an unknown dtype (a hand-edited record) raises: this question is then not asked
    from core.optim import OPTIMIZERS

    optimizer = OPTIMIZERS.get(str(spec.get("optimizer", "adamw")))
    if optimizer is None or not optimizer.state_count:  # factored, quantised or fp32 states: not per parameter
        return 0, ""
    n, what = optimizer.state_count, optimizer.state_words
    return b * (1 + n), f"{b} B gradient + {what} x {b} B in {dtype}, the dtype the base is held in"


def _memory_readings(rec: dict[str, Any], seed: str) -> Question | None:
    probe = rec.get("probe", {})
    if probe.get("provenance") != "measured" or not probe.get("devices"):
        return None
    d = probe["devices"][0]
    peak = int(d["peak_bytes"])
    reserved = d.get("peak_reserved_bytes")
    if reserved is not None:
        reserved = int(reserved)
        if reserved < peak:
            return None
        prompt = (f"On {d['device']} the probe measured peak allocated {_gib(peak)} and peak reserved "
                  f"{_gib(reserved)}. What is the {_gib(reserved - peak)} between them?")
        right = (f"Blocks torch's caching allocator took from the driver and keeps for reuse, not live tensors "
                 f"({_gib(reserved - peak)})")
        wrong = [f"Memory other processes hold on {d['device']}, counted in the reserved figure",
                 "The CUDA context, which torch counts as reserved memory",
                 f"Rounding: allocated is in GB (10^9 B) and reserved in GiB (2^30 B), {_gib(reserved - peak)} apart"]
        explanation = ("Peak allocated is the most bytes live tensors held; reserved is what torch's caching allocator "
                       "held (allocated + cached free blocks). Neither counts the CUDA context or other processes: "
                       "those are in the device's own 'used' figure (NVML), which this record does not hold. From the "
                       f"record: allocated {peak:,} B, reserved {reserved:,} B on {d['device']}.")
        evidence = ("probe.devices[0].peak_bytes", "probe.devices[0].peak_reserved_bytes")
    else:
        rss = int(d.get("peak_rss_bytes", 0))
        if rss <= peak:
            return None
        prompt = (f"On the CPU the probe measured a peak of live tensors of {_gib(peak)} and a process peak RSS of "
                  f"{_gib(rss)}. Why is the RSS larger?")
        right = f"RSS also holds the runtime, libraries and caches ({_gib(rss - peak)} here)"
        wrong = [f"RSS counts the GPU's memory too ({_gib(rss - peak)} of it here), tensors only the host's",
                 f"The tensor tracker missed the weights and optimizer states ({_gib(rss - peak)} of them)",
                 f"Units: RSS is in GB (10^9 B) and the tensors in GiB (2^30 B), {_gib(rss - peak)} apart"]
        explanation = ("The probe follows every tensor storage created in the step (plus the weights and optimizer "
                       "states): that is what the plan estimates. RSS is the whole process's resident memory: "
                       f"runtime and libraries included, so the host's fit is judged by it. From the record: tensors "
                       f"{peak:,} B, RSS {rss:,} B.")
        evidence = ("probe.devices[0].peak_bytes", "probe.devices[0].peak_rss_bytes")
    return _q("memory_readings", seed, prompt, right, wrong, explanation, evidence)


def _finished_vs_quality(rec: dict[str, Any], seed: str) -> Question | None:
    import math

    ev = rec.get("evaluation", {})
    before = ev.get("before", {})
    if ev.get("provenance") != "measured" or before.get("provenance", "measured") != "measured":
        return None
    b = float(before["perplexity"])
    tokens = int(before["tokens"])
    if not trains(rec["spec"].get("mode")):
        prompt = "The fixed weights ran over the held-out split without an error. What does the record say about them?"
        right = (f"Held-out perplexity {b:.3f} on {tokens:,} tokens: how they predict this text, nothing beyond it"
                 if math.isfinite(b) else f"Their held-out perplexity is {b}: not finite, so their outputs are broken")
        wrong = ["That they are good: the evaluation ran over every held-out block without an error",
                 "Nothing at all: perplexity is defined for training runs, not for fixed weights",
                 "That they are broken: any perplexity above 1 means the model makes errors"]
        explanation = ("Finishing shows the setup runs. The measured number is the token-weighted perplexity "
                       "exp(Σ NLL / Σ tokens) on the held-out split (lower is better; 1 is perfect): "
                       f"{b:.3f} on {tokens:,} tokens, from these weights on this text only.")
        return _q("finished_vs_quality", seed, prompt, right, wrong, explanation,
                  ("evaluation.before.perplexity", "evaluation.before.tokens"))
    after = ev.get("after", {})
    if "perplexity" not in after:
        return None
    a = float(after["perplexity"])
    losses = ev.get("loss_per_step") or []
    steps = len(losses) or rec["spec"].get("steps")
    prompt = f"Training ran {steps} optimizer steps and ended without an error. What does that say about quality?"
    if math.isfinite(a) and math.isfinite(b):
        pct = 100.0 * (a - b) / b
        right = f"Nothing alone; held-out perplexity {b:.3f} → {a:.3f} ({pct:+.2f} %), this text only"
    else:
        right = f"Nothing alone; and held-out perplexity {b} → {a} is not finite: the outputs are broken"
    first_last = (f"{losses[0]:.3f} to {losses[-1]:.3f}" if len(losses) >= 2 else "its first to its last value")
    wrong = [f"It is good: the training loss went from {first_last} on the data it trained on",
             f"It is good: a run that finishes {steps} steps without an error has converged",
             "It is bad: any held-out perplexity above 1 means the model has failed to learn"]
    explanation = ("'It ran' is not 'it is good'. The training loss is measured on the data it trains on; the "
                   "held-out split was never trained on, and a small change is a weak signal. From the record: "
                   f"perplexity before {b:.3f}, after {a:.3f} on {tokens:,} tokens ({ev.get('status')}: "
                   f"{ev.get('criterion', '')}).")
    return _q("finished_vs_quality", seed, prompt, right, wrong, explanation,
              ("evaluation.before.perplexity", "evaluation.after.perplexity", "evaluation.loss_per_step"))


def _checkpoint_vs_resume(rec: dict[str, Any], seed: str) -> Question | None:
    res = rec.get("resume", {})
    if res.get("provenance") != "measured" or not res.get("checks"):
        return None
    c = res.get("checkpoint_step")
    tier = res.get("tier", {}) if isinstance(res.get("tier"), dict) else {}
    checks = res["checks"]
    failed = [str(ch.get("name")) for ch in checks if ch.get("status") not in PASSING]  # not_applicable passes
    prompt = (f"checkpoint-{c} was written, and the resume check ran (tier {tier.get('name')}). What has been "
              "shown?")
    if not failed:
        right = f"That it resumed from checkpoint-{c} as the uninterrupted run did, here; no more"
    else:
        right = f"Not that it resumes: {', '.join(failed[:3])} failed against the uninterrupted run"
    wrong = [f"That it resumes anywhere: checkpoint-{c} holds every file Trainer writes, so it loads",
             f"That every rerun with seed {rec['spec'].get('seed')} is bit-identical, on any machine and thread count",
             f"Nothing: checkpoint-{c} either loads or raises, so there is nothing to compare against"]
    explanation = ("A checkpoint's presence says files exist, not that training continues from them. The record's "
                   f"resume check killed a second run {res.get('kill_planned', '')}, resumed it from checkpoint-{c} "
                   "and compared it with the "
                   f"uninterrupted run: {len(checks) - len(failed)} of {len(checks)} checks passed"
                   + (f" (failed: {', '.join(failed)})" if failed else "")
                   + f". Tier {tier.get('name')}: {tier.get('why', '')}; it holds on this "
                   "box, and the record promises nothing bit-identical elsewhere.")
    return _q("checkpoint_vs_resume", seed, prompt, right, wrong, explanation,
              ("resume.checks", "resume.tier", "resume.checkpoint_step"))


# ---------------------------------------------------------------------------------------------------------- scoring
def onboarding_table(questions: list[Question], chosen: list[int], operator: str, now: datetime) -> dict[str, Any]:
    """The record's optional ``onboarding`` table: who answered, when (UTC), the score and each question's answer.

    Raises:
        GpuAcceptError: no operator name, a naive time, or not one answer per question.
    """
    if not operator.strip():
        raise GpuAcceptError("onboarding: give the operator's name (who answered)")
    if now.tzinfo is None:
        raise GpuAcceptError("onboarding: the time must be timezone-aware (UTC)")
    if len(chosen) != len(questions):
        raise GpuAcceptError(f"onboarding: {len(chosen)} answers for {len(questions)} questions; answer every one")
    rows = [{"id": q.id, "prompt": q.prompt, "chosen": q.choices[i], "right": q.choices[q.answer],
             "correct": i == q.answer} for q, i in zip(questions, chosen)]
    return {"operator": operator.strip(), "time_utc": now, "score": sum(r["correct"] for r in rows),
            "questions_asked": len(rows), "questions": rows}


def add_onboarding(record_path: Path, table: dict[str, Any]) -> Path:
    """Append ``table`` to an unsigned record's ``onboarding`` attempts (an array of tables: each answer kept, none
    replaced), written atomically.

    Raises:
        GpuAcceptError: the record is signed (a signed record is never rewritten: its signature covers its bytes), or
            unreadable.
    """

    from core.bounds import MAX_RECORD_FILE, loads_bounded, read_input_text
    from core.record.signing import signature_path
    from core.record.written import write_record

    path = Path(record_path)
    if signature_path(path).exists():
        raise GpuAcceptError(f"{path} is signed; a signed record is never rewritten (its signature covers every "
                             "byte): the quiz result was not added")
    try:
        record = loads_bounded(read_input_text(path, "a gpuaccept record", MAX_RECORD_FILE))
    except (OSError, ValueError) as exc:
        raise GpuAcceptError(f"{path}: cannot read the record ({exc})") from None
    earlier = record.get("onboarding", [])
    record["onboarding"] = [*(earlier if isinstance(earlier, list) else [earlier]), table]
    return write_record(record, path)
