"""The probe's steps in the child: ``probe_steps`` real steps, measured, reported as one ledger per rank.

Read in order: :func:`probe` reports where the parameters are (:func:`report_placement`), runs the steps the spec asks
for (:func:`trainer_steps` with Trainer and a measuring callback, :func:`inference_steps` under ``torch.no_grad``, or
:func:`fsdp2_cpu_steps` for zero3 on CPU ranks), then writes the :class:`~core.protocol.events.Ledger`
(:func:`measured_ledger`) and, under torchrun, measures the links between the ranks (core/child/links.py) and rank 0
gathers every rank's ledger (:func:`gather_ledgers`). What a step saw
is kept in :class:`Seen`.

Memory and speed are measured on different steps (:data:`TRACKED_STEPS`): on the CPU the live-tensor tracker (a
TorchDispatchMode: Python code at every op) slows a step several times over, so only the first steps run under it, and
the step time is the mean of the untracked steps after them (:func:`step_timing`); the first step (the warm-up: one-off
allocations, the optimizer's states created) is never timed when another ran. On CUDA no step is tracked (the
allocator's own counters are read), so every step after the first is timed.
"""

from __future__ import annotations

import os
import resource
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.child.links import measure_links
from core.child.recipe import build_trainer, collate
from core.protocol.events import DeviceMap, EventWriter, Ledger, Ledgers, Placement, ProbeStep
from core.protocol.job import WorkerJob
from core.spec import RunSpec

#: The probe's steps that run under the CPU's live-tensor tracker (the first ones): step 1, the warm-up, which creates
#: the optimizer's states inside its optimizer step, and step 2, the first that starts with them alive (the steady
#: step's peak: weights, optimizer states, gradients and activations at once; every later step is the same shape).
#: The steps after them run untracked and are the ones timed; ``probe_steps`` counts all of them.
TRACKED_STEPS = 2


@dataclass
class Seen:
    """What the probe's steps saw: the CPU's live-tensor tracker (None on CUDA: the allocator's peaks are read), the
    largest gradient bytes at an optimizer step, the optimizer-state bytes after the last step, each step's seconds,
    and the steps that ran under the tracker."""

    tracker: Any = None
    gradients: int = 0
    optimizer_states: int = 0
    step_times: list[float] = field(default_factory=list)
    tracked_steps: list[int] = field(default_factory=list)

    def tracks(self, step: int) -> bool:
        """Whether step ``step`` (1-based) runs under the tracker: the first :data:`TRACKED_STEPS` on the CPU."""
        return self.tracker is not None and step <= TRACKED_STEPS

    def step_done(self, seconds: float, step: int, total: int, events: EventWriter, tracked: bool = False) -> None:
        """Keep a step's time and report it (``probe_step``, saying whether the tracker followed it)."""
        self.step_times.append(seconds)
        if tracked:
            self.tracked_steps.append(step)
        events.write(ProbeStep(step=step, total=total, seconds=seconds, tracked=tracked))


def probe(spec: RunSpec, model: Any, blocks: list[dict[str, Any]], out_dir: Path, device: str, events: EventWriter,
          job: WorkerJob, rss_start: int, name: str | None = None) -> None:
    """Run ``probe_steps`` real steps and emit the placement and the measured ledger (``ledger`` event).

    Training modes run Trainer steps (its own optimizer and schedule) with a callback that counts gradients at the
    optimizer step and optimizer states after it from the live tensors; inference runs forward passes under
    ``torch.no_grad`` (not ``inference_mode``: under it a composite op such as ``cross_entropy_loss`` reaches the CPU
    tracker whole, and the ``log_softmax`` it allocates inside is not seen; the bytes are the same). On CUDA the
    allocator's peak allocated and reserved are read; on CPU a
    :class:`~core.child.measure.LiveTensorTracker` follows the step's tensors. With ``padding = padded`` every block's last
    position is padding (:func:`padded_blocks`): each step is one of a batch holding padding, as the plan counts.
    """
    import torch

    from core.child.measure import LiveTensorTracker

    if spec.padding == "padded":
        blocks = padded_blocks(blocks)
    names = job.devices or [name or device]
    placement, hf_map = report_placement(spec, model, device, name, names, job, events)
    weights = sum(d["bytes"] for d in placement.values())
    rss_loaded = rss_bytes()
    is_cuda = device.startswith("cuda")
    if is_cuda:
        torch.cuda.synchronize()
        for i in range(torch.cuda.device_count()):  # device_map: every device the model is on
            torch.cuda.reset_peak_memory_stats(i)
    seen = Seen(tracker=None if is_cuda else LiveTensorTracker(baseline_bytes=weights))
    if spec.training and spec.strategy == "zero3" and not is_cuda and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        wrapper, local_weights = fsdp2_cpu_steps(spec, model, blocks, seen, events, name or device)
    elif spec.training:
        wrapper, local_weights = trainer_steps(spec, model, blocks, out_dir, device, events, job, seen, weights)
    else:
        inference_steps(spec, model, blocks, device, events, seen)
        wrapper, local_weights = "none (inference, one process)", weights
    ledger = measured_ledger(spec, seen, device, name, weights, local_weights, wrapper, rss_start, rss_loaded)
    quantised = [d["quantised_bytes"] for d in placement.values() if "quantised_bytes" in d]
    if quantised:
        ledger["quantised_weights_bytes"] = sum(quantised)
    if hf_map is not None and is_cuda:  # one process, several devices: a peak on each
        ledger["per_device"] = [
            {"device": n, "weights_bytes": placement.get(n, {}).get("bytes", 0),
             "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(i)),
             "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(i))}
            for i, n in enumerate(names)]
    event = Ledger(**ledger)
    events.write(event)
    measure_links(events, name or device)  # after the peaks were read: its buffers are not the step's
    gather_ledgers(event, events)


def report_placement(spec: RunSpec, model: Any, device: str, name: str | None, names: list[str],
                     job: WorkerJob, events: EventWriter) -> tuple[dict[str, dict[str, int]], Any]:
    """Emit where the parameters are (``placement``: device name -> parameters, bytes, trainable) and, for a device
    map, which modules went where (``device_map``). Returns (placement, accelerate's device map or None)."""
    from core.child.measure import parameter_placement

    # accelerate sets hf_device_map only for a map over several devices; a one-device map is the whole model there
    hf_map = getattr(model, "hf_device_map", None) or (
        {"": device} if job.device_map or spec.strategy == "device_map" else None)
    if hf_map is not None:  # device_map: torch's cuda:i is the i-th device named (CUDA_VISIBLE_DEVICES)
        rename = {f"cuda:{i}": n for i, n in enumerate(names) if n.startswith("cuda")}
        if not rename:
            rename = {"cpu": names[0]}
    else:
        rename = {device: name} if name else {}
    placement = {rename.get(k, k): v for k, v in parameter_placement(model).items()}
    events.write(Placement(devices=placement))
    if hf_map is not None:
        events.write(DeviceMap(layers=layer_placement(hf_map, rename)))
    return placement, hf_map


def trainer_steps(spec: RunSpec, model: Any, blocks: list[dict[str, Any]], out_dir: Path, device: str,
                  events: EventWriter, job: WorkerJob, seen: Seen, weights: int) -> tuple[str, int]:
    """``probe_steps`` Trainer steps (no checkpoints) with a callback that measures each: the tracker restarted from
    the live tensors as each of the first :data:`TRACKED_STEPS` starts (:meth:`Seen.tracks`), gradients at the
    optimizer step, optimizer states after it, the seconds of each step.

    Returns:
        (wrapper, local weight bytes): the class Trainer actually wrapped the model in (it may fall back: FSDP asked
        for on the CPU runs as DDP) and this rank's share of the weights after wrapping (FSDP keeps a shard)."""
    import torch
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

    from core.child.measure import optimizer_state_bytes

    is_cuda = device.startswith("cuda")
    tracker, n = seen.tracker, spec.probe_steps
    if tracker is not None and (spec.optimizer_kind.needs_bitsandbytes or spec.method.quantised):
        from core.child.measure import expose_bitsandbytes_cpu_kernels

        # the step's fp32 copies, and a 4-bit layer's dequantised weight, are made inside bitsandbytes' ops
        expose_bitsandbytes_cpu_kernels()

    class ProbeCallback(TrainerCallback):
        def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                          model: Any = None, optimizer: Any = None, **kw: Any) -> None:  # a torch module, optimizer
            self.tracked = tracker is not None and seen.tracks(state.global_step + 1)
            if self.tracked:  # what is alive as the step starts, counted once from the live tensors
                tracker.restart(weights + optimizer_state_bytes(optimizer) + gradient_bytes(model))
                tracker.__enter__()
            self.started = time.perf_counter()  # after the tracker's own counting: a tracked step's time is its ops'

        def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                                  model: Any = None, **kw: Any) -> None:
            seen.gradients = max(seen.gradients, gradient_bytes(model))

        def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                        optimizer: Any = None, **kw: Any) -> None:
            if is_cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - self.started
            if self.tracked:
                tracker.__exit__(None, None, None)
            seen.optimizer_states = optimizer_state_bytes(optimizer)
            seen.step_done(seconds, state.global_step, n, events, tracked=self.tracked)

    trainer = build_trainer(spec, model, blocks, out_dir, device, events, job, max_steps=n, save=False,
                            extra_callbacks=[ProbeCallback()])
    trainer.train()
    return type(trainer.model_wrapped).__name__, local_weight_bytes(trainer.model_wrapped)


def inference_steps(spec: RunSpec, model: Any, blocks: list[dict[str, Any]], device: str, events: EventWriter,
                    seen: Seen) -> None:
    """``probe_steps`` forward passes of one batch under ``torch.no_grad`` (see :func:`probe` for why not
    ``inference_mode``), the first :data:`TRACKED_STEPS` followed by the tracker on the CPU."""
    import torch

    tracker = seen.tracker
    batch = collate(blocks[: spec.batch_size])
    batch.pop("sample_ids")
    batch = {k: v.to(device) for k, v in batch.items()}
    model.eval()
    with torch.no_grad():  # not inference_mode: see probe's docstring
        for step in range(1, spec.probe_steps + 1):
            tracked = seen.tracks(step)
            started = time.perf_counter()
            if tracked:
                tracker.__enter__()
            try:
                out = model(**batch)
                del out
            finally:
                if tracked:
                    tracker.__exit__(None, None, None)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            seen.step_done(time.perf_counter() - started, step, spec.probe_steps, events, tracked=tracked)


def measured_ledger(spec: RunSpec, seen: Seen, device: str, name: str | None, weights: int, local_weights: int,
                    wrapper: str, rss_start: int, rss_loaded: int) -> dict[str, Any]:
    """The ledger's fields (:class:`~core.protocol.events.Ledger`) from what the steps saw: bytes per component, the
    step time (seconds) and tokens per second of the timed steps (:func:`step_timing`: untracked, without the first),
    each step's seconds and which ran tracked, the process's RSS, and the peak: the allocator's on CUDA, the tracked
    live tensors' on the CPU (the steps the tracker followed; the process's peak RSS covers every step)."""
    import torch

    timing = step_timing(seen.step_times, seen.tracked_steps)
    step_s = timing["step_time_s"]
    tokens = spec.batch_size * spec.seq_len * (spec.grad_accum if spec.training else 1)
    ledger: dict[str, Any] = {
        "device": name or device,
        "host": socket.gethostname(),
        **rank_info(),
        "weights_bytes": local_weights,
        "weights_loaded_bytes": weights,
        "gradients_bytes": seen.gradients,
        "optimizer_states_bytes": seen.optimizer_states,
        "step_time_s": step_s,
        "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
        "steps": spec.probe_steps,
        "step_times_s": list(seen.step_times),
        "tracked_steps": list(seen.tracked_steps),
        "timed_steps": timing["timed_steps"],
        **({"tracked_step_time_s": timing["tracked_step_time_s"]} if timing["tracked_step_time_s"] is not None
           else {}),
        "rss_start_bytes": rss_start,
        "rss_after_load_bytes": rss_loaded,
        "peak_rss_bytes": peak_rss_bytes(),
        "wrapper": wrapper,
        "torch_threads": torch.get_num_threads(),  # torchrun sets OMP_NUM_THREADS=1 per rank unless it is set
    }
    if device.startswith("cuda"):
        ledger["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
        ledger["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
    else:
        assert seen.tracker is not None  # no CUDA: the CPU tracker followed the step
        ledger["peak_tracked_tensor_bytes"] = seen.tracker.peak_bytes
        ledger["tracked_method"] = (f"{seen.tracker.method}; in step{'s' * (len(seen.tracked_steps) > 1)} "
                                    f"{', '.join(map(str, seen.tracked_steps))} (the later steps, the same shape, "
                                    "ran untracked to be timed)" if len(seen.step_times) > len(seen.tracked_steps)
                                    else seen.tracker.method)
    return ledger


def step_timing(step_times: list[float], tracked_steps: list[int]) -> dict[str, Any]:
    """Which of the probe's steps its speed is the mean of, and that mean (seconds per step).

    The timed steps are the untracked ones after step 1 (the warm-up: one-off allocations, kernel choices, the
    optimizer's states created); when none ran untracked after it (on the CPU with ``probe_steps`` <=
    :data:`TRACKED_STEPS`) the tracked ones after it, and a single step is timed by itself. Steps are 1-based.

    Returns:
        ``timed_steps``, ``step_time_s`` (their mean; 0.0 without a step), ``tracked_step_time_s`` (the mean of the
        tracked steps after the warm-up, or of the warm-up when it was the only one tracked; None when no step was
        tracked).
    """
    def mean(steps: list[int]) -> float:
        return sum(step_times[s - 1] for s in steps) / len(steps) if steps else 0.0

    steps = list(range(1, len(step_times) + 1))
    after_warmup = steps[1:] or steps
    timed = [s for s in after_warmup if s not in tracked_steps] or after_warmup
    tracked = [s for s in after_warmup if s in tracked_steps] or [s for s in steps if s in tracked_steps]
    return {"timed_steps": timed, "step_time_s": mean(timed), "tracked_step_time_s": mean(tracked) if tracked else None}


def padded_blocks(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The probe's blocks with padding = padded: each block's last position made padding (attention mask 0, no target),
    so every probe step takes the path a batch holding padding takes (the attention kernel gets a mask), the largest
    step of the run, which the plan counts; the training run itself meets it in the batches that hold the data's
    padded block."""
    out = []
    for block in blocks:
        mask = list(block["attention_mask"])
        mask[-1] = 0
        out.append({**block, "attention_mask": mask})
    return out


def fsdp2_cpu_steps(spec: RunSpec, model: Any, blocks: list[dict[str, Any]], seen: Seen, events: EventWriter,
                    name: str) -> tuple[str, int]:
    """zero3 (FSDP full shard) on the CPU: ``probe_steps`` steps under torch's FSDP2 over gloo, outside Trainer.

    accelerate enables FSDP only on accelerators, so Trainer on the CPU runs DDP instead; to measure the sharding the
    plan divides by N, the probe shards the model itself with ``torch.distributed.fsdp.fully_shard`` (each decoder
    layer, ``_no_split_modules``, then the root, as Trainer's transformer-based wrap does) and runs the spec's
    optimizer over this rank's shard: rank r takes blocks r, r + N, ... (as a DistributedSampler without shuffling).
    Measured as the Trainer path is: gradients before the optimizer step, optimizer states after it, live tensors
    (local shards) in the first :data:`TRACKED_STEPS` steps.

    This path runs the whole loop in one function on purpose (about 75 lines): the sharding, the optimizer and the
    steps are one recipe, read top to bottom as FSDP2's own examples are.

    Returns:
        (wrapper, local weight bytes): the sharded model's class (``FSDP<name>``) with how it was run, and this rank's
        share of the weights.

    Raises:
        SpecError: optimizer adafactor (this path runs torch's AdamW and SGD only).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from core.child.measure import optimizer_state_bytes, tensor_bytes
    from core.errors import SpecError

    if not spec.optimizer_kind.traceable:
        raise SpecError("optimizer", f"the CPU zero3 probe (FSDP2 outside Trainer) runs torch's own optimizers, not "
                                     f"{spec.optimizer}; choose one of them, or probe zero3 on CUDA devices")
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    unit_names = set(getattr(base, "_no_split_modules", None) or [])
    for module in [m for m in model.modules() if type(m).__name__ in unit_names]:
        fully_shard(module)
    fully_shard(model)
    from core.child.measure import parameter_placement

    placed = parameter_placement(model)  # after sharding: this rank's shard of each parameter, on the CPU
    events.write(Placement(devices={name: placed["cpu"]}))
    params = [p for p in model.parameters() if p.requires_grad]
    opt: torch.optim.Optimizer = spec.optimizer_kind.build(params, spec.learning_rate, False)
    local_weights = sum(tensor_bytes(p) for p in model.parameters())
    mine = blocks[rank::world] or blocks
    model.train()
    i = 0
    for step in range(1, spec.probe_steps + 1):
        tracker = seen.tracker
        assert tracker is not None  # the CPU: live tensors are tracked
        tracked = seen.tracks(step)
        if tracked:
            tracker.restart(local_weights + optimizer_state_bytes(opt) + gradient_bytes(model))
            tracker.__enter__()
        started = time.perf_counter()
        try:
            for _ in range(spec.grad_accum):
                batch = collate([mine[(i + j) % len(mine)] for j in range(spec.batch_size)])
                i += spec.batch_size
                batch.pop("sample_ids")
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.autocast and spec.dtype == "bf16"):
                    loss = model(**batch).loss / spec.grad_accum
                loss.backward()
                del loss
            grads = sum(tensor_bytes(p.grad) for p in params if p.grad is not None)
            seen.gradients = max(seen.gradients, grads)
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            seconds = time.perf_counter() - started
            if tracked:
                tracker.__exit__(None, None, None)
        seen.optimizer_states = optimizer_state_bytes(opt)
        seen.step_done(seconds, step, spec.probe_steps, events, tracked=tracked)
    units = "/".join(sorted(unit_names)) or "no decoder layer class"
    wrapper = (f"{type(model).__name__} (torch FSDP2 fully_shard over gloo: each {units} and the root; outside "
               "Trainer, which runs FSDP only on accelerators)")
    return wrapper, local_weights


def layer_placement(hf_device_map: dict[str, Any], rename: dict[str, str]) -> dict[str, list[str]]:
    """Which modules went to which device, from accelerate's ``model.hf_device_map`` (module name -> device), in
    model order, runs of consecutive decoder layers joined: ``{"cuda:0": ["model.embed_tokens",
    "model.layers.0-11"], "cuda:1": ["model.layers.12-23", "model.norm", "lm_head"]}``. Integer devices are CUDA
    indices of this process (``rename`` maps ``cuda:i`` to the name planned)."""
    import re

    out: dict[str, list[str]] = {}
    for module, where in hf_device_map.items():
        where = f"cuda:{where}" if isinstance(where, int) else str(where)
        where = rename.get(where, where)
        items = out.setdefault(where, [])
        m = re.fullmatch(r"(.*\.)(\d+)", module)
        last = re.fullmatch(r"(.*\.)(\d+)(?:-(\d+))?", items[-1]) if items else None
        if m and last and last.group(1) == m.group(1) and int(last.group(3) or last.group(2)) + 1 == int(m.group(2)):
            items[-1] = f"{last.group(1)}{last.group(2)}-{m.group(2)}"
        else:
            items.append(module or "(the whole model)")
    return out


def gather_ledgers(ledger: Ledger, events: EventWriter) -> None:
    """Under torchrun, rank 0 gathers every rank's ledger (``torch.distributed.all_gather_object`` of its payload, over
    the run's own process group) and emits them as one ``ledgers`` event: on several nodes the parent on node 0 sees
    the ledgers of every node, not only the files written on its own disk."""
    import torch.distributed as dist

    from core.protocol.events import payload

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, payload(ledger))
    if dist.get_rank() == 0:
        events.write(Ledgers(ledgers=[Ledger(**d) for d in gathered]))


def rank_info() -> dict[str, int]:
    """This process's place under torchrun (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``GROUP_RANK`` = the node's
    rank, from torch.distributed.run's environment); a single process is rank 0 of 1."""
    env = os.environ
    return {"global_rank": int(env.get("RANK", 0)), "local_rank": int(env.get("LOCAL_RANK", 0)),
            "world_size": int(env.get("WORLD_SIZE", 1)), "node_rank": int(env.get("GROUP_RANK", 0))}


def gradient_bytes(model: Any) -> int:
    """Bytes of the gradients ``model``'s parameters hold now (this rank's shards under FSDP2)."""
    from core.child.measure import tensor_bytes

    return sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)


def local_bytes(t: Any) -> int:
    """Bytes of ``t`` held by this process: a DTensor's local shard (FSDP2), else the whole tensor."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.numel() * local.element_size())  # a torch tensor's (Any here): already an int


def local_weight_bytes(model: Any) -> int:
    """Bytes of ``model``'s parameters held by this process (:func:`local_bytes`), each once, with the quantisation
    constants of its 4-bit weights (QLoRA)."""
    from core.child.measure import quant_state_bytes

    seen: set[int] = set()
    return sum(local_bytes(p) + (quant_state_bytes(p.quant_state, seen) if getattr(p, "quant_state", None) is not None
                                 else 0) for p in model.parameters())


def rss_bytes() -> int:
    """This process's resident memory now, in bytes."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """This process's peak resident memory, in bytes (Linux reports ru_maxrss in KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
