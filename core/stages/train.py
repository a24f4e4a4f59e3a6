"""Train + evaluate stage: held-out perplexity before and after ``steps`` Trainer steps, in a child process.

Inference mode evaluates once (fixed weights: no backward, no update). The training run writes Trainer checkpoints every
``resume.checkpoint_every`` steps and is the reference of the resume check (:mod:`core.stages.resume`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from core.criteria import Judgement, judge_quality, missed, quality_criterion
from core.criteria import summary as criteria_summary
from core.events import ChildStarted, Evaluated, Event, FirstStepWait, Message, Progress, lead_events
from core.protocol.events import (
    ChildEvent,
    DataInfo,
    Evaluation,
    ModelBuilt,
    Started,
    Step,
    Trainable,
    Trained,
    as_dict,
)
from core.protocol.job import Role, worker_job
from core.spec import RunSpec
from core.stages.childproc import SINGLE, ChildJob, Launch, check_exit, start_child, watch
from core.status import StageStatus


@dataclass(frozen=True)
class EvalPoint:
    """One measured evaluation of the held-out split: perplexity, mean NLL (nats per target), the targets counted,
    the blocks, seconds of forward passes, and next-token accuracy (``accuracy = correct_tokens / tokens``; None for
    an evaluation that did not count it)."""

    perplexity: float
    mean_nll: float
    tokens: int
    blocks: int
    seconds: float
    correct_tokens: int | None = None
    accuracy: float | None = None


@dataclass(frozen=True)
class TrainEvalResult:
    """Outcome of training and evaluation.

    ``status``: pass when every criterion of :func:`core.criteria.judge_quality` is met (by default: held-out
    perplexity after training below the one before; inference: finite); ``criterion`` says them in words and
    ``judgements`` holds each with its numbers.
    """

    status: StageStatus
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
    judgements: list[Judgement] = field(default_factory=list)  # the criteria it was judged by (core/criteria.py)


class StepMean:
    """Progress of a several-rank run: one step once every local rank has reported that step, its loss the mean over
    the ranks (what the record keeps; :func:`merge_rank_steps`)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = max(1, ranks)
        self.pending: dict[int, list[Step]] = {}

    def add(self, event: Step) -> Step | None:
        """The merged step (the first rank's, with the mean loss) when ``event`` completes it, else None."""
        got = self.pending.setdefault(event.step, [])
        got.append(event)
        if len(got) < self.ranks:
            return None
        del self.pending[event.step]
        return replace(got[0], loss=sum(e.loss for e in got) / len(got))


def step_record(event: Step) -> dict[str, Any]:
    """One step as the record and the resume comparison keep it: ``step``, ``epoch``, ``learning_rate``, ``loss``,
    ``sample_ids``, ``rng`` (generator -> sha256 digest as the step started)."""
    return {"step": event.step, "epoch": event.epoch, "learning_rate": event.learning_rate, "loss": event.loss,
            "sample_ids": list(event.sample_ids), "rng": event.rng}


def merge_rank_steps(events: list[ChildEvent]) -> list[dict[str, Any]]:
    """One record per optimizer step (:func:`step_record`) from every rank's ``step`` events, in step order.

    A single process's steps are returned in the order they came. Under torchrun (events with ``rank``) each step's
    record is rank 0's with ``loss`` = the mean of the ranks' losses (each rank's own micro-batches; equal sizes, so
    the mean is the global batch's), ``rank_losses`` = each rank's loss, ``ranks`` = the ranks in order,
    ``sample_ids`` = every rank's ids in rank order, and ``rng`` = every rank's generator digests, keyed
    ``<generator>@rank<r>``.
    """
    steps = [e for e in events if isinstance(e, Step)]
    if not any(e.rank is not None for e in steps):
        return [step_record(e) for e in steps]
    by_step: dict[int, dict[int, Step]] = {}
    for e in steps:
        by_step.setdefault(e.step, {})[e.rank or 0] = e
    out = []
    for step in sorted(by_step):
        ranks = by_step[step]
        order = sorted(ranks)
        out.append({
            **step_record(ranks[order[0]]),
            "loss": sum(ranks[r].loss for r in order) / len(order),
            "rank_losses": [ranks[r].loss for r in order],
            "ranks": order,
            "sample_ids": [i for r in order for i in ranks[r].sample_ids],
            "rng": {f"{k}@rank{r}": v for r in order for k, v in (ranks[r].rng or {}).items()},
        })
    return out


def run_train_eval(
    spec: RunSpec, model_path: Path, job_dir: Path, device: str, cancelled: Callable[[], bool] | None = None,
    launch: Launch = SINGLE,
) -> Generator[Event, None, tuple[TrainEvalResult, ChildJob]]:
    """Run the train (or, for inference, evaluate-only) child; yield progress; return the result and the child job.

    Args:
        launch: :func:`core.stages.childproc.launch_options` for several ranks (torchrun); one process by default. Held-out
            evaluation, data and training time come from rank 0; each step's loss is the mean over the ranks
            (:func:`merge_rank_steps`).

    Raises:
        StageError: the child failed.
    """
    names = launch.names(device)
    role: Role = "train" if spec.training else "evaluate"
    what = f"evaluate, train {spec.steps} steps, evaluate" if spec.training else "evaluate the fixed weights once"
    where = f"{launch.nproc} ranks under torchrun" if launch.nproc > 1 else device
    yield Message("train_eval", text=f"starting the {role} child on {where}: {what}")
    child = start_child(role, job_dir, worker_job(spec, role, model_path, device, names), launch)
    yield ChildStarted("train_eval", run="train", pid=child.pid, log_path=str(child.log_path))
    wait = FirstStepWait("train_eval", "train", child.pid, role)  # what it does before its first step, said
    yield wait.started()
    mean = StepMean(launch.nproc)
    for event in watch(child, cancelled=cancelled):
        if (waiting := wait.see(event)) is not None:
            yield waiting
        if isinstance(event, Step):
            step = mean.add(event)
            if step is not None:
                yield Progress("train_eval", run="train", step=step.step, total=spec.steps, loss=step.loss,
                               learning_rate=step.learning_rate)
        elif event.leads:  # this node's first rank reports for the run
            said = _said(spec, child, event)
            if said is not None:
                yield said
    check_exit(child)
    return train_eval_result(spec, child, world=spec.world_size(len(names)) if spec.training else 1), child


def _said(spec: RunSpec, child: ChildJob, event: ChildEvent) -> Event | None:
    """What the log says of one of the lead rank's events: the model's build time, an evaluation; None otherwise."""
    if isinstance(event, ModelBuilt):
        built = event.t - next((e.t for e in child.events if isinstance(e, Started)), event.t)
        return Message("train_eval", text=f"model built in {built:.1f} s (the weights loaded; not part of the "
                                          "evaluation times)")
    if isinstance(event, Evaluation):
        when = f" {event.when} training" if spec.training else ""
        # the seconds are the evaluation's own forward passes: the model was built before (said above)
        return Evaluated("train_eval", text=f"held-out perplexity{when}: {event.perplexity:.3f} "
                                            f"({event.tokens} tokens, {event.seconds:.1f} s of evaluation)",
                         when=event.when if spec.training else "", perplexity=float(event.perplexity))
    return None


def train_eval_result(spec: RunSpec, child: ChildJob, world: int) -> TrainEvalResult:
    """The stage's result from the child's events (``world``: the ranks training, for the tokens per second).

    Judged by the spec's criteria (:func:`core.criteria.judge_quality`): by default, training passes when the held-out
    perplexity after is below the one before, both finite; inference when its one evaluation is finite."""
    events = lead_events(child.events)
    evals = {e.when: e for e in events if isinstance(e, Evaluation)}
    trained = next((e for e in events if isinstance(e, Trained)), None)
    data = next((e for e in events if isinstance(e, DataInfo)), None)
    trainable = next((e for e in events if isinstance(e, Trainable)), None)
    before = _point(evals["before"])
    after = _point(evals["after"]) if "after" in evals else None
    metric = evals["before"].metric
    if data is not None and data.heldout_selection:
        metric = f"{metric}; evaluated on {data.heldout_selection}"
    final = after if after is not None else before
    judgements = judge_quality(spec.accept, spec.training, before.perplexity,
                               after.perplexity if after is not None else None, final.accuracy)
    status = StageStatus.judged(not missed(judgements))
    criterion = quality_criterion(spec.accept, spec.training)
    if spec.training:
        assert after is not None and trained is not None
        train_s = float(trained.seconds)
        tokens = spec.batch_size * spec.grad_accum * spec.seq_len * spec.steps * world
        summary = f"perplexity {before.perplexity:.3f} -> {after.perplexity:.3f} in {spec.steps} steps, {train_s:.1f} s"
        tps: float | None = tokens / train_s if train_s > 0 else None
    else:
        train_s, tps = None, None
        summary = f"perplexity {before.perplexity:.3f} on the fixed weights"
    if final.accuracy is not None:
        summary += f"; next-token accuracy {100 * final.accuracy:.1f} %"
    if not spec.accept.is_default() or status == StageStatus.FAIL:
        summary += "; judged by " + criteria_summary(judgements)
    return TrainEvalResult(
        status=status,
        criterion=criterion,
        metric=metric,
        before=before,
        after=after,
        training_time_s=train_s,
        tokens_per_s=tps,
        steps=[{k: e.get(k) for k in ("step", "epoch", "learning_rate", "loss", "sample_ids", "rng", "rank_losses")
                if k in e} for e in merge_rank_steps(child.events)],
        data=as_dict(data) if data is not None else {},
        output_dir=str(child.output_dir),
        log_path=str(child.log_path),
        summary=summary,
        trainable={"names": trainable.names, "parameters": trainable.parameters} if trainable is not None else {},
        judgements=judgements,
    )


def _point(e: Evaluation) -> EvalPoint:
    return EvalPoint(perplexity=e.perplexity, mean_nll=e.mean_nll, tokens=e.tokens, blocks=e.blocks,
                     seconds=e.seconds, correct_tokens=e.correct,
                     accuracy=e.correct / e.tokens if e.correct is not None and e.tokens else None)
