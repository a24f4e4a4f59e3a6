"""The job a stage child is handed: one frozen dataclass per kind of child, written by the parent as ``job.json`` and
read back once by the child, which then reads attributes, never dict keys.

- :class:`WorkerJob`: the job of :mod:`core.child.worker` (the probe, train / evaluate and the resume check's twin,
  interrupted and resumed runs), built by :func:`worker_job` with what differs between the roles.
- :class:`EvalJob`: the job of :mod:`core.child.checkpoint_eval` (command mode's held-out evaluation of a checkpoint).

The parent (:func:`core.stages.childproc.start_child`) fills in where the child writes (``events``, ``output_dir``:
files of its job directory, :meth:`WorkerJob.placed`) and writes :meth:`WorkerJob.to_json`; the child reads the file
with :meth:`WorkerJob.read`. A key the job does not have, a missing key or a value of another type is a
:class:`JobFormatError` naming the key: both sides are the same package, so such a file is a bug, never a guess.

The JSON is the format job files have always had: the same keys with the same values (an optional key without a value
is left out, as the stages always left it out; only its order of keys is the dataclass's).
"""

from __future__ import annotations

import json
import typing
from dataclasses import MISSING, Field, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

from core.protocol.events import type_words, value_is

if TYPE_CHECKING:
    from core.spec import RunSpec

#: the worker's roles (:mod:`core.child.worker`'s docstring says what each does)
Role = Literal["probe", "evaluate", "train", "twin", "interrupted", "resumed"]
ROLES: tuple[str, ...] = typing.get_args(Role)


#: the keys the parent fills in as it starts the child (:meth:`_JobFile.placed`): never missing from a job file
PLACED = ("events", "output_dir")


class JobFormatError(ValueError):
    """A job file that is no job of its kind: not a JSON object, a key the job does not have or lacks, or a value of
    another type. The message names the job's kind and the key."""


class _JobFile:
    """What every job does with its JSON (a mixin of the frozen dataclasses below: their fields are the keys)."""

    KIND: ClassVar[str] = ""
    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]  # each job is a dataclass
    events: str
    output_dir: str

    def _keeps_null(self, name: str) -> bool:
        """Whether the key ``name`` is written as ``null`` when it has no value (else it is left out)."""
        return False

    def to_dict(self) -> dict[str, Any]:
        """The job's keys and values, in field order; an optional key without a value left out (unless
        :meth:`_keeps_null`)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None and not self._keeps_null(f.name):
                continue
            out[f.name] = value
        return out

    def to_json(self) -> str:
        """The text of ``job.json`` (indented JSON, as job files have always been)."""
        return json.dumps(self.to_dict(), indent=2)

    def placed(self, events: str, output_dir: str) -> Self:
        """The job with where its child writes: its events file and its output folder (each kept when already
        given)."""
        return replace(self, events=self.events or events, output_dir=self.output_dir or output_dir)

    @classmethod
    def from_dict(cls, data: Any) -> Self:
        """The job of ``data`` (a decoded ``job.json``).

        Raises:
            JobFormatError: not an object, an unknown or missing key, a value of another type (each named).
        """
        if not isinstance(data, dict):
            raise JobFormatError(f"a {cls.KIND} job must be a JSON object, got {type(data).__name__}")
        known = {f.name: f for f in fields(cls)}
        extra = sorted(set(data) - set(known))
        if extra:
            raise JobFormatError(f"{cls.KIND} job: unexpected key(s) {', '.join(extra)}")
        missing = [n for n, f in known.items() if n not in data and (n in PLACED or f.default is MISSING
                                                                     and f.default_factory is MISSING)]
        if missing:
            raise JobFormatError(f"{cls.KIND} job: missing key(s) {', '.join(missing)}")
        hints = typing.get_type_hints(cls)
        for name, value in data.items():
            if not value_is(value, hints[name]):
                raise JobFormatError(f"{cls.KIND} job: {name} = {value!r:.80} is not {type_words(hints[name])}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> Self:
        """The job of the text of a ``job.json``.

        Raises:
            JobFormatError: not JSON, or not a job (:meth:`from_dict`).
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise JobFormatError(f"a {cls.KIND} job file that is not JSON ({exc})") from None
        return cls.from_dict(data)

    @classmethod
    def read(cls, path: str | Path) -> Self:
        """The job of the file ``path`` (:meth:`from_json`).

        Raises:
            JobFormatError: not a job; the message names the file.
            OSError: the file cannot be read.
        """
        try:
            return cls.from_json(Path(path).read_text(encoding="utf-8"))
        except JobFormatError as exc:
            raise JobFormatError(f"{path}: {exc}") from None


@dataclass(frozen=True)
class WorkerJob(_JobFile):
    """The job of :mod:`core.child.worker`: which role it plays, on which spec, model and devices, and what the
    resume check asks of it. Built by :func:`worker_job`; a role of the resume check is the training job with what
    differs replaced (``dataclasses.replace``)."""

    KIND: ClassVar[str] = "worker"

    role: Role
    """What the child does: ``probe``, ``evaluate`` (inference), ``train``, and the resume check's ``twin``,
    ``interrupted`` and ``resumed`` runs."""
    spec: dict[str, Any]
    """The run's spec as :meth:`core.spec.RunSpec.to_dict` writes it (the child reads it back with ``from_dict``)."""
    model_path: str
    """The model folder the child loads (a runnable path: the embedded model's safetensors cache, or a folder)."""
    device: str
    """The stage's device (``cpu``, ``cuda:0``): the device of a single process."""
    devices: list[str]
    """The devices of the ranks in local-rank order (one for a single process; every device of a device map): a rank
    under torchrun reports the name of its own."""
    save_total_limit: int | None = None
    """Trainer's ``save_total_limit``: how many checkpoints are kept (None: every one). Written, as ``null`` too, by
    every role but the probe's, which saves none."""
    resume_from: str | None = None
    """The checkpoint folder Trainer resumes from (``resumed``; ``interrupted`` when it starts from a copy of the
    reference's checkpoint before c); None: from step 0."""
    manifest: str | None = None
    """The sha256 manifest of ``resume_from`` the resumed process verifies before and after loading it
    (:mod:`core.protocol.manifest`); None: nothing to verify."""
    stop_after_step: int | None = None
    """The last step the run trains (the twin, the resumed run: the last compared step); None: the spec's steps."""
    save_steps: int | None = None
    """Checkpoint every this many steps instead of the spec's ``resume.checkpoint_every`` (the twin: only at its last
    step)."""
    kill_step: int | None = None
    """The interrupted run's kill step (:meth:`core.spec.ResumeSettings.kill_step`); only with ``kill_at``."""
    kill_at: str | None = None
    """The interrupted run's kill point (a :data:`core.killpoints.KILL_POINTS` name): where it holds for the parent's
    SIGKILL; None for every other role."""
    kill_node: int | None = None
    """Several nodes: only the ranks of this node (torchrun's ``GROUP_RANK``) hold at the kill point, so that the
    parent kills every rank of one node, as a node loss (:func:`core.stages.nodeloss.lost_node`); None: every rank
    holds."""
    nudge: bool | None = None
    """True: the twin's nudge, every trainable parameter moved by one ulp before the first optimizer step
    (:func:`core.child.inject.jitter.nudge_into`), so that the twins' spread is never 0 (:mod:`core.stages.noise`);
    None (left out of the job file): no nudge."""
    device_map: str | dict[str, Any] | None = None
    """accelerate's ``device_map`` to load the model with (``{"": "cpu"}``, ``"balanced"``); None: the spec's
    strategy decides (``balanced`` for ``device_map``)."""
    events: str = ""
    """The events file the child writes (``events.jsonl`` in its job directory; torchrun's other ranks beside it):
    filled in by :func:`core.stages.childproc.start_child` (:meth:`placed`)."""
    output_dir: str = ""
    """The folder of the child's checkpoints and output (``output/`` in its job directory): filled in by
    :func:`core.stages.childproc.start_child`."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise JobFormatError(f"{self.KIND} job: role {self.role!r} is none of {', '.join(ROLES)}")
        if self.role == "interrupted" and (self.kill_at is None or self.kill_step is None):
            raise JobFormatError(f"{self.KIND} job: the interrupted run needs kill_at and kill_step")

    def _keeps_null(self, name: str) -> bool:
        return name == "save_total_limit" and self.role != "probe"


def worker_job(spec: RunSpec, role: Role, model_path: str | Path, device: str, devices: list[str]) -> WorkerJob:
    """The worker's job for ``role`` on ``spec``: the one place a job is built (the probe, train / evaluate and the
    resume check's runs, which replace what differs: ``dataclasses.replace(job, role="twin", stop_after_step=...)``).

    Args:
        model_path: the model folder the child loads.
        device: the stage's device; devices: the ranks' devices in local-rank order
            (:meth:`core.stages.childproc.Launch.names`).
    """
    return WorkerJob(role=role, spec=spec.to_dict(), model_path=str(model_path), device=device, devices=list(devices))


@dataclass(frozen=True)
class EvalJob(_JobFile):
    """The job of :mod:`core.child.checkpoint_eval`: command mode's held-out perplexity of the final checkpoint and of
    its base, on gpuaccept's text split by a hash of each document id (:func:`core.data.split_documents`)."""

    KIND: ClassVar[str] = "evaluation"

    checkpoint: str
    """The final checkpoint: a Hugging Face model folder, or a peft adapter folder (loaded over its base)."""
    base: str
    """The model before training (the adapter's base; the model the full fine-tuning started from), or ""."""
    data: str
    """gpuaccept's text (``embedded`` or a file), split into train and held-out."""
    heldout_fraction: float
    """The held-out share of the documents."""
    seq_len: int
    """Tokens per held-out block."""
    max_blocks: int
    """At most this many held-out blocks are evaluated (``command.eval_max_blocks``)."""
    batch_size: int = 4
    """Blocks per forward pass."""
    events: str = ""
    """The events file the child writes: filled in by :func:`core.stages.childproc.start_child`."""
    output_dir: str = ""
    """The child's output folder: filled in by :func:`core.stages.childproc.start_child`."""


#: a job of any child (what :func:`core.stages.childproc.start_child` writes)
Job = WorkerJob | EvalJob
