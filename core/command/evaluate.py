"""Command mode's evaluation: the final checkpoint of the uninterrupted run against its base, on held-out data.

Two ways, by ``command.eval``:

- ``perplexity`` (default): token-weighted held-out perplexity ``exp(sum NLL / target tokens)`` of the final
  checkpoint (a Hugging Face model or peft adapter folder) and of its base, on the held-out split of gpuaccept's text
  (``command.data``, split by a hash of each document id), in a child process (:mod:`core.child.checkpoint_eval`).
  Criterion: finite, and lower after training than before.
- a command holding ``{checkpoint}``: the user's own evaluation, run on the base (``command.model``) and on the final
  checkpoint; the last line of its output that is a JSON object with ``metric`` and ``value`` (and optionally
  ``higher_is_better``, true or false: required, never guessed from the name; and optionally ``definition``) is the
  result. Criterion: finite, and better after than
  before in the metric's direction.

Without a base to compare with, the criterion cannot be met and the stage fails, saying so: a number measured after
training alone says nothing about what training did. The held-out split is independent of the training data by
construction only when the command trained on ``{train_data}`` (gpuaccept's training split); otherwise the record says
that independence is not known.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.command.process import kill_job, start_job
from core.command.reports import last_lines
from core.commandspec import CommandSpec, substitute
from core.criteria import Judgement
from core.errors import StageCancelled, StageError
from core.events import ChildStarted, Evaluated, Event, Message
from core.protocol.events import METRIC, DataInfo, Evaluation, as_dict
from core.protocol.job import EvalJob
from core.stages.checkpoint import Checkpoint
from core.stages.childproc import check_exit, start_child, watch
from core.status import StageStatus

#: the sequence length of the evaluation when the spec gives none and no Trainer reported one
DEFAULT_EVAL_SEQ_LEN = 128


@dataclass(frozen=True)
class CommandEvaluation:
    """Outcome of the evaluation stage. ``status``: pass | fail | not_applicable (``eval = "none"``).

    Attributes:
        before / after: the metric of the base and of the final checkpoint (``value`` and, for perplexity,
            ``mean_nll``, ``tokens``, ``blocks``, ``seconds``); None when not measured (``why`` in ``summary``).
        checkpoint: the final checkpoint evaluated (its name and step).
        independence: whether the held-out split is disjoint from what the command trained on, in words.
    """

    status: StageStatus
    criterion: str
    metric: str
    definition: str
    higher_is_better: bool
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    checkpoint: str
    checkpoint_step: int | None
    base: str
    independence: str
    summary: str
    data: dict[str, Any] = field(default_factory=dict)
    log_path: str = ""
    #: the criteria it was judged by (core/criteria.py ``judge_metric``), with the numbers
    criteria: list[Judgement] = field(default_factory=list)


def evaluate_stage(spec: CommandSpec, final: Checkpoint | None, base: str, seq_len: int, job_dir: Path,
                   cancelled: Callable[[], bool] | None = None, heldout: str = ""
                   ) -> Generator[Event, None, CommandEvaluation]:
    """Evaluate ``final`` against ``base`` as ``spec.eval`` says (see the module docstring).

    Args:
        final: the uninterrupted run's newest checkpoint (None: it wrote none).
        base: the base model folder (``command.model``, else what the Trainer or the adapter names), or "".
        seq_len: tokens per held-out block (``command.eval_seq_len``, else the Trainer's widest batch, else 128).
        heldout: the held-out split's text file, for an evaluation command's ``{heldout_data}`` ("" when it has none).

    Raises:
        StageError: the evaluation's child failed to start (a failed evaluation is a ``fail`` result).
    """
    independence = _independence(spec)
    common: dict[str, Any] = {"checkpoint": final.name if final else "", "checkpoint_step": final.step if final else None,
              "base": base, "independence": independence}
    if final is None:
        return CommandEvaluation(StageStatus.FAIL, "a final checkpoint to evaluate", "", "", False, None, None,
                                 summary="not evaluated: the uninterrupted run wrote no checkpoint matching "
                                         f"{spec.checkpoints} in its output folder", **common)
    if spec.eval == "perplexity":
        return (yield from _perplexity(spec, final, base, seq_len, job_dir, common, cancelled))
    return (yield from _own_command(spec, final, base, job_dir, common, cancelled, heldout))


#: the weight files a checkpoint folder may hold (transformers' and peft's names, sharded or not)
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "adapter_model.bin", "model*.pt")


def holds_weights(checkpoint: Path) -> bool:
    """Whether the checkpoint (a folder, or a file standing for one) holds model weights. Across nodes Trainer writes
    them on the node holding rank 0 only (``save_on_each_node`` off); another node's checkpoint folder holds its
    ranks' RNG states."""
    if checkpoint.is_file():
        return True
    return any(next(checkpoint.glob(g), None) is not None for g in WEIGHT_GLOBS)


def _independence(spec: CommandSpec) -> str:
    """Whether the evaluated documents are disjoint from what the command trained on, in words."""
    if spec.eval != "perplexity" and not spec.uses_heldout_split():
        return ("not known: the evaluation command reads its own data, not {heldout_data} (gpuaccept's held-out "
                "split)")
    if spec.uses_training_split():
        return ("by construction: the command trained on {train_data}, gpuaccept's training split, and the held-out "
                "documents are not in it")
    return ("not known: the command reads its own training data, not {train_data}; the held-out documents may be in "
            "it")


def _perplexity(spec: CommandSpec, final: Checkpoint, base: str, seq_len: int, job_dir: Path,
                common: dict[str, Any], cancelled: Callable[[], bool] | None
                ) -> Generator[Event, None, CommandEvaluation]:
    yield Message("train_eval", text=f"held-out perplexity of {final.name}" + (f" and of its base {base}" if base
                                                                               else " (no base named: after only)"))
    job = EvalJob(checkpoint=str(final.path), base=base, data=spec.data, heldout_fraction=spec.heldout_fraction,
                  seq_len=seq_len, max_blocks=spec.eval_max_blocks, batch_size=4)
    child = start_child("evaluation", job_dir, job, module="core.child.checkpoint_eval")
    yield ChildStarted("train_eval", run="evaluation", pid=child.pid, log_path=str(child.log_path))
    points: dict[str, dict[str, Any]] = {}
    data: dict[str, Any] = {}
    for event in watch(child, cancelled=cancelled):
        if isinstance(event, Evaluation):
            points[event.when] = {"value": event.perplexity, "perplexity": event.perplexity,
                                  "mean_nll": event.mean_nll, "tokens": event.tokens, "blocks": event.blocks,
                                  "seconds": event.seconds}
            yield Evaluated("train_eval", text=f"held-out perplexity {event.when} training: {event.perplexity:.3f} "
                                               f"({event.tokens:,} tokens)", when=event.when,
                            perplexity=event.perplexity)
        elif isinstance(event, DataInfo):
            data = as_dict(event)
    definition = (f"{METRIC}; held-out split of {spec.data} (heldout_fraction {spec.heldout_fraction}, by a hash "
                  f"of each document id), blocks of {seq_len} tokens, at most {spec.eval_max_blocks} blocks")
    try:
        check_exit(child)
    except StageError as exc:
        return CommandEvaluation(StageStatus.FAIL, "held-out perplexity measured", "perplexity", definition, False,
                                 points.get("before"), points.get("after"), summary=f"not evaluated: {exc}",
                                 data=data, log_path=str(child.log_path), **common)
    return _judged("perplexity", definition, False, points.get("before"), points.get("after"), data,
                   str(child.log_path), common)


def _own_command(spec: CommandSpec, final: Checkpoint, base: str, job_dir: Path, common: dict[str, Any],
                 cancelled: Callable[[], bool] | None, heldout: str) -> Generator[Event, None, CommandEvaluation]:
    points: dict[str, dict[str, Any]] = {}
    said: dict[str, Any] = {}
    problems = []
    for when, target in (("before", base), ("after", str(final.path))):
        if not target:
            continue
        argv = substitute(_words(spec.eval), {"{checkpoint}": target, "{model}": spec.model, "{heldout_data}": heldout})
        yield Message("train_eval", text=f"evaluation command on the {'base' if when == 'before' else final.name}")
        result, problem = yield from _run_eval(spec, argv, job_dir / f"eval-{when}", cancelled)
        if problem:
            problems.append(f"{when}: {problem}")
        else:
            points[when], said = {"value": float(result["value"])}, result
            yield Evaluated("train_eval", text=f"{result.get('metric')} {when} training: {result['value']}",
                            when=when, perplexity=float("nan"))
    metric = str(said.get("metric", "the evaluation command's metric"))
    definition = str(said.get("definition", "")) or f"printed by `{spec.eval}` (its last JSON line)"
    higher = bool(said.get("higher_is_better", False))
    if problems:
        return CommandEvaluation(StageStatus.FAIL, "the evaluation command prints its metric", metric, definition,
                                 higher, points.get("before"), points.get("after"), summary="; ".join(problems),
                                 log_path=str(job_dir), **common)
    return _judged(metric, definition, higher, points.get("before"), points.get("after"), {}, str(job_dir), common)


def _words(text: str) -> list[str]:
    import shlex

    return shlex.split(text)


def _run_eval(spec: CommandSpec, argv: list[str], job_dir: Path, cancelled: Callable[[], bool] | None
              ) -> Generator[Event, None, tuple[dict[str, Any], str]]:
    """Run one evaluation command to its end; (its JSON result, "") or ({}, what went wrong)."""
    job = start_job("evaluation", argv, spec.workdir_path, job_dir, spec.env)
    yield ChildStarted("train_eval", run="evaluation", pid=job.proc.pid, log_path=str(job.log_path))
    started = time.monotonic()
    try:
        while job.proc.poll() is None:
            if cancelled is not None and cancelled():
                kill_job(job)
                raise StageCancelled("evaluation command: cancelled; every process of it was killed")
            if spec.timeout_s and time.monotonic() - started > spec.timeout_s:
                kill_job(job)
                return {}, f"timed out after {spec.timeout_s:g} s"
            time.sleep(0.05)
    finally:
        if job.proc.poll() is None:
            kill_job(job)
    if job.proc.returncode != 0:
        return {}, f"exit status {job.proc.returncode} ({last_lines(job.log_path, 3)})"
    result = last_json(job.log_path)
    if result is None:
        return {}, ("printed no JSON line with metric and value (e.g. {\"metric\": \"accuracy\", \"value\": 0.71, "
                    f"\"higher_is_better\": true}}); see {job.log_path}")
    if not isinstance(result.get("higher_is_better"), bool):
        return {}, (f"its JSON line for {result.get('metric')!r} does not say which way is better: add "
                    "\"higher_is_better\": true or false (gpuaccept does not guess it from the name)")
    return result, ""


def last_json(log: Path) -> dict[str, Any] | None:
    """The last line of ``log`` that is a JSON object with ``metric`` and a finite numeric ``value``, or None."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and "metric" in obj and isinstance(obj.get("value"), (int, float)) and \
                not isinstance(obj.get("value"), bool) and math.isfinite(obj["value"]):
            return obj
    return None


def _judged(metric: str, definition: str, higher: bool, before: dict[str, Any] | None, after: dict[str, Any] | None,
            data: dict[str, Any], log_path: str, common: dict[str, Any]) -> CommandEvaluation:
    direction = "higher" if higher else "lower"
    criterion = f"{metric} finite after training and {direction} than the base's before"
    if after is None:
        status, summary = StageStatus.FAIL, "the final checkpoint was not evaluated"
    elif before is None:
        status, summary = StageStatus.FAIL, (f"{metric} after training {after['value']:.4g}, and nothing to compare it "
                                             "with: no base model was named (command.model) or found; a number after "
                                             "training alone says nothing about what the training did")
    else:
        a, b = float(after["value"]), float(before["value"])
        better = math.isfinite(a) and math.isfinite(b) and (a > b if higher else a < b)
        status = StageStatus.judged(better)
        summary = f"{metric} {b:.4g} -> {a:.4g} ({'better' if better else 'not better'}: {direction} is better)"
    return CommandEvaluation(status, criterion, metric, definition, higher, before, after, summary=summary,
                             data=data, log_path=log_path, **common)
