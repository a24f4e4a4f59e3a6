"""The child's events, typed: one frozen dataclass per kind, written by the child and parsed once by the parent.

The child (:mod:`core.child.worker`) builds these and hands them to :meth:`EventWriter.write`, which appends one JSON
line each to ``events.jsonl`` in its job directory and flushes it, so library prints (which go to the child's log file)
can never corrupt the channel; the parent reads each line back through :func:`parse_event` (:func:`read_events`, the
watcher of :mod:`core.stages.childproc`) and tests ``isinstance(e, Step)``, never a ``"kind"`` key. Neither side's
code: both import it from here (:mod:`core.protocol`).

On disk a line is ``{"kind": KIND, "t": seconds since the epoch, **payload}``, with ``rank`` / ``local_rank`` added by
the writer under torchrun: the format run folders have always had. Every event carries that envelope as attributes:
``t`` (float), ``rank`` (global rank under torchrun, None for a single process) and ``local_rank`` (rank on its node;
None for a single process, except :class:`Started` and :class:`Ledger`, which report their place themselves).

A line whose kind is unknown, which is not a JSON object, or whose keys or value types do not match its kind raises
:class:`EventFormatError`: both sides are the same package, so such a line is a bug or a corrupt file, never something
to skip silently. Torch is never imported here.
"""

from __future__ import annotations

import json
import os
import time
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal

from core.errors import StageError

#: the keys every event has beside its payload: when it was written, and where (torchrun's ranks)
ENVELOPE = ("t", "rank", "local_rank")


class EventFormatError(StageError):
    """A line of a child's events file that is no event: not a JSON object, an unknown ``kind``, a key its kind does not
    have or lacks, or a value of another type. The message names the kind and the key."""


def _omit_if_none() -> Any:
    """A payload key the child writes only when it has a value (``None`` leaves the key out of the line)."""
    return field(default=None, metadata={"omit_if_none": True})


@dataclass(frozen=True)
class ChildEvent:
    """Base of every child event: the envelope (``t``, ``rank``, ``local_rank``; see the module's docstring)."""

    KIND: ClassVar[str] = ""
    t: float = field(default=0.0, kw_only=True)
    rank: int | None = field(default=None, kw_only=True)
    local_rank: int | None = field(default=None, kw_only=True)

    @property
    def leads(self) -> bool:
        """From this node's first rank (local rank 0; a single process leads itself)."""
        return (self.local_rank if self.local_rank is not None else (self.rank or 0)) == 0


# ------------------------------------------------------------------------------------------------- every role
@dataclass(frozen=True)
class Started(ChildEvent):
    """The child is up: its role, pid and process group (the parent kills each rank's group), the device name it
    reports, torch's version, the host, and its place under torchrun (global rank, world size, node rank; the local
    rank is the envelope's ``local_rank``, written in the payload too)."""

    KIND: ClassVar[str] = "started"
    role: str
    pid: int
    pgid: int
    device: str
    torch: str
    host: str
    global_rank: int = 0
    world_size: int = 1
    node_rank: int = 0


@dataclass(frozen=True)
class DeviceUuid(ChildEvent):
    """torch's UUID of the CUDA device the child runs on (the monitor matches NVML's devices by it)."""

    KIND: ClassVar[str] = "device_uuid"
    device: str
    uuid: str


@dataclass(frozen=True)
class ModelBuilt(ChildEvent):
    """The model is loaded: its attention implementation, parameters by dtype (count), and for LoRA the short names
    of the adapted modules and how many modules carry an adapter."""

    KIND: ClassVar[str] = "model_built"
    attention: str
    parameter_dtypes: dict[str, int]
    lora_targets: list[str] | None = _omit_if_none()
    lora_modules: int | None = _omit_if_none()


@dataclass(frozen=True)
class DataInfo(ChildEvent):
    """The split of the text: documents and blocks on each side, which held-out blocks are evaluated (words), the
    sha256 of each side, how it was split and how disjointness was checked."""

    KIND: ClassVar[str] = "data"
    train_documents: int
    heldout_documents: int
    train_blocks: int
    heldout_blocks: int
    heldout_blocks_evaluated: int
    heldout_selection: str
    train_hash: str
    heldout_hash: str
    split_method: str
    disjoint_check: str


@dataclass(frozen=True)
class ChildError(ChildEvent):
    """The child failed: ``"<exception type>: <message>"`` (the traceback is in its log)."""

    KIND: ClassVar[str] = "error"
    error: str


# ------------------------------------------------------------------------------------------------------ probe
@dataclass(frozen=True)
class Placement(ChildEvent):
    """Parameters per device: device name -> {"parameters", "bytes", "trainable"} (counts, bytes)."""

    KIND: ClassVar[str] = "placement"
    devices: dict[str, dict[str, int]]


@dataclass(frozen=True)
class DeviceMap(ChildEvent):
    """device_map: which modules went to which device (device name -> module names, runs of layers joined)."""

    KIND: ClassVar[str] = "device_map"
    layers: dict[str, list[str]]


@dataclass(frozen=True)
class ProbeStep(ChildEvent):
    """Probe step ``step`` of ``total`` took ``seconds``; ``tracked``: it ran under the CPU's live-tensor tracker
    (measured for memory, slower for it; false in lines written before it was said)."""

    KIND: ClassVar[str] = "probe_step"
    step: int
    total: int
    seconds: float
    tracked: bool = False


@dataclass(frozen=True)
class Ledger(ChildEvent):
    """What the probe measured on one rank's device, in bytes (times in seconds, throughput in tokens/s).

    CUDA ledgers hold ``peak_allocated_bytes`` / ``peak_reserved_bytes`` (and ``per_device``: one dict per device of
    a device_map, with ``device``, ``weights_bytes``, ``peak_allocated_bytes``, ``peak_reserved_bytes``); CPU ones
    ``peak_tracked_tensor_bytes`` and ``tracked_method``. The local rank is the envelope's ``local_rank``.

    ``step_time_s`` and ``tokens_per_s`` are of the ``timed_steps`` (:func:`core.child.probe.step_timing`: untracked,
    after the warm-up step 1); ``step_times_s`` holds every step's seconds, ``tracked_steps`` the steps the CPU's
    tracker followed, ``tracked_step_time_s`` their time (lines written before they were kept lack the four)."""

    KIND: ClassVar[str] = "ledger"
    device: str
    host: str
    global_rank: int
    world_size: int
    node_rank: int
    weights_bytes: int
    weights_loaded_bytes: int
    gradients_bytes: int
    optimizer_states_bytes: int
    step_time_s: float
    tokens_per_s: float
    steps: int
    rss_start_bytes: int
    rss_after_load_bytes: int
    peak_rss_bytes: int
    wrapper: str
    torch_threads: int
    peak_allocated_bytes: int | None = _omit_if_none()
    peak_reserved_bytes: int | None = _omit_if_none()
    per_device: list[dict[str, Any]] | None = _omit_if_none()
    peak_tracked_tensor_bytes: int | None = _omit_if_none()
    tracked_method: str | None = _omit_if_none()
    #: QLoRA: the 4-bit weights as stored (packed weights and their quantisation constants)
    quantised_weights_bytes: int | None = _omit_if_none()
    step_times_s: list[float] | None = _omit_if_none()
    tracked_steps: list[int] | None = _omit_if_none()
    timed_steps: list[int] | None = _omit_if_none()
    tracked_step_time_s: float | None = _omit_if_none()


@dataclass(frozen=True)
class Ledgers(ChildEvent):
    """Rank 0's gathering of every rank's :class:`Ledger` (torch.distributed), in rank order: on several nodes the
    parent on node 0 sees them all."""

    KIND: ClassVar[str] = "ledgers"
    ledgers: list[Ledger] = field(metadata={"items": Ledger})


@dataclass(frozen=True)
class LinkCheck(ChildEvent):
    """Rank 0's measurement of the links between the ranks after the probe's steps (core/child/links.py): an
    all-reduce and an all-gather over every rank, and a one-way send between each ordered pair of members (the first
    rank of each node when there are several nodes, else every rank).

    ``collectives`` holds one dict per operation (``op``, ``ranks``, ``seconds``: the slowest rank's median time,
    ``algbw_gbps``, ``busbw_gbps``); ``pairs`` one per ordered pair (``from``, ``to``: indices into ``names``,
    ``seconds`` and ``busbw_gbps``: the slowest rank's median, ``best_seconds`` and ``best_busbw_gbps``: the slowest rank's
    fastest operation). Bandwidths are GB/s (10^9 bytes per second) as nccl-tests defines them."""

    KIND: ClassVar[str] = "links"
    backend: str
    bytes: int
    iterations: int
    members: Literal["node", "rank"]
    names: list[str]
    collectives: list[dict[str, Any]]
    pairs: list[dict[str, Any]]


# -------------------------------------------------------------------------------------------- train, evaluate
#: what an :class:`Evaluation`'s perplexity is, in words (the record's definition of the metric, command mode's too)
METRIC = (
    "token-weighted perplexity: exp(sum NLL / sum target tokens) over the held-out split, targets masked by attention mask"
)


@dataclass(frozen=True)
class Evaluation(ChildEvent):
    """A held-out evaluation: ``when`` "before" / "after" training; token-weighted perplexity, mean and summed
    negative log-likelihood (nats), tokens and blocks evaluated, seconds of forward passes, the metric in words, and
    ``correct``: the targets that are the argmax of their logits (next-token accuracy = correct / tokens; None in
    lines written before it was counted)."""

    KIND: ClassVar[str] = "evaluation"
    when: str
    perplexity: float
    mean_nll: float
    nll_sum: float
    tokens: int
    blocks: int
    seconds: float
    metric: str
    correct: int | None = None


@dataclass(frozen=True)
class EvalProgress(ChildEvent):
    """A held-out evaluation under way: ``when`` "before" / "after" training (or "" for the fixed weights), ``done``
    of ``total`` blocks evaluated. Written as the first batch ends and then at most once a second, for a screen to
    show a long evaluation moving."""

    KIND: ClassVar[str] = "eval_progress"
    when: str
    done: int
    total: int


@dataclass(frozen=True)
class Trainable(ChildEvent):
    """The trainable parameters: their names and how many scalars they hold."""

    KIND: ClassVar[str] = "trainable"
    names: list[str]
    parameters: int


@dataclass(frozen=True)
class Step(ChildEvent):
    """One optimizer step: global step, Trainer's fractional epoch, the learning rate applied (None without an
    optimizer), the loss (the micro-batches' losses as Trainer's ``training_step`` returns them, summed over the
    step; unrounded), the sample ids consumed, and the random generators' sha256 digests as the step started
    (generator -> digest)."""

    KIND: ClassVar[str] = "step"
    step: int
    epoch: float
    learning_rate: float | None
    loss: float
    sample_ids: list[int]
    rng: dict[str, str] | None = None


@dataclass(frozen=True)
class CheckpointSaved(ChildEvent):
    """Trainer saved ``checkpoint-<step>`` at ``path``."""

    KIND: ClassVar[str] = "checkpoint"
    step: int
    path: str


@dataclass(frozen=True)
class Trained(ChildEvent):
    """Training ended: seconds of ``trainer.train``, the global step reached, the output folder."""

    KIND: ClassVar[str] = "trained"
    seconds: float
    global_step: int
    output_dir: str


# ------------------------------------------------------------------------------------------------ resume check
@dataclass(frozen=True)
class KillPoint(ChildEvent):
    """The interrupted run holds at its kill point (:mod:`core.killpoints`) until the parent kills it: global step
    done, where (``step_begin`` | ``micro`` | ``step_end`` | ``save``), micro-batches done of the step's count."""

    KIND: ClassVar[str] = "kill_point"
    step: int
    where: str
    micro_done: int = 0
    micro_in_step: int = 1


@dataclass(frozen=True)
class RngRestored(ChildEvent):
    """Right after Trainer restored the generators from ``checkpoint``: their digests (generator -> sha256)."""

    KIND: ClassVar[str] = "rng_restored"
    digest: dict[str, str]
    checkpoint: str


@dataclass(frozen=True)
class ManifestChecked(ChildEvent):
    """The resumed process verified the checkpoint against the sha256 manifest ``when`` (``before_load`` |
    ``after_load``): ``files`` in the manifest, ``bad`` the ones that changed."""

    KIND: ClassVar[str] = "manifest"
    when: str
    files: int
    bad: list[str]


#: every kind the child writes -> its class
KINDS: dict[str, type[ChildEvent]] = {cls.KIND: cls for cls in (
    Started, DeviceUuid, ModelBuilt, DataInfo, ChildError, Placement, DeviceMap, ProbeStep, Ledger, Ledgers, LinkCheck,
    Evaluation, EvalProgress, Trainable, Step, CheckpointSaved, Trained, KillPoint, RngRestored, ManifestChecked)}

#: events that report their place under torchrun in the payload (the local rank written after the global rank)
_RANK_INFO = (Started, Ledger)


# ------------------------------------------------------------------------------------------------- to and from
def payload(event: ChildEvent) -> dict[str, Any]:
    """The keys of ``event`` a line holds besides ``kind``, ``t`` and the writer's ``rank`` / ``local_rank``: its
    fields in order (a :class:`Started` or :class:`Ledger` with ``local_rank`` after ``global_rank``; keys without a
    value that the child leaves out are left out)."""
    out: dict[str, Any] = {}
    for f in fields(event):
        if f.name in ENVELOPE:
            continue
        value = getattr(event, f.name)
        if value is None and f.metadata.get("omit_if_none"):
            continue
        out[f.name] = [payload(v) for v in value] if f.metadata.get("items") else value
        if f.name == "global_rank" and isinstance(event, _RANK_INFO):
            out["local_rank"] = event.local_rank if event.local_rank is not None else 0
    return out


def as_dict(event: ChildEvent) -> dict[str, Any]:
    """The line's keys without ``kind`` and ``t``: :func:`payload` with ``rank`` / ``local_rank`` when the writer
    added them (what a record keeps of an event, e.g. the data split's facts)."""
    out = payload(event)
    if event.rank is not None:
        out["rank"] = event.rank
    if event.local_rank is not None:
        out["local_rank"] = event.local_rank
    return out


def parse_event(record: Any) -> ChildEvent:
    """The typed event of one decoded line (a dict with ``kind``).

    Raises:
        EventFormatError: not a dict, an unknown kind, a missing or unexpected key, a value of the wrong type.
    """
    if not isinstance(record, dict):
        raise EventFormatError(f"an event line must be a JSON object, got {type(record).__name__}")
    kind = record.get("kind")
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise EventFormatError(f"unknown event kind {kind!r}; the child writes {', '.join(sorted(KINDS))}")
    return _build(cls, {k: v for k, v in record.items() if k != "kind"})


def parse_line(line: str) -> ChildEvent:
    """:func:`parse_event` of one JSON line.

    Raises:
        EventFormatError: the line is not JSON, or not an event (:func:`parse_event`).
    """
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise EventFormatError(f"an event line that is not JSON ({exc}): {line[:120]!r}") from None
    return parse_event(record)


def _build(cls: type[ChildEvent], data: dict[str, Any]) -> ChildEvent:
    known = {f.name: f for f in fields(cls)}
    extra = sorted(set(data) - set(known))
    if extra:
        raise EventFormatError(f"{cls.KIND} event: unexpected key(s) {', '.join(extra)}")
    missing = [n for n, f in known.items() if n not in data and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise EventFormatError(f"{cls.KIND} event: missing key(s) {', '.join(missing)}")
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for name, value in data.items():
        items = known[name].metadata.get("items")
        if items is not None and isinstance(value, list):
            value = [_build(items, v) if isinstance(v, dict) else v for v in value]
        if not value_is(value, hints[name]):
            raise EventFormatError(f"{cls.KIND} event: {name} = {value!r:.80} is not {type_words(hints[name])}")
        values[name] = value
    return cls(**values)


def value_is(value: Any, hint: Any) -> bool:
    """``value`` is of the annotated type (an event's field, a child job's): unions and Literal arms, ``int`` (no bool), ``float`` (an int too), a
    ``list[X]`` item by item, a ``dict`` by its own type."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(value_is(value, arm) for arm in typing.get_args(hint))
    if origin is Literal:
        return value in typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(value_is(v, item) for v in value)
    return isinstance(value, origin or hint)


def type_words(hint: Any) -> str:
    """A type in words as annotated: ``int``, ``str | None``, ``list[str]``, ``one of 'probe', 'train'``."""
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


# ------------------------------------------------------------------------------------------------- the file
def rank_events_path(path: Path, rank: int | None) -> Path:
    """The events file of one rank under torchrun: rank 0 (or a single process) writes ``path`` itself, rank r
    ``events.rank{r}.jsonl`` beside it, so ranks never interleave lines in one file."""
    if not rank:
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


class EventWriter:
    """Writes child events as JSON lines, flushed per event.

    Args:
        path: the events file; created (with parents) if missing, appended to otherwise.
    """

    def __init__(self, path: str | Path, rank: int | None = None, local_rank: int | None = None) -> None:
        self.path = rank_events_path(Path(path), rank)
        self.rank = rank
        self.local_rank = local_rank
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the writer

    def write(self, event: ChildEvent) -> None:
        """Append one typed child event as ``{"kind": KIND, "t": time, **payload}`` (:func:`payload`;
        with ``rank`` / ``local_rank`` under torchrun) and flush it."""
        self.emit(event.KIND, **payload(event))

    def emit(self, kind: str, **data: Any) -> None:
        """Append one event ``{"kind": kind, "t": time, **data}`` (with ``rank`` under torchrun) and flush it: the
        pipeline's own log of its events; a child writes typed events with :meth:`write`."""
        record = {"kind": kind, "t": time.time(), **data}
        if self.rank is not None:
            record["rank"] = self.rank
        if self.local_rank is not None:
            record["local_rank"] = self.local_rank
        self._fh.write(json.dumps(record, default=_jsonable) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def complete_lines(path: str | Path, offset: int, keepends: bool = False) -> tuple[list[bytes], int]:
    """The complete lines of ``path`` from byte ``offset`` (a trailing partial line is left for the next read: a
    writer may be half-way through it), and the offset after them; ([], offset) when the file is missing or holds no
    new complete line."""
    p = Path(path)
    if not p.is_file():
        return [], offset
    with open(p, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    return data[: end + 1].splitlines(keepends=keepends), offset + end + 1


def read_events(path: str | Path, offset: int = 0) -> tuple[list[ChildEvent], int]:
    """Read the complete lines of a child's events file from byte ``offset``, each parsed once into its typed event
    (:func:`parse_line`).

    Returns:
        (events, new_offset): a trailing partial line is left for the next call.

    Raises:
        EventFormatError: a line that is no child event (not JSON, an unknown kind, keys or types that do not
            match); the message names the file and the line's byte offset.
    """
    p = Path(path)
    lines, new_offset = complete_lines(p, offset, keepends=True)
    events: list[ChildEvent] = []
    at = offset
    for raw in lines:
        line = raw.decode("utf-8")
        if line.strip():
            try:
                events.append(parse_line(line))
            except EventFormatError as exc:
                raise EventFormatError(f"{p} at byte {at}: {exc}") from None
        at += len(raw)
    return events, new_offset
