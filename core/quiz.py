"""The onboarding check: 4-6 multiple-choice questions built from one acceptance record's own numbers.

Each question tests a conclusion, not a term: whether the plan fits (per device, never by the box's total), what grows
when the micro-batch doubles, what LoRA changes, what peak allocated / reserved / RSS are, what a finished run says about
quality, what a checkpoint and the resume comparison show. Every right answer is computed from the record (the keys it
reads are named in ``Question.evidence``); a kind whose data the record does not hold is not asked (inference records
get no training or resume question). Nothing here imports textual (the wizard's quiz screen and ``gpuaccept quiz`` draw
these questions).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from core.errors import GpuAcceptError

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


def build_quiz(record: dict[str, Any]) -> list[Question]:
    """The questions for ``record`` (a parsed record.toml, schema version 1), in a fixed order, at most
    :data:`MAX_QUESTIONS`.

    Raises:
        GpuAcceptError: the record holds no plan (nothing to ask about).
    """
    plan = record.get("plan", {})
    if plan.get("provenance") != "estimated" or not plan.get("devices"):
        raise GpuAcceptError("this record holds no plan, so there is nothing its numbers can answer; quiz a record "
                             "whose plan stage ran")
    seed = str(record.get("spec", {}).get("hash", ""))
    training = record.get("spec", {}).get("mode") != "inference"
    makers = [_fit_by_device, _batch_doubles]
    if training:
        makers.append(_lora_vs_full)
    makers += [_memory_readings, _finished_vs_quality]
    if training:
        makers.append(_checkpoint_vs_resume)
    questions = [q for q in (m(record, seed) for m in makers) if q is not None]
    return questions[:MAX_QUESTIONS]


# ------------------------------------------------------------------------------------------------------------ kinds
def _fit_by_device(rec: dict[str, Any], seed: str) -> Question | None:
    devices = [d for d in rec["plan"]["devices"] if d.get("capacity_bytes")]
    if not devices:
        return None
    total = sum(d["total_bytes"] for d in devices)
    capacity = sum(d["capacity_bytes"] for d in devices)
    over = [d for d in devices if d["total_bytes"] > d["capacity_bytes"]]
    tightest = max(devices, key=lambda d: d["total_bytes"] / d["capacity_bytes"])
    if len(devices) > 1:
        prompt = (f"The plan needs {_gib(total)} over {len(devices)} devices; together they have {_gib(capacity)}. "
                  "Does this setup fit?")
    else:
        d = devices[0]
        prompt = (f"The plan needs {_gib(d['total_bytes'])} on {d['name']}, which has {_gib(d['capacity_bytes'])}. "
                  "Does this setup fit?")
    if over:
        d = over[0]
        right = f"No: {d['name']} needs {_gib(d['total_bytes'])} of its own {_gib(d['capacity_bytes'])}"
    else:
        right = (f"Yes: each device fits on its own (tightest {tightest['name']}: {_gib(tightest['total_bytes'])} of "
                 f"{_gib(tightest['capacity_bytes'])})")
    wrong = [
        f"Yes: the box's {_gib(capacity)} in all hold the {_gib(total)}; CUDA pools memory" if len(devices) > 1 else
        f"It depends on the host's RAM added to {devices[0]['name']}'s",
        "Unknown until the probe runs: a plan cannot judge fit",
        "Yes: only the weights must fit; the rest comes on demand",
    ]
    explanation = ("Fit is judged per device: the unified CUDA address space does not pool physical memory, so a "
                   "device whose share exceeds its capacity fails however much the others have free. From the record: "
                   + "; ".join(f"{d['name']} {_gib(d['total_bytes'])} of {_gib(d['capacity_bytes'])} "
                               f"({'fits' if d['total_bytes'] <= d['capacity_bytes'] else 'does not fit'})"
                               for d in devices)
                   + ". These are estimates; the probe measures.")
    return _q("fit_by_device", seed, prompt, right, wrong, explanation,
              ("plan.devices[].total_bytes", "plan.devices[].capacity_bytes"))


def _batch_doubles(rec: dict[str, Any], seed: str) -> Question | None:
    d = rec["plan"]["devices"][0]
    comps = d["components"]
    if not comps.get("activations"):
        return None
    dominant = max(comps, key=lambda k: comps[k])
    inference = rec["spec"].get("mode") == "inference"
    act = comps["activations"]
    kv = comps.get("kv_cache", 0)
    prompt = (f"On {d['name']} the largest line of the plan is {dominant} ({_gib(comps[dominant])} of "
              f"{_gib(d['total_bytes'])}). If the micro-batch doubled (same sequence length), what would grow?")
    if inference and kv:
        right = f"Activations and KV cache, ~2x each ({_gib(act)} → {_gib(2 * act)}); weights stay"
    else:
        right = f"Activations, ~2x ({_gib(act)} → {_gib(2 * act)}); weights" + (
            " and optimizer states stay" if not inference else " stay")
    wrong = [
        f"Weights ({_gib(comps.get('weights', 0))}): more samples touch more parameters",
        f"Every line, ~2x ({_gib(d['total_bytes'])} → {_gib(2 * d['total_bytes'])}): twice the data",
        f"Optimizer states ({_gib(comps.get('optimizer_states', 0))}): one moment per sample" if not inference else
        f"Nothing: inference memory ({_gib(d['total_bytes'])}) is fixed",
    ]
    explanation = (f"Activations are stored per token (Korthikanti et al. 2022: s·b·h·(34 + 5·a·s/h) bytes per "
                   "layer in 16-bit), so they are linear in the micro-batch b; weights, gradients and optimizer states "
                   f"depend on the parameters only. The record's activations line on {d['name']}: "
                   f"{comps['activations']:,} B (its formula: plan.devices[0].methods.activations).")
    return _q("batch_doubles", seed, prompt, right, wrong, explanation,
              ("plan.devices[0].components", "plan.devices[0].methods.activations"))


_STATE_BYTES = {"adamw": 8, "sgd": 4}  # fp32 optimizer-state bytes per trained parameter (AdamW: 2 moments)


def _lora_vs_full(rec: dict[str, Any], seed: str) -> Question | None:
    mode = rec["spec"].get("mode")
    comps = rec["plan"]["devices"][0]["components"]
    grads_opt = comps.get("gradients", 0) + comps.get("optimizer_states", 0)
    total_p = rec.get("model", {}).get("parameters_total")
    trained_p = rec.get("model", {}).get("parameters_trainable")
    if not total_p or not trained_p:
        return None
    if mode == "full":
        prompt = (f"This full fine-tuning trains all {total_p:,} parameters. If LoRA replaced it (frozen base, small "
                  "adapters), which lines would shrink most?")
        right = f"Gradients and optimizer states ({_gib(grads_opt)} now): only trained parameters have them"
        wrong = [f"Activations ({_gib(comps.get('activations', 0))}): a frozen base stores none",
                 f"Weights ({_gib(comps.get('weights', 0))}): LoRA shrinks the base matrices",
                 "None: LoRA only changes the learning rate"]
    else:
        per = _STATE_BYTES.get(str(rec["spec"].get("optimizer")))
        full = f", ~{_gib(total_p * (4 + per))} for every parameter" if per else ", for every parameter"
        prompt = (f"This LoRA run trains {trained_p:,} of {total_p:,} parameters. With full fine-tuning instead, "
                  "which lines would grow most?")
        right = f"Gradients and optimizer states: {_gib(grads_opt)} now{full}"
        wrong = [f"Activations ({_gib(comps.get('activations', 0))} now): only full fine-tuning stores them",
                 f"Weights ({_gib(comps.get('weights', 0))} now): LoRA keeps the base compressed",
                 "The KV cache: training keeps one per layer"]
    explanation = ("Gradients (one per trained parameter) and optimizer states (AdamW: two fp32 moments, 8 B per "
                   "trained parameter) follow the trained parameters; weights are all held either way, and "
                   "activations follow the tokens through every layer, frozen or not. From the record: "
                   f"{trained_p:,} trained of {total_p:,}; gradients + optimizer states {_gib(grads_opt)} on "
                   f"{rec['plan']['devices'][0]['name']}.")
    return _q("lora_vs_full", seed, prompt, right, wrong, explanation,
              ("model.parameters_total", "model.parameters_trainable", "plan.devices[0].components"))


def _memory_readings(rec: dict[str, Any], seed: str) -> Question | None:
    probe = rec.get("probe", {})
    if probe.get("provenance") != "measured" or not probe.get("devices"):
        return None
    d = probe["devices"][0]
    peak = d["peak_bytes"]
    reserved = d.get("peak_reserved_bytes")
    if reserved is not None:
        prompt = (f"On {d['device']} the probe measured peak allocated {_gib(peak)} and peak reserved "
                  f"{_gib(reserved)}. Which is nearer to what nvidia-smi (NVML 'used') shows, and why?")
        right = f"Reserved + CUDA context: the allocator caches freed blocks ({_gib(reserved - peak)} here)"
        wrong = ["Allocated: nvidia-smi reads torch's tensors",
                 "Neither: reserved is other processes' memory",
                 "Both: they differ only by rounding"]
        explanation = ("Peak allocated is the most live tensor bytes; reserved is what torch's caching allocator took "
                       "from the driver (allocated + cached blocks); NVML 'used' is the device's view: reserved plus "
                       f"the CUDA context and other processes. From the record: allocated {peak:,} B, reserved "
                       f"{reserved:,} B on {d['device']}.")
        evidence = ("probe.devices[0].peak_bytes", "probe.devices[0].peak_reserved_bytes")
    else:
        rss = d.get("peak_rss_bytes", 0)
        if rss <= peak:
            return None
        prompt = (f"On the CPU the probe measured a peak of live tensors of {_gib(peak)} and a process peak RSS of "
                  f"{_gib(rss)}. Why is the RSS larger?")
        right = f"RSS also holds the runtime, libraries and caches ({_gib(rss - peak)} here)"
        wrong = [f"RSS includes the GPU's memory ({_gib(rss - peak)} of it here)",
                 "The tensor tracker missed the weights and optimizer states",
                 "RSS is in GB, the tensors in GiB"]
        explanation = ("The probe follows every tensor storage created in the step (plus the weights and optimizer "
                       "states): that is what the plan estimates. RSS is the whole process's resident memory: "
                       f"runtime and libraries included, so the host's fit is judged by it. From the record: tensors "
                       f"{peak:,} B, RSS {rss:,} B.")
        evidence = ("probe.devices[0].peak_bytes", "probe.devices[0].peak_rss_bytes")
    return _q("memory_readings", seed, prompt, right, wrong, explanation, evidence)


def _finished_vs_quality(rec: dict[str, Any], seed: str) -> Question | None:
    ev = rec.get("evaluation", {})
    before = ev.get("before", {})
    if ev.get("provenance") != "measured" or before.get("provenance", "measured") != "measured":
        return None
    tokens = before.get("tokens", 0)
    if rec["spec"].get("mode") == "inference":
        prompt = "The fixed weights ran over the held-out split without an error. What does the record say about them?"
        right = f"Perplexity {before['perplexity']:.3f} on {tokens:,} held-out tokens: this text only"
        wrong = ["Good: it ran without an error",
                 "Nothing: perplexity is for training only",
                 "Broken: perplexity above 1 means errors"]
        explanation = ("Finishing shows the setup runs. The measured number is the token-weighted perplexity "
                       "exp(Σ NLL / Σ tokens) on the held-out split (lower is better; 1 is perfect): "
                       f"{before['perplexity']:.3f} on {tokens:,} tokens, from these weights on this text only.")
        return _q("finished_vs_quality", seed, prompt, right, wrong, explanation,
                  ("evaluation.before.perplexity", "evaluation.before.tokens"))
    after = ev.get("after", {})
    if "perplexity" not in after:
        return None
    steps = rec["spec"].get("steps")
    b, a = before["perplexity"], after["perplexity"]
    better = a < b
    prompt = f"Training ran all {steps} steps without an error. What does that say about the model's quality?"
    right = (f"Nothing alone; held-out perplexity {b:.3f} → {a:.3f}"
             + (" (lower: better on this text)" if better else " (not lower: no gain shown)"))
    wrong = [f"Good: the training loss went from the first step's to the last step's in {steps} steps",
             "Good: finishing without errors means it converged",
             "Bad: a perplexity above 1 means failure"]
    explanation = ("'It ran' is not 'it is good'. The training loss is measured on the data it trains on; the "
                   "held-out split was never trained on. From the record: perplexity before "
                   f"{b:.3f}, after {a:.3f} ({ev.get('status')}: {ev.get('criterion', '')}).")
    return _q("finished_vs_quality", seed, prompt, right, wrong, explanation,
              ("evaluation.before.perplexity", "evaluation.after.perplexity", "evaluation.before.tokens"))


def _checkpoint_vs_resume(rec: dict[str, Any], seed: str) -> Question | None:
    res = rec.get("resume", {})
    if res.get("provenance") != "measured" or not res.get("checks"):
        return None
    c = res.get("checkpoint_step")
    tier = res.get("tier", {})
    checks = res["checks"]
    failed = [ch["name"] for ch in checks if ch.get("status") != "pass"]
    prompt = (f"checkpoint-{c} was written, and the resume check ran (tier {tier.get('name')}). What has been "
              "shown?")
    if not failed:
        right = f"It resumed from checkpoint-{c} as the uninterrupted run did, here; no promise for other reruns"
    else:
        right = f"Not that it resumes: {', '.join(failed[:3])} failed"
    wrong = [f"It resumes anywhere: checkpoint-{c} holds every file Trainer writes",
             f"Every rerun with seed {rec['spec'].get('seed')} is bit-identical, on any machine",
             "Nothing: a checkpoint loads or raises, nothing to compare"]
    explanation = ("A checkpoint's presence says files exist, not that training continues from them. The record's "
                   f"resume check killed a second run {res.get('kill_planned', '')}, resumed it from checkpoint-{c} "
                   "and compared it with the "
                   f"uninterrupted run: {len(checks) - len(failed)} of {len(checks)} checks passed"
                   + (f" (failed: {', '.join(failed)})" if failed else "")
                   + f". Tier {tier.get('name')} (rtol {tier.get('rtol')}): {tier.get('why', '')}; it holds on this "
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
    """Add ``table`` to an unsigned record as its ``onboarding`` table (written atomically).

    Raises:
        GpuAcceptError: the record is signed (a signed record is never rewritten: its signature covers its bytes), or
            unreadable.
    """
    import tomllib

    from core.record import write_record

    path = Path(record_path)
    if path.with_name(path.name + ".sig").exists():
        raise GpuAcceptError(f"{path} is signed; a signed record is never rewritten (its signature covers every "
                             "byte): the quiz result was not added")
    try:
        record = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise GpuAcceptError(f"{path}: cannot read the record ({exc})") from None
    record["onboarding"] = table
    return write_record(record, path)
