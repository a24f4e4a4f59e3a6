"""Measuring live tensors in the probe process (imports torch; used only in the child).

On CUDA the caching allocator reports peak allocated / reserved (``torch.cuda.max_memory_allocated``). The CPU has no such
counter, so :class:`LiveTensorTracker` follows every tensor storage created while it is active (a TorchDispatchMode, the
mechanism torch's own MemTracker uses) and keeps the peak of live bytes on top of a baseline of tensors that already exist.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds: a DTensor's local shard (FSDP2 ``fully_shard`` parameters, gradients and
    optimizer states), else ``t`` itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements held by this process (numel x element size; a DTensor's local shard), not of its
    whole storage."""
    t = local_tensor(t)
    return t.numel() * t.element_size()


def parameter_placement(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """Parameters and their bytes per device, counting each parameter once (tied weights share one entry).

    A 4-bit weight of bitsandbytes (``Params4bit``, QLoRA's base) counts the elements it stands for (its
    ``quant_state.shape``, not its packed bytes) and, in its bytes, the packed weight and the constants of its
    ``quant_state`` (:func:`quant_state_bytes`); ``quantised_bytes`` (only where there is one) is their sum.

    Returns:
        ``{"cpu": {"parameters": n, "bytes": b, "trainable": t}, "cuda:0": {...}}``.
    """
    out: dict[str, dict[str, int]] = {}
    seen: set[int] = set()
    constants: set[int] = set()
    for p in model.parameters():  # nn.Module.parameters() already yields a shared parameter once
        if id(p) in seen:
            continue
        seen.add(id(p))
        d = out.setdefault(str(p.device), {"parameters": 0, "bytes": 0, "trainable": 0})
        state = getattr(p, "quant_state", None)
        if state is not None:
            n = math.prod(state.shape)
            nbytes = tensor_bytes(p) + quant_state_bytes(state, constants)
            d["quantised_bytes"] = d.get("quantised_bytes", 0) + nbytes
        else:
            n = local_tensor(p).numel()  # a DTensor's local shard (FSDP2)
            nbytes = tensor_bytes(p)
        d["parameters"] += n
        d["bytes"] += nbytes
        if p.requires_grad:
            d["trainable"] += n
    return out


def quant_state_bytes(state: Any, seen: set[int] | None = None) -> int:
    """Bytes of the tensors of a bitsandbytes ``QuantState`` (absmax, code table; with double quantisation the
    second level's absmax, code and the offset), each tensor once across the calls sharing ``seen``."""
    seen = set() if seen is None else seen
    tensors = [state.absmax, state.code]
    if getattr(state, "nested", False):
        tensors += [state.state2.absmax, state.state2.code, state.offset]
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += tensor_bytes(t)
    return total


#: bitsandbytes' ops whose CPU kernels are Python bodies that make tensors inside: the optimizer steps
#: (``bitsandbytes/backends/cpu/ops.py``) and the 4-bit matmul, whose CPU kernel is the default one
#: (``backends/default/ops.py``: the weight dequantised to the compute dtype, then ``linear``)
BNB_CPU_KERNELS = {"optimizer_update_32bit": ("cpu", "_optimizer_update_32bit_cpu"),
                   "optimizer_update_8bit_blockwise": ("cpu", "_optimizer_update_8bit_blockwise_cpu"),
                   "gemm_4bit": ("default", "_gemm_4bit_default_impl")}


class _ExposedOp:
    """A bitsandbytes op whose CPU tensors run its kernel's Python body (CUDA tensors: the op itself); callable as the
    op packet and as its ``.default`` overload, as bitsandbytes calls it both ways."""

    _gpuaccept_exposed = True

    def __init__(self, op: Any, kernel: Any) -> None:
        self.op, self.kernel = op, kernel

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        on_cpu = all(a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor))
        return (self.kernel if on_cpu else self.op)(*args, **kwargs)

    @property
    def default(self) -> _ExposedOp:
        return self


def expose_bitsandbytes_cpu_kernels() -> bool:
    """Let :class:`LiveTensorTracker` see the tensors bitsandbytes' ops make on the CPU.

    bitsandbytes registers each CPU kernel as one custom op (``torch.ops.bitsandbytes.*``); a TorchDispatchMode sees
    the op but not the tensors its kernel makes inside: for 8-bit AdamW, the dequantised moments and fp32 copies (5 x
    4 B per element of the largest tensor, core/plan/quant.py); for a 4-bit layer's forward, its weight dequantised to
    the compute dtype. This puts each op's CPU kernel body in the op's place for CPU tensors (the same Python function
    with the same arguments, so the same numbers), and leaves CUDA tensors to the op. Returns False when bitsandbytes
    is not installed (nothing to expose).
    """
    try:
        from bitsandbytes.backends.cpu import ops as cpu_ops
        from bitsandbytes.backends.default import ops as default_ops
    except ImportError:
        return False
    modules = {"cpu": cpu_ops, "default": default_ops}
    namespace = torch.ops.bitsandbytes
    for op_name, (backend, kernel_name) in BNB_CPU_KERNELS.items():
        op = getattr(namespace, op_name)
        if getattr(op, "_gpuaccept_exposed", False):
            continue
        # the namespace resolves an op once and keeps it in its __dict__
        namespace.__dict__[op_name] = _ExposedOp(op, getattr(modules[backend], kernel_name))
    return True


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of every tensor held in ``optimizer.state`` (moments, momentum buffers, step counters), each tensor once:
    bitsandbytes' 8-bit optimizers put the same two dynamic maps (``qmap1``, ``qmap2``) in every parameter's state."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
    total = 0
    seen: set[int] = set()
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                total += tensor_bytes(value)
    return total


class LiveTensorTracker(TorchDispatchMode):
    """Peak bytes of live CPU tensor storages while active, above ``baseline_bytes``.

    Every op output's storage is counted once when created and released when its storage is freed (a weakref
    finalizer on the storage). Storages that existed before entering (weights, optimizer states) are not seen, so their
    bytes are passed as ``baseline_bytes``. A storage grown or shrunk in place with ``UntypedStorage.resize_`` (FSDP2
    re-allocates its unsharded parameters that way at every all-gather, and frees them with ``resize_(0)``; no op is
    dispatched for it) is followed by wrapping that method while the tracker is active.

    Attributes:
        peak_bytes: the largest ``baseline_bytes + live tracked bytes`` seen, in bytes.
    """

    method = (
        "peak of live CPU tensor storages: weights and optimizer states counted from the live tensors, plus every "
        "storage created during the step (TorchDispatchMode), released when freed"
    )

    def __init__(self, baseline_bytes: int = 0) -> None:
        # TorchDispatchMode.__init__ is untyped in torch; untyped_calls_exclude does not reach a call through super()
        super().__init__()  # type: ignore[no-untyped-call]
        self.baseline_bytes = baseline_bytes
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak_bytes = baseline_bytes

    def restart(self, baseline_bytes: int) -> None:
        """Start a new step: ``baseline_bytes`` are the tensors alive now (counted from the live objects: weights,
        optimizer states, gradients kept from the step before), and nothing tracked so far counts again (a storage
        created in an earlier step that is still alive is in the new baseline, never in both). The peak is kept."""
        self.live.clear()
        self.current = 0
        self.baseline_bytes = baseline_bytes
        self.peak_bytes = max(self.peak_bytes, baseline_bytes)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __enter__(self) -> LiveTensorTracker:
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:  # as torch's resize_: its result is untyped
            before = storage.nbytes()
            out = original(storage, size)
            tracker._resized(storage, storage.nbytes() - before)
            return out

        self._original_resize = original
        # patching the method while active is the point: FSDP2's resize_ dispatches no op the mode would see; torch
        # declares it on its private base class _StorageBase, hence "assignment" for a patch typed on UntypedStorage
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        # TorchDispatchMode.__enter__ is untyped in torch (it returns self); not reached by untyped_calls_exclude
        return cast(LiveTensorTracker, super().__enter__())  # type: ignore[no-untyped-call]

    def __exit__(self, *exc: object) -> bool | None:
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]  # restores the patch above
        # TorchDispatchMode.__exit__ is untyped in torch (it returns None); not reached by untyped_calls_exclude
        return cast("bool | None", super().__exit__(*exc))  # type: ignore[no-untyped-call]

    def _resized(self, storage: Any, delta: int) -> None:
        """A storage grew (or shrank) by ``delta`` bytes in place. Growth of a storage not tracked yet is new memory of
        this step; shrinking one not tracked frees memory no step counted (it was resized to 0 before): ignored."""
        key = id(storage)
        if key in self.live:
            self.live[key] += delta
            self.current += delta
        elif delta > 0:
            try:
                weakref.finalize(storage, self._free, key)
            except TypeError:
                return
            self.live[key] = delta
            self.current += delta
        self.peak_bytes = max(self.peak_bytes, self.baseline_bytes + self.current)

    def __torch_dispatch__(self, func: Callable[..., Any], types: Sequence[type], args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Views and in-place results share an input's storage: nothing new was allocated.
        inputs = {
            id(local_tensor(a).untyped_storage()) for a in tree_flatten((args, kwargs or {}))[0]
            if isinstance(a, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            t = local_tensor(t)  # a DTensor (FSDP2) holds only its local shard's storage
            storage = t.untyped_storage()
            key = id(storage)
            if key in self.live or key in inputs or storage.nbytes() == 0:
                continue
            try:
                weakref.finalize(storage, self._free, key)
            except TypeError:  # storage without weakref support: skip rather than miscount
                continue
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.baseline_bytes + self.current)
        return out
