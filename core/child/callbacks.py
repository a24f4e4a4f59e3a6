"""What the child hooks into Trainer: the measuring trainer, the step reporter and the kill switch.

- :class:`MeasuringTrainer` records, per micro-batch, the sample ids fed to the model and the unrounded loss; reports
  the random generators right after a checkpoint's RNG state is restored; and asks the kill switch at each micro-batch
  and before a checkpoint's optimizer is written (a private hook of Trainer each: ``_load_rng_state``,
  ``_save_optimizer_and_scheduler``).
- :class:`StepReporter` emits one :class:`~core.protocol.events.Step` per optimizer step (global step, epoch, the
  learning rate applied, the loss summed over the step's micro-batches, the sample ids, the generators' digests as
  the step started), one :class:`~core.protocol.events.CheckpointSaved` per checkpoint, and stops the resumed run of the
  resume check after its last compared step.
- :class:`KillSwitch` holds the interrupted run at its kill point (:func:`core.killpoints.holds`) until the parent
  SIGKILLs its process group.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from core.killpoints import holds
from core.protocol.events import CheckpointSaved, EventWriter, KillPoint, RngRestored, Step
from core.protocol.job import WorkerJob
from core.protocol.rng import live_rng_state, rng_digest

if TYPE_CHECKING:
    import torch


class KillSwitch:
    """The interrupted run's kill point: ``job.kill_at`` (a :data:`core.killpoints.KILL_POINTS` name) by step
    ``job.kill_step``; every other role never holds.

    Args:
        job: the child's job (``role``, and for ``interrupted`` ``kill_at`` and ``kill_step``).
        events: where the :class:`~core.protocol.events.KillPoint` is written before holding.
        grad_accum: micro-batches per step when Trainer does not say (``current_gradient_accumulation_steps``).
    """

    def __init__(self, job: WorkerJob, events: EventWriter, grad_accum: int) -> None:
        interrupted = job.role == "interrupted" and (
            job.kill_node is None or int(os.environ.get("GROUP_RANK", "0")) == job.kill_node)  # a node loss: one node
        self.kill_at: str | None = job.kill_at if interrupted else None
        self.kill_step: int = (job.kill_step or 0) if interrupted else 0
        self.events = events
        self.grad_accum = grad_accum

    def check(self, trainer: Any, where: str) -> None:
        """Hold here when the kill point is reached: emit ``kill_point`` and sleep until the parent kills this
        process group (never returns then). ``where``: ``step_begin`` | ``micro`` | ``step_end`` | ``save``."""
        if self.kill_at is None:
            return
        step, done = trainer.state.global_step, len(trainer.micro)
        n = getattr(trainer, "current_gradient_accumulation_steps", self.grad_accum)
        if holds(self.kill_at, self.kill_step, step, where, done, n):
            self.events.write(KillPoint(step=step, where=where, micro_done=done, micro_in_step=n))
            while True:  # hold: the parent kills this process group now
                time.sleep(0.05)


class MeasuringTrainer(Trainer):
    """Trainer that keeps each micro-batch's sample ids and loss (``micro``, emptied by :class:`StepReporter` at each
    optimizer step), reports the generators right after a restore, and asks ``kill_switch`` where it may hold.

    ``fault`` (tests only, :mod:`core.protocol.faults`): the resume bug this run commits when it loads a checkpoint."""

    def __init__(self, *args: Any, events: EventWriter, kill_switch: KillSwitch, fault: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events = events
        self.kill_switch = kill_switch
        self.fault = fault
        self.micro: list[tuple[list[int], float]] = []  # (sample ids, loss) per micro-batch of the current step

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        ids = inputs.pop("sample_ids").tolist()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.micro.append((ids, float(loss)))
        self.kill_switch.check(self, "micro")
        return loss

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self.fault == "adapters_not_restored":  # planted: the adapters keep their initial values
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        import copy

        fresh = (copy.deepcopy(self.lr_scheduler.state_dict())
                 if self.fault == "scheduler_restart" and self.lr_scheduler is not None else None)
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        if self.fault == "fresh_optimizer" and self.optimizer is not None:  # planted: AdamW from zero moments, step 0
            getattr(self.optimizer, "optimizer", self.optimizer).state.clear()
        if fresh is not None and self.lr_scheduler is not None:  # planted: the schedule restarts
            self.lr_scheduler.load_state_dict(fresh)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self.fault == "rng_not_restored":  # planted: the generators go on from wherever this process has them
            return
        super()._load_rng_state(checkpoint)
        if checkpoint is not None:
            self.events.write(RngRestored(digest=rng_digest(live_rng_state()), checkpoint=str(checkpoint)))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.kill_switch.check(self, "save")  # weights are written, optimizer and the rest not: a partial checkpoint
        super()._save_optimizer_and_scheduler(output_dir)


class StepReporter(TrainerCallback):
    """Emits a ``step`` event per optimizer step and a ``checkpoint`` event per save (see the module's docstring).

    Args:
        events: the child's events.
        kill_switch: asked at each step's start and end.
        stop_after: the resumed run of the resume check: the last step it compares (training stops there; max_steps
            stays the spec's, so the learning-rate schedule is the uninterrupted run's). None: run to the end.
    """

    def __init__(self, events: EventWriter, kill_switch: KillSwitch, stop_after: int | None = None) -> None:
        self.events = events
        self.kill_switch = kill_switch
        self.stop_after = stop_after
        self.lr: float | None = None
        self.rng: dict[str, str] | None = None
        self.trainer: Any = None  # the MeasuringTrainer it reports for (set once the Trainer is built)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self.rng = rng_digest(live_rng_state())  # the generators as this optimizer step starts
        self.kill_switch.check(self.trainer, "step_begin")

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                              optimizer: Any = None, **kw: Any) -> None:  # a torch optimizer
        self.lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        micro, self.trainer.micro = self.trainer.micro, []
        self.events.write(Step(
            step=state.global_step,
            epoch=float(state.epoch or 0.0),
            learning_rate=self.lr,
            loss=sum(loss for _, loss in micro),
            sample_ids=[i for ids, _ in micro for i in ids],
            rng=self.rng,
        ))
        self.kill_switch.check(self.trainer, "step_end")
        if self.stop_after is not None and state.global_step >= self.stop_after:
            # the resume check's window ends here (a checkpoint step: Trainer still saves it, then stops)
            control.should_training_stop = True

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        # TrainingArguments.__post_init__ sets output_dir ("trainer_output" when not given): never None here
        path = Path(cast(str, args.output_dir)) / f"checkpoint-{state.global_step}"
        self.events.write(CheckpointSaved(step=state.global_step, path=str(path)))
