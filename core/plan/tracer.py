"""The traced plan's trace itself: one training step of the spec's model under torch's FakeTensorMode and MemTracker
(:func:`trace_plan`), each allocation's category summed into the plan's components per phase, and the caching
allocator's reserved bytes predicted from the events (core/plan/allocator.py). It runs in a child process
(``python -m core.plan.tracer``, started by :func:`core.plan.traced.trace_in_child`) or in-process
(:func:`trace_against`, benchmarks and tests); the types it gives and the comparison with the analytic plan are in
core/plan/traced.py."""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any

from core.dtypes import torch_dtype_name
from core.plan.phases import PHASES
from core.plan.traced import (
    TRACED_COMPONENTS,
    PlanDifference,
    TracedPlan,
    compare,
    config_from_json,
    predict_reserved,
    untraceable_reason,
    workspaces_of,
)
from core.spec import RunSpec

_CATEGORY_TO_COMPONENT = {
    "PARAM": "weights",
    "GRAD": "gradients",
    "OPT": "optimizer_states",
    "ACT": "activations",
    "TEMP": "temporaries",
    "BUFFER": "temporaries",
    "OTH": "temporaries",
}


def trace_plan(spec: RunSpec, config: Any, *, target: str = "cuda", fast: bool = True, real: bool = False,
               workspaces: tuple[int, ...] = (), workspace_method: str = "") -> TracedPlan:
    """Trace one steady-state step of ``spec`` on ``config`` (see the module docstring for what the step is).

    Args:
        spec: the run (mode, dtype, batch_size x seq_len micro-batch, grad_accum, optimizer, gradient_checkpointing,
            LoRA settings). The trace is of one device holding the whole step (strategy single; a DDP replica).
        config: the model's ``transformers.PretrainedConfig``.
        target: ``"cuda"`` or ``"cpu"``: the device the plan is for; it decides the optimizer's ``foreach`` as torch
            would (the trace itself always runs on CPU tensors: fake CUDA tensors abort the CPU build in autograd).
        fast: keep only the overall peak (about 10x faster on deep models) instead of MemTracker's per-module stats.
        real: real CPU tensors with random values instead of fake ones (memory for real: tiny models only).
        workspaces: cuBLAS's workspace blocks on the target device (bytes each, :func:`core.plan.workspace.
            cublas_workspaces`), allocated through the caching allocator at the first matmul and kept: added to the
            allocator's replay before the first step (``workspace_method`` says how they were sized).

    Returns:
        a :class:`TracedPlan`.

    Raises:
        SpecError: the config is not a causal LM (from :func:`core.plan.meta.build_meta_model`).
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from core.plan.meta import build_meta_model
    from core.plan.recorder import allocation_recorder

    started = time.perf_counter()
    model = build_meta_model(config, spec.mode, spec.lora if spec.adapters else None, spec.param_dtype,
                             traced_attention(spec))
    fake_mode = None if real else FakeTensorMode()
    context = fake_mode if fake_mode is not None else _Nothing()
    generator = torch.Generator().manual_seed(spec.seed)
    recorder = allocation_recorder()  # every storage's allocation and free, in order: the allocator's replay
    with context, warnings.catch_warnings(), _unpacked_blocks(), _dropout_as_on(target), recorder:
        warnings.simplefilter("ignore")
        _materialise(model, real, generator)
        _as_trained(spec, model, config)
        batch = _batch(spec, config, None if fake_mode else generator)
        recorder.events.extend(("alloc", f"cublas workspace {i}", n) for i, n in enumerate(workspaces))
        optimizer = _optimizer(spec, model, foreach=target == "cuda") if spec.training else None
        step = _step_fn(spec, model, batch, optimizer)
        if optimizer is not None:
            step()  # warm-up: creates the optimizer states, so the traced step is the steady state
            recorder.mark("step 1")
        tracker = _tracker(fast)
        tracker.track_external(model, *( [optimizer] if optimizer is not None else []))
        # phase -> MemTracker's categories at that phase's own peak (the largest over micro-batches)
        phases: dict[str, dict[str, int]] = {}

        def mark(phase: str) -> None:
            """End of a phase: keep its peak if above an earlier one of the same phase, then start the next."""
            categories = _categories(next(iter(tracker._peak_mem_snap.values()), {}))
            if sum(categories.values()) > sum(phases.get(phase, {}).values()):
                phases[phase] = categories
            tracker._peak_mem.clear()  # the next phase's peak starts from what is alive now
            tracker._peak_mem_snap.clear()

        with tracker:
            # reset_mod_stats between micro-batches: MemTracker refuses a second forward otherwise
            kv_bytes = step(between=tracker.reset_mod_stats, mark=mark)
        recorder.mark("step 2" if optimizer is not None else "forward")
    by_phase = _by_phase(spec, phases, kv_bytes)
    peak_phase = max(by_phase, key=lambda p: (sum(by_phase[p].values()), -PHASES.index(p)))
    components = by_phase[peak_phase]
    modules: dict[str, int] = {}
    if not fast:
        for stats in tracker.memory_tracking.values():
            modules[stats.mod_fqn] = max(stats.local_peak.values(), default=0)
    del model, optimizer
    return TracedPlan(
        components=components,
        peak_bytes=sum(components.values()),
        categories=phases[peak_phase],
        method=_method(spec, target, real, fast),
        seconds=time.perf_counter() - started,
        tensors="real" if real else "fake",
        modules=modules,
        phases=by_phase,
        reserved=predict_reserved(recorder.events, spec.alloc_conf or environment_alloc_conf(), sum(workspaces),
                                  workspace_method),
    )


def environment_alloc_conf() -> str:
    """The allocator configuration a run started from here inherits: ``PYTORCH_ALLOC_CONF``, else the older
    ``PYTORCH_CUDA_ALLOC_CONF`` (the order PyTorch reads them in, ``AllocatorConfig.cpp:14-34``)."""
    import os

    return os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")


def _as_trained(spec: RunSpec, model: Any, config: Any) -> None:
    """Put ``model`` in the state the worker runs it in: eval without gradients for inference; train without a KV
    cache for training, with gradient checkpointing (non-reentrant) when the spec asks for it."""
    if not spec.training:
        model.requires_grad_(False)
        model.eval()
    else:
        model.train()
        getattr(model, "config", config).use_cache = False  # as the worker: training runs without a KV cache
    if spec.training and spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if spec.adapters:
            model.enable_input_require_grads()


def _batch(spec: RunSpec, config: Any, generator: Any) -> dict[str, Any]:
    """One micro-batch of ``batch_size`` x ``seq_len`` token ids (labels the same ids), made under the caller's fake
    mode; ``generator``: None for fake tensors (no values), else the seeded generator of real ones.

    padded: a batch with padding, whose attention mask reaches the kernel (fake tensors have no values, so any mask is
    taken as one; on real tensors the last position of the first row is padding). packed: no mask, as transformers
    drops an all-ones one and runs causal attention."""
    import torch

    ids = torch.randint(0, int(config.vocab_size), (spec.batch_size, spec.seq_len), generator=generator)
    batch = {"input_ids": ids, "labels": ids}
    if spec.padding == "padded":
        mask = torch.ones_like(ids)
        if generator is not None:
            mask[0, -1] = 0
        batch["attention_mask"] = mask
    return batch


def _by_phase(spec: RunSpec, phases: dict[str, dict[str, int]], kv_bytes: int) -> dict[str, dict[str, int]]:
    """The plan's components at each traced phase's peak; the optimizer step's buffers that MemTracker files under OPT
    above the states alive in forward are temporaries, not states."""
    by_phase = {p: _components(spec, categories, kv_bytes) for p, categories in phases.items()}
    if "optimizer_step" in by_phase:  # MemTracker files the step's buffers under OPT: they are not states
        step = by_phase["optimizer_step"]
        extra = max(0, step["optimizer_states"] - by_phase["forward"]["optimizer_states"])
        step["optimizer_states"] -= extra
        step["temporaries"] += extra
    return by_phase


def _categories(snapshot: dict[Any, int]) -> dict[str, int]:
    """MemTracker's snapshot as category name -> bytes, without its total."""
    return {_category_name(k): int(v) for k, v in snapshot.items() if _category_name(k) != "Total"}


def _components(spec: RunSpec, categories: dict[str, int], kv_bytes: int) -> dict[str, int]:
    """MemTracker's categories mapped to the plan's components (:data:`_CATEGORY_TO_COMPONENT`); for inference the KV
    cache the forward returned (``kv_bytes``) is moved out of the activations."""
    components = dict.fromkeys(TRACED_COMPONENTS, 0)
    for name, value in categories.items():
        components[_CATEGORY_TO_COMPONENT.get(name, "temporaries")] += value
    if not spec.training and kv_bytes:
        moved = min(kv_bytes, components["activations"])
        components["kv_cache"] = moved
        components["activations"] -= moved
    return components


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


@contextlib.contextmanager
def _unpacked_blocks() -> Any:
    """Answer transformers' packed-sequence check as real tensors answer it for our blocks (one sequence per row).

    ``masking_utils.find_packed_sequence_indices`` reads the position ids' values; a fake tensor has none, so
    transformers would treat the batch as packed and build a b x s x s mask the real step never builds.
    """
    try:
        from transformers import masking_utils
    except ImportError:  # older transformers: nothing to answer
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def _dropout_as_on(target: str) -> Any:
    """Dropout as it runs on ``target``. On CUDA, ``F.dropout`` is the fused ``native_dropout``, which keeps a bool mask
    (1 B per element) for backward; on the CPU it multiplies by scaled noise in the input's dtype and keeps that (4 B
    for peft's fp32 adapter input). The trace runs CPU tensors, so for a CUDA target dropout is routed to
    ``torch.native_dropout`` (it runs on the CPU and keeps the bool mask, as CUDA's kernel does)."""
    import torch

    if target != "cuda":
        yield
        return
    functional = torch.nn.functional
    original = functional.dropout

    def dropout(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        if not training or p == 0.0:
            return input
        return torch.native_dropout(input, p, True)[0]

    functional.dropout = dropout
    try:
        yield
    finally:
        functional.dropout = original


def _category_name(key: Any) -> str:
    return getattr(key, "name", str(key))


def traced_attention(spec: RunSpec) -> str:
    """The attention implementation the trace runs: the spec's, but SDPA for ``flash_attention_2`` (no flash kernel
    on the CPU; both are fused kernels that save q, k, v, the output and a log-sum-exp per row, not the scores)."""
    return "sdpa" if spec.attn_implementation == "flash_attention_2" else spec.attn_implementation


def _method(spec: RunSpec, target: str, real: bool, fast: bool) -> str:
    if spec.param_dtype != spec.dtype:
        precision = f"amp: fp32 weights, autocast to {spec.dtype}"
    elif spec.autocast:
        precision = f"pure {spec.dtype}: weights in {spec.dtype}" + (", LoRA adapters fp32" if spec.adapters else "") + \
            f", autocast to {spec.dtype}"
    else:
        precision = spec.param_dtype
    attention = traced_attention(spec)
    if attention != spec.attn_implementation:
        precision += f", {attention} attention for {spec.attn_implementation} (no flash kernel on the CPU)"
    else:
        precision += f", {attention} attention"
    what = "one forward under no_grad (KV cache from the config)" if not spec.training else (
        f"one steady-state step after a warm-up step ({spec.optimizer}, foreach={'True' if target == 'cuda' else 'False'}"
        f" as torch picks it on {target}"
        + (", two micro-batches for gradient accumulation" if spec.grad_accum > 1 else "")
        + (", gradient checkpointing" if spec.gradient_checkpointing else "") + ")")
    return (f"torch MemTracker over {what} on {'real' if real else 'fake'} CPU tensors, {precision}, micro-batch "
            f"{spec.batch_size} x {spec.seq_len}; peak of tensor bytes ({'overall peak only' if fast else 'with per-module stats'});"
            " CPU kernel shapes, no allocator rounding: an estimate of peak allocated, not reserved")


def _materialise(model: Any, real: bool, generator: Any) -> None:
    """Swap every meta parameter and buffer for a CPU tensor (fake under the active FakeTensorMode), tied ones tied."""
    import torch

    def parameter(p: Any) -> Any:
        data = torch.empty(p.shape, dtype=p.dtype, device="cpu")
        if real:
            data.normal_(0.0, 0.02, generator=generator)
        return torch.nn.Parameter(data, requires_grad=p.requires_grad)

    def buffer(b: Any) -> Any:
        data = torch.empty(b.shape, dtype=b.dtype, device="cpu")
        return data.zero_() if real else data

    memo: dict[int, Any] = {}
    for module in model.modules():
        for table, make in ((module._parameters, parameter), (module._buffers, buffer)):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in memo:
                    memo[id(tensor)] = make(tensor)
                table[name] = memo[id(tensor)]


def _optimizer(spec: RunSpec, model: Any, foreach: bool) -> Any:
    """The optimizer as the optimizer object builds it (core/optim/; ``foreach``: torch's default on CUDA)."""
    return spec.optimizer_kind.build([p for p in model.parameters() if p.requires_grad], spec.learning_rate, foreach)


def _step_fn(spec: RunSpec, model: Any, batch: dict[str, Any], optimizer: Any) -> Any:
    """A function running one step; returns the KV cache bytes (inference) or 0. ``between`` runs between
    micro-batches; ``mark(phase)`` at the end of each phase (:data:`PHASES`)."""
    import torch

    autocast = spec.autocast
    dtype = getattr(torch, torch_dtype_name(spec.dtype))
    micro_batches = 2 if spec.grad_accum > 1 else 1

    def step(between: Any = None, mark: Any = None) -> int:
        mark = mark or (lambda phase: None)
        if optimizer is None:
            with torch.no_grad():
                out = model(**batch)
                kv = _cache_bytes(out["cache"] if "cache" in out else out.get("past_key_values"))
                del out
            mark("forward")
            return kv
        for i in range(micro_batches):
            if i and between is not None:
                between()
            with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                out = model(**batch)
            loss = out.loss / spec.grad_accum
            del out
            mark("forward")
            loss.backward()
            del loss
            mark("backward")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mark("optimizer_step")
        return 0

    return step


def _cache_bytes(cache: Any) -> int:
    """Bytes of the key/value tensors a forward returned (transformers' Cache or legacy tuples), each tensor once."""
    import torch

    if cache is None:
        return 0
    seen: set[int] = set()
    total = 0

    def visit(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            if id(obj) not in seen:  # keys and values are separate tensors with their own storages
                seen.add(id(obj))
                total += obj.untyped_storage().nbytes()
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item)
        elif hasattr(obj, "layers"):
            for layer in obj.layers:
                visit([getattr(layer, "keys", None), getattr(layer, "values", None)])
        elif hasattr(obj, "key_cache"):
            visit([obj.key_cache, obj.value_cache])

    visit(cache)
    return total


def _tracker(fast: bool) -> Any:
    """MemTracker with docs/architecture.md §6's adjustments: gradient hooks only on trainable parameters; ``fast`` keeps only the
    overall peak (no per-module snapshots)."""
    from torch.distributed._tools import mem_tracker as mt

    class Tracker(mt.MemTracker):
        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> tuple[int, int]:
            def grad_hook(grad: Any) -> None:
                self._update_and_maybe_create_winfos(grad, mt._MemRefType.GRAD)

            param_bytes = buffer_bytes = 0
            for param in module.parameters():
                param_bytes += sum(w.mem_consumed for w in self._update_and_maybe_create_winfos(param, mt._MemRefType.PARAM))
                if param.grad is not None:
                    self._update_and_maybe_create_winfos(param.grad, mt._MemRefType.GRAD)
                if install_grad_hooks and param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(grad_hook),
                        param.register_post_accumulate_grad_hook(lambda p: grad_hook(p.grad)),
                    )
            for buf in module.buffers():
                buffer_bytes += sum(w.mem_consumed for w in self._update_and_maybe_create_winfos(buf, mt._MemRefType.BUFFER))
            return param_bytes, buffer_bytes

    class FastTracker(Tracker):
        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[mt._TOTAL_KEY]:
                    self._peak_mem[dev] = snap[mt._TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            if module not in self.memory_tracking:  # params, buffers and gradient hooks, once; no snapshots
                self._track_module_params_and_buffers(module, install_grad_hooks=True)
                self.memory_tracking[module] = mt._ModMemStats(self._mod_tracker.get_known_fqn(module) or "")
            elif self._mod_tracker.is_bw and self._ac_mod is None:
                self._ac_mod = __import__("weakref").ref(module)
                self._in_ac = True

        def _post_fw_hook(self, module: Any, inputs: Any, outputs: Any) -> None:
            if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod = None
                self._in_ac = False

        def _pre_bw_hook(self, module: Any, args: Any) -> None:
            return None

        def _post_bw_hook(self, module: Any, args: Any) -> None:
            return None

    return FastTracker() if fast else Tracker()


def trace_against(spec: RunSpec, config: Any, plan: Any, *, fast: bool = True) -> tuple[TracedPlan, PlanDifference]:
    """Trace ``spec`` and compare it with the first device of the analytic ``plan`` (:class:`core.plan.memory.MemoryPlan`).

    The target device (``foreach`` of the optimizer) is the plan's first device kind.

    Raises:
        SpecError: the strategy shards or splits the model (zero1/2/3, device_map, tp): the traced plan covers one
            device holding the whole step; those are planned analytically only.
    """
    from core.errors import SpecError

    reason = untraceable_reason(plan, spec)
    if reason is not None:
        beyond = spec.beyond_own_recipe() if spec.training else None
        field = ("mode" if spec.method.quantised else
                 "optimizer" if spec.training and not spec.optimizer_kind.traceable else
                 beyond[0] if beyond is not None else "strategy")
        raise SpecError(field, reason)
    device = plan.devices[0]
    blocks, how = workspaces_of(spec, device.device, config)
    traced = trace_plan(spec, config, target=device.device.kind, fast=fast, workspaces=blocks, workspace_method=how)
    return traced, compare(device, traced)


def main(argv: list[str]) -> int:
    """``python -m core.plan.tracer SPEC.json --config CONFIG.json --target cuda|cpu --out TRACED.json [--orphan-cleanup
    DIR]``: trace the config :func:`trace_in_child` wrote (:func:`config_json`) and write the JSON; the process ends
    itself (removing DIR) when gpuaccept is gone (:mod:`core.protocol.lifeline`)."""
    import argparse
    import json
    import os

    parser = argparse.ArgumentParser(prog="python -m core.plan.tracer")
    parser.add_argument("spec")
    parser.add_argument("--config", required=True, help="the model's config, as config_json writes it")
    parser.add_argument("--target", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", required=True)
    parser.add_argument("--orphan-cleanup", help="a folder to remove if gpuaccept is gone before the trace ends")
    parser.add_argument("--workspace", type=int, action="append", default=[],
                        help="a cuBLAS workspace block on the target device, bytes (repeated)")
    parser.add_argument("--workspace-method", default="", help="how the workspaces were sized, in words")
    args = parser.parse_args(argv)
    from pathlib import Path

    from core.protocol.lifeline import exit_with_parent

    exit_with_parent(Path(args.orphan_cleanup) if args.orphan_cleanup else None)  # before torch's slow import
    with open(args.spec, encoding="utf-8") as fh:
        spec = RunSpec.from_dict(json.load(fh))
    with open(args.config, encoding="utf-8") as fh:
        config = config_from_json(json.load(fh))
    traced = trace_plan(spec, config, target=args.target, workspaces=tuple(args.workspace),
                        workspace_method=args.workspace_method)
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(traced.to_json(), fh)
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
