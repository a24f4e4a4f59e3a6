"""The kill points of the resume check (``resume.kill_at``): their names, where each lands, the rule that says the
interrupted run holds there, and the words that describe it. The one home of that rule: the child holds by it
(:mod:`core.child.recipe`), the resume stage checks the kill by it (:mod:`core.stages.resume`), the spec validates and
describes by it (:class:`core.spec.ResumeSettings`), and the screens and the CLI label by it.

Terms: ``c`` is the checkpoint the resume starts from (a global step), ``every`` the checkpoint interval, ``k`` the
optimizer step the kill is placed by (:func:`kill_step`). The child reports where it is as ``where``: ``step_begin``
(a step starts), ``micro`` (a micro-batch's backward is done), ``step_end`` (an optimizer step is done), ``save`` (a
checkpoint's weights are written, its optimizer, scheduler, RNG and trainer state not yet). Imports nothing: the child
and the parent both use it.
"""

from __future__ import annotations

from typing import Literal

#: Where the SIGKILL of the resume check lands (the spec's ``resume.kill_at``).
KillAt = Literal["boundary", "boundary-1", "boundary+1", "checkpoint-write"]

#: every kill point, with what it means (the spec's documentation and its validation error list these names)
KILL_POINTS: dict[KillAt, str] = {
    "boundary": "at the gradient-accumulation boundary: right after optimizer step k",
    "boundary-1": "one micro-step before the boundary: all but the last micro-batch of step k done, no optimizer step",
    "boundary+1": "one micro-step after the boundary: the first micro-batch of step k+1 done (gradients partly "
                  "accumulated), no optimizer step",
    "checkpoint-write": "during the write of the next checkpoint after the one resumed from: its weights written, "
                        "optimizer, scheduler, RNG and trainer state not",
}

#: the default: mid-accumulation, where a crash usually falls, during a forward or backward
DEFAULT_KILL_AT: KillAt = "boundary+1"

#: the setup screen's choice labels (what each option does, in a few words)
CHOICE_LABELS: dict[str, str] = {
    "boundary+1": "boundary+1 · mid-step, no update",
    "boundary": "boundary · right after a step",
    "boundary-1": "boundary-1 · before a step's last micro",
    "checkpoint-write": "checkpoint-write · mid checkpoint",
}

#: the CLI's help of ``--kill-at``
CLI_HELP = ("where the interrupted run is SIGKILLed: at the accumulation boundary, one micro-step before or after it "
            "(default boundary+1), or while the next checkpoint is written")


def kill_step(kill_at: str, c: int, every: int) -> int:
    """The optimizer step ``k`` the kill is placed by: halfway between checkpoint ``c`` and the next; for
    ``checkpoint-write`` the step whose checkpoint is being written (c + every).

    Valid by construction for every interval: the kill lands after checkpoint c is complete and before c + every is.
    ``boundary`` (after step k's optimizer step, before its checkpoint is saved) and ``boundary-1`` (inside step k)
    need c < k <= c + every; ``boundary+1`` is inside step k + 1, after any checkpoint of step k was saved, so it
    needs c <= k < c + every: with a checkpoint every step, k = c."""
    if kill_at == "checkpoint-write":
        return c + every
    if kill_at == "boundary+1":
        return c + min(max(1, every // 2), every - 1)
    return c + max(1, every // 2)


def last_step_needed(kill_at: str, k: int) -> int:
    """The last optimizer step the interrupted run must reach (``boundary+1`` is inside step k + 1)."""
    return k + (1 if kill_at == "boundary+1" else 0)


def fits_in_run(kill_at: str, last: int, steps: int) -> bool:
    """A run of ``steps`` steps reaches the kill whose last step needed is ``last``: a kill inside step k + 1
    (``boundary+1``) or during the write of the last checkpoint may fall in the last step; the others must fall
    before it (step k's checkpoint is still to come)."""
    return last <= steps if kill_at in ("checkpoint-write", "boundary+1") else last < steps


def holds(kill_at: str, k: int, step: int, where: str | None, micro_done: int | None, micro_in_step: int) -> bool:
    """The interrupted run holds here: global step ``step`` done, at ``where``, with ``micro_done`` of the current
    step's ``micro_in_step`` micro-batches done. False for an unknown ``kill_at``."""
    if kill_at == "boundary":
        return where == "step_end" and step == k
    if kill_at == "boundary-1":
        return where in ("step_begin", "micro") and step == k - 1 and micro_done == micro_in_step - 1
    if kill_at == "boundary+1":
        return where == "micro" and step == k and micro_done == 1
    if kill_at == "checkpoint-write":
        return where == "save" and step == k
    return False


def position(step: int, where: str | None, micro_done: int = 0, micro_in_step: int = 1) -> str:
    """Where a run was when it held (the child's report: ``step`` done, ``where``, micro-batches), in words."""
    if where == "save":
        return f"while checkpoint-{step} was being written (weights saved, optimizer not)"
    if where == "step_end":
        return f"right after optimizer step {step}"
    if where == "step_begin":
        return f"at the start of step {step + 1}, before its micro-batch (no accumulation: one per step)"
    if micro_in_step == 1:
        return f"inside step {step + 1} after its only micro-batch's backward, before its optimizer step"
    return f"inside step {step + 1} after {micro_done} of its {micro_in_step} micro-batches, before its optimizer step"


def describe(kill_at: str, k: int, c: int, short: bool = False) -> str:
    """The planned kill in words, with its step numbers (``short``: without what is on disk at that moment)."""
    where, disk = {
        "boundary": (f"right after optimizer step {k}", f"checkpoint-{c} written, the next not yet"),
        "boundary-1": (f"inside step {k}, before its last micro-batch", f"the others done, no optimizer step; "
                                                                       f"checkpoint-{c} written"),
        "boundary+1": (f"inside step {k + 1}, after its first micro-batch, before its optimizer step",
                       f"checkpoint-{c} written"),
        "checkpoint-write": (f"while checkpoint-{k} is written", f"weights saved, optimizer not: resume must take "
                                                                 f"checkpoint-{c}"),
    }[kill_at]
    return where if short else f"{where} ({disk})"


def timeline_label(kill_at: str | None, k: int) -> str:
    """Where the interrupted run was killed, short enough for the resume screen's 80-column timeline."""
    return {"boundary": f"after step {k}", "boundary-1": f"in step {k}, before last micro",
            "boundary+1": f"in step {k + 1}, micro 1",
            "checkpoint-write": f"writing ckpt {k}"}.get(kill_at or "", f"at step {k}")
