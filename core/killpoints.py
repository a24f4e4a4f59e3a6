"""The kill points of the resume check (``resume.kill_at``): their names, where each lands, the rule that says the
interrupted run holds there, and the words that describe it. The one home of that rule: the child holds by it
(:mod:`core.child.recipe`), the resume stage checks the kill by it (:mod:`core.stages.resume`), the spec validates and
describes by it (:class:`core.spec.ResumeSettings`), and the screens and the CLI label by it.

Terms: ``c`` is the checkpoint the resume starts from (a global step), ``every`` the checkpoint interval, ``k`` the
optimizer step the kill is placed by (:func:`kill_step`). The child reports where it is as ``where``: ``step_begin``
(a step starts), ``micro`` (a micro-batch's backward is done), ``step_end`` (an optimizer step is done), ``save`` (a
checkpoint's weights are written, its optimizer, scheduler, RNG and trainer state not yet). A place is said in one
wording, :func:`words` (the plan, the child's report, the timeline and the progress line all use it). Imports nothing:
the child and the parent both use it.
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


def words(step: int, where: str | None, micro_done: int | None = 0, micro_in_step: int | None = None,
          short: bool = False) -> str:
    """A kill point in words: the one wording of a place in the training loop, for the planned kill
    (:func:`describe`, via :func:`planned_point`), where the child held (:func:`position`), the resume screen's timeline
    (:func:`timeline_label`) and its progress line.

    Args:
        step: the optimizer steps done (the child's ``global_step``).
        where: ``step_begin`` | ``micro`` | ``step_end`` | ``save`` (see the module's docstring).
        micro_done: micro-batches of step ``step + 1`` done (their backward run); None: all but the last (the plan of
            ``boundary-1`` when the count per step is not known).
        micro_in_step: micro-batches per optimizer step (gradient accumulation), when known: said as "of n".
        short: without the clause that repeats what is implied (no optimizer step; what is on disk).

    Example: ``words(25, "micro", 1, 1)`` -> "inside step 26, after micro-batch 1 of 1, before its optimizer step".
    """
    if where == "save":
        return f"while checkpoint-{step} is written" + ("" if short else " (weights saved, optimizer not)")
    if where == "step_end":
        return f"right after optimizer step {step}"
    inside = f"inside step {step + 1}"
    if micro_done == 0:
        return f"{inside}, before its first micro-batch"
    if micro_done is None:
        at = "before its last micro-batch"
    else:
        at = f"after micro-batch {micro_done}" + (f" of {micro_in_step}" if micro_in_step else "")
    return f"{inside}, {at}" + ("" if short else ", before its optimizer step")


def planned_point(kill_at: str, k: int, micro_in_step: int | None = None) -> tuple[int, str, int | None]:
    """Where the child holds for ``kill_at`` placed by step ``k``, as it reports it: (optimizer steps done, ``where``,
    micro-batches done; None: all but the last, when ``micro_in_step`` is not known). The inverse of :func:`holds`'s
    first place. Raises KeyError for an unknown ``kill_at``."""
    if kill_at == "boundary":
        return k, "step_end", 0
    if kill_at == "boundary-1":
        return k - 1, "micro", (micro_in_step - 1 if micro_in_step else None)
    if kill_at == "boundary+1":
        return k, "micro", 1
    if kill_at == "checkpoint-write":
        return k, "save", 0
    raise KeyError(kill_at)


def position(step: int, where: str | None, micro_done: int = 0, micro_in_step: int = 1) -> str:
    """Where a run was when it held (the child's report: ``step`` done, ``where``, micro-batches), in
    :func:`words`."""
    return words(step, where, micro_done, micro_in_step)


def planned(kill_at: str, k: int, micro_in_step: int | None = None, short: bool = False) -> str:
    """The planned kill's place in :func:`words` (``micro_in_step``: the spec's gradient accumulation, when the
    caller has it): ``inside step 26, after micro-batch 1 of 1, before its optimizer step``."""
    step, where, done = planned_point(kill_at, k, micro_in_step)
    return words(step, where, done, micro_in_step, short)


def describe(kill_at: str, k: int, c: int, short: bool = False, micro_in_step: int | None = None) -> str:
    """The planned kill in :func:`words` (short), with its step numbers and, unless ``short``, what is on disk at
    that moment (``micro_in_step``: the spec's gradient accumulation, when the caller has it)."""
    at = planned(kill_at, k, micro_in_step, short=True)
    if short:
        return at
    disk = {"boundary": f"checkpoint-{c} written, the next not yet",
            "boundary-1": f"no optimizer step; checkpoint-{c} written",
            "boundary+1": f"no optimizer step; checkpoint-{c} written",
            "checkpoint-write": f"weights saved, optimizer not: resume must take checkpoint-{c}"}[kill_at]
    return f"{at} ({disk})"


def timeline_label(kill_at: str | None, k: int, micro_in_step: int | None = None) -> str:
    """Where the interrupted run is killed, for the resume screen's timeline: :func:`words` in short."""
    try:
        return planned(kill_at or "", k, micro_in_step, short=True)
    except KeyError:
        return f"at step {k}"
