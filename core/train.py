"""Train + evaluate stage: held-out perplexity before and after ``steps`` Trainer steps, in a child process.

Inference mode evaluates once (fixed weights: no backward, no update). The training run writes Trainer checkpoints every
``resume.checkpoint_every`` steps and is the reference of the resume check (:mod:`core.resume`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generator

from core.childproc import ChildJob, check_exit, start_child, watch
from core.events import ChildStarted, Event, Message, Progress
from core.spec import RunSpec


@dataclass(frozen=True)
class EvalPoint:
    """One measured evaluation of the held-out split."""

    perplexity: float
    mean_nll: float
    tokens: int
    blocks: int
    seconds: float


@dataclass(frozen=True)
class TrainEvalResult:
    """Outcome of training and evaluation.

    ``status``: pass when held-out perplexity after training is below the one before (training modes), or when the
    inference evaluation was measured; fail otherwise. ``criterion`` says which applied.
    """

    status: str
    criterion: str
    metric: str
    before: EvalPoint
    after: EvalPoint | None
    training_time_s: float | None
    tokens_per_s: float | None
    steps: list[dict[str, Any]] = field(default_factory=list)  # one per optimizer step: step, epoch, lr, loss, sample_ids
    data: dict[str, Any] = field(default_factory=dict)
    output_dir: str = ""
    log_path: str = ""
    summary: str = ""
    trainable: dict[str, Any] = field(default_factory=dict)  # names and count of trainable parameters (training)


def run_train_eval(
    spec: RunSpec, model_path: Path, job_dir: Path, device: str, cancelled=None
) -> Generator[Event, None, tuple[TrainEvalResult, ChildJob]]:
    """Run the train (or, for inference, evaluate-only) child; yield progress; return the result and the child job.

    Raises:
        StageError: the child failed.
    """
    role = "train" if spec.training else "evaluate"
    what = f"evaluate, train {spec.steps} steps, evaluate" if spec.training else "evaluate the fixed weights once"
    yield Message("train_eval", text=f"starting the {role} child on {device}: {what}")
    child = start_child(role, job_dir, {"role": role, "spec": spec.to_dict(), "model_path": str(model_path),
                                        "device": device, "save_total_limit": None})
    yield ChildStarted("train_eval", run="train", pid=child.proc.pid, log_path=str(child.log_path))
    for event in watch(child, cancelled=cancelled):
        if event["kind"] == "step":
            yield Progress("train_eval", run="train", step=event["step"], total=spec.steps, loss=event["loss"],
                           learning_rate=event["learning_rate"])
        elif event["kind"] == "evaluation":
            when = f" {event['when']} training" if spec.training else ""
            yield Message("train_eval", text=f"held-out perplexity{when}: {event['perplexity']:.3f} "
                                             f"({event['tokens']} tokens, {event['seconds']:.1f} s)")
    check_exit(child)
    evals = {e["when"]: e for e in child.events if e["kind"] == "evaluation"}
    steps = [e for e in child.events if e["kind"] == "step"]
    trained = next((e for e in child.events if e["kind"] == "trained"), None)
    data = next((e for e in child.events if e["kind"] == "data"), {})
    before = _point(evals["before"])
    after = _point(evals["after"]) if "after" in evals else None
    metric = evals["before"]["metric"]
    if data.get("heldout_selection"):
        metric = f"{metric}; evaluated on {data['heldout_selection']}"
    if spec.training:
        assert after is not None and trained is not None
        finite = math.isfinite(before.perplexity) and math.isfinite(after.perplexity)
        status = "pass" if finite and after.perplexity < before.perplexity else "fail"
        criterion = "held-out perplexity after training < before training, both finite"
        train_s = float(trained["seconds"])
        tokens = spec.batch_size * spec.grad_accum * spec.seq_len * spec.steps
        summary = f"perplexity {before.perplexity:.3f} -> {after.perplexity:.3f} in {spec.steps} steps, {train_s:.1f} s"
        tps: float | None = tokens / train_s if train_s > 0 else None
    else:
        status = "pass" if math.isfinite(before.perplexity) else "fail"
        criterion = ("measured on fixed weights: pass when finite (inference sets no threshold; read the value; a "
                     "non-finite perplexity means the model's outputs are broken)")
        train_s, tps = None, None
        summary = f"perplexity {before.perplexity:.3f} on the fixed weights"
    result = TrainEvalResult(
        status=status,
        criterion=criterion,
        metric=metric,
        before=before,
        after=after,
        training_time_s=train_s,
        tokens_per_s=tps,
        steps=[{k: e.get(k) for k in ("step", "epoch", "learning_rate", "loss", "sample_ids", "rng")} for e in steps],
        data={k: v for k, v in data.items() if k not in ("kind", "t")},
        output_dir=str(child.output_dir),
        log_path=str(child.log_path),
        summary=summary,
        trainable=next(({k: e[k] for k in ("names", "parameters")} for e in child.events
                        if e["kind"] == "trainable"), {}),
    )
    return result, child


def _point(e: dict[str, Any]) -> EvalPoint:
    return EvalPoint(perplexity=e["perplexity"], mean_nll=e["mean_nll"], tokens=e["tokens"], blocks=e["blocks"],
                     seconds=e["seconds"])
