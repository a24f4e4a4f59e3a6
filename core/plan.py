"""The analytic memory plan: bytes per device and per component, before anything runs (DESIGN §3).

The model is built on the meta device from its config (no weights are read or allocated), so a 70B model plans in well
under a second on a laptop once torch and transformers are imported; a Llama-family config.json is summarised from its
numbers instead (core/shapes.py, equal to the meta build in tests), with no import of either. Parameter counts and shapes come from that meta model; everything else is a formula of the
spec (batch ``b``, sequence ``s``, dtype bytes) and the config (hidden ``h``, layers ``L``, heads ``a``, vocabulary
``V``). Every :class:`Line` carries the formula it used, so a reader can check each number.

Accounting convention (also in :attr:`MemoryPlan.convention`, shown on screen and written to the record):

- weights: every parameter (LM head included, tied weights once); inference in the spec dtype; training in fp32, since
  bf16/fp16 training is mixed precision with fp32 master weights and autocast (Trainer's ``bf16=True``/``fp16=True``,
  16 B per parameter with AdamW as in ZeRO, arXiv 1910.02054); LoRA adapters are fp32 (peft's default);
- gradients: trainable parameters x bytes of their own dtype; inference has none;
- optimizer states: fp32 (4 B) per state element: AdamW 2 x T x 4 B, SGD with momentum T x 4 B, Adafactor factored
  row + column statistics;
- activations (saved for backward): Korthikanti et al. 2022 (arXiv 2205.05198), per layer
  ``s·b·h·(34 + 5·a·s/h)`` bytes in 16-bit, scaled by dtype bytes / 2, plus fp32 logits;
- temporaries: short-lived buffers at the peak (foreach AdamW's extra state, the logits gradient; one layer's working set
  for inference);
- overhead: the CUDA context and cuBLAS workspace, a line of its own (never hidden in another);
- kv_cache: inference only.

Per device, by strategy (:func:`plan_memory`; the rule is appended to the convention of a plan made for it): single
(each device holds the whole run), ddp (full replica + gradient buckets; PyTorch DDP docs), zero1/zero2/zero3 (ZeRO,
arXiv 1910.02054; zero3 = FSDP full shard: model states ÷ N, activations not divided), device_map (whole layers in order,
as accelerate's ``infer_auto_device_map``), tp (Megatron-LM, arXiv 1909.08053: linear layers ÷ tp). Devices can be a
box you do not have (``8x80GiB``, ``24GiB,8GiB``): :func:`detect_devices` builds them without asking torch.

Nothing here imports torch, transformers or peft at module import; functions import them when called.
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass
from typing import Any

from core.errors import SpecError
from core.spec import (
    DTYPE_BYTES,
    TORCHRUN_STRATEGIES,
    LoraSettings,
    RunSpec,
    check_strategy,
    parse_device_capacities,
    parse_devices,
)

COMPONENTS = ("weights", "gradients", "optimizer_states", "activations", "temporaries", "overhead", "kv_cache")

#: Per-process, per-device CUDA context + cuBLAS workspace estimate (DESIGN §3: 300-700 MB; lazy module loading).
CUDA_OVERHEAD_BYTES = 500 * 2**20
#: Per-process, per-device NCCL communicator buffers, an estimate (not measured here): NCCL allocates NCCL_BUFFSIZE
#: (4 MiB by default) per channel, per peer and per protocol, so it grows with channels and peers; a few hundred MiB
#: per GPU is common. Added to the overhead line of every strategy that runs collectives on N >= 2 devices.
NCCL_BUFFER_BYTES = 256 * 2**20
#: PyTorch DDP's default bucket size (``bucket_cap_mb=25``), in bytes; quoted in the DDP bucket method text.
DDP_BUCKET_CAP_BYTES = 25 * 2**20
#: ZeRO-3 / FSDP: gathered (unsharded) units alive at once: the one computing and the next one, prefetched (FSDP's
#: default ``backward_prefetch=BACKWARD_PRE`` all-gathers the next unit before the current one's gradient is computed;
#: DeepSpeed ZeRO-3 prefetches by ``stage3_prefetch_bucket_size``). An estimate of the planner, stated in the method.
ZERO3_GATHERED_UNITS = 2
#: Bytes per optimizer-state element under this plan's convention (fp32 states).
OPTIMIZER_STATE_BYTES = 4
#: Bytes per logit element: transformers' causal-LM loss upcasts logits to fp32.
LOGITS_BYTES = 4
#: Korthikanti et al. 2022, eq. (1): bytes per token per hidden unit of one transformer layer in 16-bit, without the
#: attention-score term 5·a·s/h (which is kept only when the attention implementation materialises the scores).
KORTHIKANTI_SBH_BYTES_16BIT = 34

_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


# ---------------------------------------------------------------------------------------------------------- data types
@dataclass(frozen=True)
class DeviceInfo:
    """A device the plan is made for.

    Attributes:
        name: ``"cpu"`` or ``"cuda:N"`` (CUDA order, as torch numbers devices in this process).
        kind: ``"cpu"`` | ``"cuda"``.
        label: for people, e.g. ``"host CPU"`` or ``"NVIDIA H200"``.
        capacity_bytes: memory the plan must fit in, in bytes; ``None`` when it cannot be known here.
        capacity_source: where ``capacity_bytes`` came from (or why it is unknown).
    """

    name: str
    kind: str
    label: str
    capacity_bytes: int | None
    capacity_source: str


@dataclass(frozen=True)
class Line:
    """One component of a device plan.

    Attributes:
        component: one of :data:`COMPONENTS`.
        bytes: the estimate, in bytes (0 where the component does not apply).
        method: one line saying how it was estimated (the formula with its numbers), or why it is 0.
    """

    component: str
    bytes: int
    method: str


@dataclass(frozen=True)
class ParameterCount:
    """Parameter counts of the model as it runs.

    Attributes:
        total: every parameter, LM head included, tied weights counted once, LoRA adapters included.
        trainable: parameters that receive gradients (all for full fine-tuning, the adapters for LoRA, 0 for inference).
    """

    total: int
    trainable: int


@dataclass(frozen=True)
class DevicePlan:
    """What one device must hold: a :class:`Line` for every name in :data:`COMPONENTS`."""

    device: DeviceInfo
    lines: dict[str, Line]

    @property
    def total_bytes(self) -> int:
        """The sum of all components, in bytes (a sum, never the largest component: case P3)."""
        return sum(line.bytes for line in self.lines.values())

    @property
    def fits(self) -> bool | None:
        """``total_bytes <= capacity_bytes`` on this device alone; ``None`` when the capacity is unknown.

        Fit is judged per device: memory of other devices never counts (case P5).
        """
        if self.device.capacity_bytes is None:
            return None
        return self.total_bytes <= self.device.capacity_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """The analytic plan of a run.

    Attributes:
        parameters: parameter counts of the model as it runs.
        devices: one plan per device.
        strategy: how the run is spread over devices (:data:`core.spec.STRATEGIES`); ``"single"``: each device holds
            the whole run; ``ddp``, ``zero1``/``zero2``/``zero3``, ``device_map``, ``tp``: see :func:`plan_memory`.
        convention: one paragraph stating the accounting convention (with the strategy's rule appended).
    """

    parameters: ParameterCount
    devices: list[DevicePlan]
    strategy: str
    convention: str

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready mapping (bytes as ints) for ``gpuaccept plan --json`` and the record."""
        return {
            "parameters": {"total": self.parameters.total, "trainable": self.parameters.trainable},
            "strategy": self.strategy,
            "convention": self.convention,
            "devices": [
                {
                    "name": dp.device.name,
                    "label": dp.device.label,
                    "capacity_bytes": dp.device.capacity_bytes,
                    "components": {name: int(dp.lines[name].bytes) for name in COMPONENTS},
                    "methods": {name: dp.lines[name].method for name in COMPONENTS},
                    "total_bytes": int(dp.total_bytes),
                    "fits": dp.fits,
                }
                for dp in self.devices
            ],
        }


CONVENTION = (
    "Bytes per device, each device planned on its own (strategy 'single': every device holds the whole run); the "
    "total is the sum of all components, never the largest one, and is an upper bound because activations are freed "
    "before the optimizer step. Training in bf16/fp16 is mixed precision as Trainer does it (bf16=True / fp16=True): "
    "the model and its fp32 master weights stay fp32 (4 B), the forward and backward run under autocast in the 16-bit "
    "dtype, so activations are 16-bit; inference loads the weights in the spec dtype. LoRA adapters are fp32 (peft's "
    "default); gradients are in each parameter's dtype; optimizer "
    "states count 4 B (fp32) per element: AdamW 2 x T x 4 B, SGD with momentum T x 4 B, Adafactor factored row + "
    "column statistics; torch's foreach AdamW adds about one more state at the step (temporaries). Activations follow "
    "Korthikanti et al. 2022 (arXiv 2205.05198) scaled to the dtype, assuming SDPA/flash attention (no saved "
    "attention scores) unless the config asks for eager attention, plus fp32 logits for the loss; LoRA keeps them "
    "but for the inputs of frozen MLP linears (no weight gradient to compute), not in proportion to its trainable "
    "parameters. Inference holds weights, the KV cache and one layer's working set. The CUDA context and cuBLAS "
    "workspace are a separate overhead line (estimate)."
)

_SINGLE_RULE = "(strategy 'single': every device holds the whole run)"

#: The per-device rule of each strategy, appended to :data:`CONVENTION` in a plan made for that strategy.
STRATEGY_CONVENTIONS = {
    "ddp": "Strategy ddp (PyTorch DistributedDataParallel): every device holds a full replica (weights, gradients, "
           "optimizer states, activations of its own micro-batch) plus DDP's gradient bucket buffers, which cover "
           "every gradient (25 MiB buckets; gradient_as_bucket_view=False is the default and Trainer keeps it), under "
           "temporaries; NCCL buffers are added to the overhead line (estimate).",
    "zero1": "Strategy zero1 (ZeRO stage 1, Rajbhandari et al., arXiv 1910.02054): optimizer states and the optimizer "
             "step's temporaries / N per device; weights, gradients and activations are not divided; NCCL buffers in "
             "overhead (estimate).",
    "zero2": "Strategy zero2 (ZeRO stage 2, arXiv 1910.02054): optimizer states, gradients and the optimizer step's "
             "temporaries / N per device; weights and activations are not divided; NCCL buffers in overhead "
             "(estimate).",
    "zero3": "Strategy zero3 (ZeRO stage 3 = FSDP FULL_SHARD, arXiv 1910.02054; PyTorch FSDP docs): weights, gradients, "
             "optimizer states and the step's temporaries / N per device (rounded up), plus the largest gathered unit "
             "(the largest decoder layer's unsharded weights) x 2 (one computing, one prefetched) under temporaries; "
             "activations are NOT divided: each device runs its own micro-batch through every layer; NCCL buffers in "
             "overhead (estimate).",
    "device_map": "Strategy device_map (one process, layers placed in order as accelerate's infer_auto_device_map does, "
                  "decoder layers never split): embeddings on the first device, final norm + LM head (and the logits) "
                  "on the last; each device's share of the weights is proportional to its capacity (a capacity-weighted "
                  "'balanced' map; accelerate's own 'balanced' gives equal shares and 'sequential' fills device 0 "
                  "first); tied LM-head weights stay with the embedding; each device holds its layers' weights, "
                  "gradients, optimizer states, activations and KV cache. No NCCL: activations are copied between "
                  "devices.",
    "tp": "Strategy tp (Megatron-LM tensor parallel, Shoeybi et al., arXiv 1909.08053): attention projections and MLP "
          "linear layers (weights and biases) / tp; token embeddings and the LM head are vocab-parallel / tp; norms, "
          "position embeddings and LoRA adapters are replicated; activations per layer s·b·h·(10 + 24/t) (Korthikanti "
          "et al. 2022 eq. 2, no sequence parallelism; the 5·a·s/(h·t) score term only with eager attention); logits "
          "/ tp (vocab-parallel cross-entropy); KV cache / tp; devices beyond tp are data-parallel replicas holding "
          "the same; NCCL buffers in overhead (estimate).",
}


# ------------------------------------------------------------------------------------------------------- meta model
def build_meta_model(config: Any, mode: str, lora: LoraSettings | None, dtype: str | None = None) -> Any:
    """Build the model on the meta device: shapes and dtypes only, no memory, no weights read.

    Args:
        config: a ``transformers.PretrainedConfig`` (it is copied, never changed).
        mode: ``inference`` | ``full`` | ``lora``; ``lora`` wraps the model with peft (also on the meta device).
        lora: LoRA settings; required for ``lora``, ignored otherwise.
        dtype: ``fp32`` | ``bf16`` | ``fp16`` for the base parameters (default: the config's own default, fp32).

    Returns:
        ``AutoModelForCausalLM.from_config(config)`` built under ``torch.device("meta")``; for ``lora`` the peft model
        (adapters fp32, as peft's ``autocast_adapter_dtype`` default makes them).

    Raises:
        SpecError: the config is not a causal language model, or ``lora`` is missing in LoRA mode.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from core.shapes import FastConfig

    if isinstance(config, FastConfig):
        config = config.to_transformers()
    config = copy.deepcopy(config)  # from_config writes _attn_implementation into the config
    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = getattr(torch, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation chatter from transformers/peft internals
        with torch.device("meta"):
            try:
                model = AutoModelForCausalLM.from_config(config, **kwargs)
            except ValueError as exc:
                model_type = getattr(config, "model_type", "?")
                raise SpecError("model", f"{model_type!r} is not a causal language model; gpuaccept plans causal LMs ({exc})") from None
            if mode == "lora":
                if lora is None:
                    raise SpecError("lora", "LoRA mode needs LoRA settings (r, alpha, dropout, targets)")
                from peft import LoraConfig, get_peft_model

                peft_config = LoraConfig(
                    r=lora.r,
                    lora_alpha=lora.alpha,
                    lora_dropout=lora.dropout,
                    target_modules=list(lora.targets),
                    task_type="CAUSAL_LM",
                )
                model = get_peft_model(model, peft_config)
    return model


#: Meta-model summaries already made in this process, by (config JSON, mode, LoRA settings, parameter dtype): the
#: wizard re-plans on every batch or sequence change and the summary does not depend on either (benchmarks/plan_speed.py).
_SUMMARIES: dict[tuple[Any, ...], "_Summary"] = {}
_LINEAR_NAMES: dict[str, frozenset[str]] = {}
_CACHE_SIZE = 16


def _config_key(config: Any) -> str:
    return config.to_json_string(use_diff=False)


def meta_summary(config: Any, mode: str, lora: LoraSettings | None, dtype: str | None = None) -> "_Summary":
    """What the plan needs from the meta model (counts, dtypes, shapes, adapters), built once per process for each
    (config, mode, LoRA settings, parameter dtype); see :func:`build_meta_model` for the arguments."""
    from core.shapes import FastConfig, lora_supported

    key = (_config_key(config), mode, lora if mode == "lora" else None, dtype)
    summary = _SUMMARIES.get(key)
    if summary is None:
        if isinstance(config, FastConfig) and (mode != "lora" or (lora is not None and lora_supported(lora.targets))):
            summary = _summary_from_shapes(config, mode, lora, dtype)  # no torch, no transformers (core/shapes.py)
        else:
            summary = _summarise(build_meta_model(config, mode, lora, dtype), mode)
        if len(_SUMMARIES) >= _CACHE_SIZE:
            _SUMMARIES.pop(next(iter(_SUMMARIES)))
        _SUMMARIES[key] = summary
    return summary


def count_parameters(config: Any, mode: str, lora: LoraSettings | None) -> ParameterCount:
    """Parameter counts from the meta model (see :class:`ParameterCount`).

    ``total`` counts each parameter once (``Module.parameters()`` skips tied duplicates), LM head included; for LoRA it
    includes the adapters and ``trainable`` is peft's own ``get_nb_trainable_parameters()``.
    """
    return meta_summary(config, mode, lora).count


def linear_module_names(config: Any) -> set[str]:
    """Short names (``q_proj``, ``down_proj``, ``lm_head`` ...) of the modules LoRA can target.

    These are ``torch.nn.Linear`` modules and transformers' GPT-2-style ``Conv1D`` (peft adapts both).
    """
    from core.shapes import PROJECTIONS, FastConfig

    if isinstance(config, FastConfig):
        return {*PROJECTIONS, "lm_head"}  # the LM head is a Linear even when tied
    key = _config_key(config)
    if key not in _LINEAR_NAMES:
        model = build_meta_model(config, "full", None)
        _LINEAR_NAMES[key] = frozenset(
            name.rsplit(".", 1)[-1] for name, module in model.named_modules() if name and _is_linear(module))
    return set(_LINEAR_NAMES[key])


def _is_linear(module: Any) -> bool:
    import torch

    if isinstance(module, torch.nn.Linear):
        return True
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")


@dataclass(frozen=True)
class _Adapter:
    """One LoRA-wrapped module: its input width, rank, adapter bytes per element and the layer it is in."""

    in_features: int
    r: int
    element_bytes: int
    layer: str | None


@dataclass(frozen=True)
class _Param:
    """One parameter (tied ones once) and where it lives, for the strategies that split the model.

    Attributes:
        unit: ``"embeddings"`` (token/position embeddings), ``"layer"`` (inside decoder layer ``layer``) or ``"head"``
            (everything else: the final norm, the LM head).
        layer: the decoder layer index, or ``None`` outside the layers.
        numel: elements.
        dtype: dtype name (``fp32``, ``bf16`` ...).
        trainable: receives a gradient.
        shape: its shape.
        kind: ``"linear"`` (a weight or bias of ``nn.Linear`` / GPT-2 ``Conv1D``), ``"embedding"``, ``"lora"`` (a LoRA
            adapter) or ``"other"`` (norms ...).
    """

    unit: str
    layer: int | None
    numel: int
    dtype: str
    trainable: bool
    shape: tuple[int, ...]
    kind: str


@dataclass(frozen=True)
class _Summary:
    """What the plan needs from the meta model."""

    count: ParameterCount
    weight_groups: dict[str, int]  # dtype name -> number of parameters
    grad_groups: dict[str, int]  # dtype name -> number of trainable parameters
    trainable_shapes: tuple[tuple[int, ...], ...]
    adapters: tuple[_Adapter, ...]
    params: tuple[_Param, ...] = ()


def _dtype_name(dtype: Any) -> str:
    text = str(dtype).removeprefix("torch.")
    return _DTYPE_NAMES.get(text, text)


def _summarise(model: Any, mode: str) -> _Summary:
    weight_groups: dict[str, int] = {}
    grad_groups: dict[str, int] = {}
    shapes: list[tuple[int, ...]] = []
    total = 0
    for param in model.parameters():  # tied parameters appear once
        n = param.numel()
        total += n
        name = _dtype_name(param.dtype)
        weight_groups[name] = weight_groups.get(name, 0) + n
        if mode != "inference" and param.requires_grad:
            grad_groups[name] = grad_groups.get(name, 0) + n
            shapes.append(tuple(param.shape))
    trainable = sum(grad_groups.values())
    adapters: list[_Adapter] = []
    if mode == "lora":
        trainable = int(model.get_nb_trainable_parameters()[0])
        for name, module in model.named_modules():
            lora_a = getattr(module, "lora_A", None)
            if lora_a is None or not hasattr(lora_a, "items") or not len(lora_a):
                continue
            for adapter in lora_a.values():
                weight = adapter.weight  # (r, in_features)
                match = _LAYER_INDEX.search(name)
                adapters.append(
                    _Adapter(
                        in_features=int(weight.shape[1]),
                        r=int(weight.shape[0]),
                        element_bytes=weight.element_size(),
                        layer=match.group(1) if match else None,
                    )
                )
    return _Summary(ParameterCount(total, trainable), weight_groups, grad_groups, tuple(shapes), tuple(adapters),
                    _params(model, mode))


def _summary_from_shapes(config: Any, mode: str, lora: LoraSettings | None, dtype: str | None) -> _Summary:
    """The :class:`_Summary` :func:`_summarise` makes from the meta model, written from :func:`core.shapes.parameters`
    (Llama family; equal to the meta build's, tests/test_shapes.py)."""
    from core.shapes import dtype_bytes, parameters

    weight_groups: dict[str, int] = {}
    grad_groups: dict[str, int] = {}
    shapes: list[tuple[int, ...]] = []
    adapters: list[_Adapter] = []
    params: list[_Param] = []
    total = 0
    for p in parameters(config, mode, lora, dtype):
        n = _numel(p["shape"])
        total += n
        weight_groups[p["dtype"]] = weight_groups.get(p["dtype"], 0) + n
        trainable = mode != "inference" and p["trainable"]
        if trainable:
            grad_groups[p["dtype"]] = grad_groups.get(p["dtype"], 0) + n
            shapes.append(p["shape"])
        if "adapter_in" in p:
            adapters.append(_Adapter(p["adapter_in"], p["shape"][0], dtype_bytes(p["dtype"]),
                                     None if p["layer"] is None else str(p["layer"])))
        layer = p["layer"]
        unit = "layer" if layer is not None else ("embeddings" if p["kind"] == "embedding" else "head")
        params.append(_Param(unit, layer, n, p["dtype"], trainable, p["shape"], p["kind"]))
    return _Summary(ParameterCount(total, sum(grad_groups.values())), weight_groups, grad_groups, tuple(shapes),
                    tuple(adapters), tuple(params))


def _params(model: Any, mode: str) -> tuple[_Param, ...]:
    """Every parameter once (the first module that registers a tied one owns it), in module order, with its place."""
    import torch

    seen: set[int] = set()
    out: list[_Param] = []
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            full = f"{module_name}.{pname}"
            match = _LAYER_INDEX.search(full)
            if "lora_" in module_name:
                kind = "lora"
            elif isinstance(module, torch.nn.Embedding):
                kind = "embedding"
            elif _is_linear(module):
                kind = "linear"
            else:
                kind = "other"
            if match:
                unit, layer = "layer", int(match.group(1))
            else:
                unit, layer = ("embeddings" if kind == "embedding" else "head"), None
            out.append(_Param(unit, layer, param.numel(), _dtype_name(param.dtype),
                              mode != "inference" and bool(param.requires_grad), tuple(param.shape), kind))
    return tuple(out)


# ---------------------------------------------------------------------------------------------------------- devices
def detect_devices(devices: str, cpu_ranks: int = 1) -> list[DeviceInfo]:
    """The devices named by a spec's ``devices`` setting, with their capacity.

    ``cpu_ranks`` >= 2 (torchrun's ranks on the CPU, ``torchrun.nproc_per_node``): when the run is on the host CPU it
    is planned as that many devices ``cpu:0`` ... ``cpu:N-1``, one per rank, each given an equal share of the host's
    available memory (the ranks are processes sharing one host memory; a share is a convention, not a partition).

    - ``"cpu"``: the host, capacity = ``psutil.virtual_memory().available`` (bytes free for a new process now);
    - ``"auto"``: every visible CUDA device if ``torch.cuda.is_available()``, else the host CPU;
    - ``"0,1"`` / ``"cuda:0"``: those CUDA devices, capacity = ``torch.cuda.get_device_properties(i).total_memory``,
      or ``None`` (with ``capacity_source`` saying why) when CUDA is unavailable or the index is not visible;
    - a box you do not have, to plan for (``"8x80GiB"``, ``"24GiB,8GiB"``, see
      :func:`core.spec.parse_device_capacities`): ``DeviceInfo("cuda:i", "cuda", "planned GPU", capacity,
      "given: 8x80GiB")`` per device, in the order given; torch is not asked.

    Raises:
        SpecError: ``devices`` is none of the forms above.
    """
    capacities = parse_device_capacities(devices)
    if capacities is not None:
        given = f"given: {devices.strip()}"
        return [DeviceInfo(f"cuda:{i}", "cuda", "planned GPU", cap, given) for i, cap in enumerate(capacities)]
    names = parse_devices(devices)
    if names == ["cpu"]:
        return _host_devices(cpu_ranks)
    import torch

    cuda = torch.cuda.is_available()
    if names == ["auto"]:
        if not cuda:
            return _host_devices(cpu_ranks)
        names = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    count = torch.cuda.device_count() if cuda else 0
    out = []
    for name in names:
        index = int(name.split(":", 1)[1])
        if not cuda:
            out.append(DeviceInfo(name, "cuda", f"{name} (CUDA unavailable)", None, "unknown: CUDA is not available in this process"))
        elif index >= count:
            out.append(DeviceInfo(name, "cuda", f"{name} (not visible)", None, f"unknown: only {count} CUDA device(s) visible"))
        else:
            props = torch.cuda.get_device_properties(index)
            out.append(DeviceInfo(name, "cuda", props.name, int(props.total_memory), "torch.cuda total memory"))
    return out


def _host_devices(ranks: int) -> list[DeviceInfo]:
    host = _host_device()
    if ranks < 2:
        return [host]
    share = host.capacity_bytes // ranks
    return [DeviceInfo(f"cpu:{r}", "cpu", f"host CPU, rank {r} of {ranks}", share,
                       f"available host memory (psutil) / {ranks} ranks sharing it") for r in range(ranks)]


def _host_device() -> DeviceInfo:
    import psutil

    return DeviceInfo("cpu", "cpu", "host CPU", int(psutil.virtual_memory().available), "available host memory (psutil)")


# ------------------------------------------------------------------------------------------------------------- plan
def plan_memory(
    spec: RunSpec, config: Any, devices: list[DeviceInfo], parameters: ParameterCount | None = None
) -> MemoryPlan:
    """Plan the memory of ``spec`` on each device, by ``spec.strategy`` (DESIGN §3).

    Every device plan holds a :class:`Line` for every name in :data:`COMPONENTS`; each method names the strategy and
    its divisor. Bytes per device (N = number of devices):

    - ``single``: every device is planned as if it held the whole run (the whole-run lines on each device).
    - ``ddp`` (PyTorch DDP docs): the whole-run lines on every device (a full replica; activations of its own
      micro-batch), plus under temporaries DDP's gradient bucket buffers = the gradient bytes (the reducer's flat
      25 MiB buckets cover every gradient while ``gradient_as_bucket_view=False``, DDP's default, kept by Trainer).
    - ``zero1`` / ``zero2`` / ``zero3`` (ZeRO, arXiv 1910.02054; ``zero3`` = FSDP full shard): optimizer states (and the
      optimizer step's temporaries) ÷ N; ``zero2`` also gradients ÷ N; ``zero3`` also weights ÷ N plus the largest
      gathered unit (the largest decoder layer's unsharded weights x 2 for prefetch) under temporaries. Division rounds
      up (shards are padded to equal size). Activations are never divided (case P4).
    - ``device_map``: whole decoder layers placed in order on the devices (see :func:`_device_map`); each device holds
      its layers' weights, gradients, optimizer states, activations and KV cache; logits on the last device.
    - ``tp`` (Megatron-LM, arXiv 1909.08053): linear layers of attention and MLP ÷ tp, embeddings and LM head
      vocab-parallel ÷ tp, the rest replicated; activations per Korthikanti et al. 2022 eq. 2; KV cache ÷ tp.

    Overhead: the CUDA context line on every CUDA device; strategies that run collectives on N >= 2 devices (ddp,
    zero*, tp) add :data:`NCCL_BUFFER_BYTES` (estimate) to it; device_map runs in one process and uses none.

    Args:
        spec: the run; ``batch_size`` is the micro-batch per device (per tensor-parallel group for ``tp``).
        config: the model's ``transformers.PretrainedConfig``.
        devices: from :func:`detect_devices` (or made by hand).
        parameters: counts already computed by :func:`count_parameters` for this spec, to report as they are (by
            default the counts of the meta model built here, in the parameter dtype, once per process).

    Returns:
        a :class:`MemoryPlan` whose device plans hold a :class:`Line` for every name in :data:`COMPONENTS`.

    Raises:
        SpecError: the strategy does not suit the number of devices (e.g. ``devices = "auto"`` found one), or ``tp``
            does not divide the model's attention or KV heads.
    """
    strategy = spec.strategy
    # N: the ranks sharing the work (every node's, for several nodes); the devices planned are this node's
    n = spec.world_size(len(devices)) if strategy in TORCHRUN_STRATEGIES else len(devices)
    check_strategy(strategy, spec.tp, n, spec.devices)
    shape = _Shape.of(config)
    if strategy == "tp":
        _check_tp_heads(spec.tp, shape)
    # Mixed precision: training keeps fp32 parameters (master weights) and autocasts; inference loads in the dtype.
    param_dtype = "fp32" if spec.training else spec.dtype
    summary = meta_summary(config, spec.mode, spec.lora if spec.mode == "lora" else None, param_dtype)
    counts = parameters if parameters is not None else summary.count
    common = {
        "weights": _weights(summary),
        "gradients": _gradients(spec, summary),
        "optimizer_states": _optimizer_states(spec, summary),
        "activations": _activations(spec, shape, summary),
        "temporaries": _temporaries(spec, shape, summary),
        "kv_cache": _kv_cache(spec, shape),
    }
    if strategy == "single":
        plans = []
        for device in devices:
            lines = dict(common, overhead=_overhead(device))
            plans.append(DevicePlan(device, {name: lines[name] for name in COMPONENTS}))
        return MemoryPlan(counts, plans, "single", CONVENTION)
    if strategy == "ddp":
        per_device = [_ddp_lines(spec, summary, common, n) for _ in devices]
    elif strategy in ("zero1", "zero2", "zero3"):
        per_device = [_zero_lines(spec, shape, summary, common, strategy, n) for _ in devices]
    elif strategy == "device_map":
        per_device = _device_map_lines(spec, shape, summary, devices)
    else:
        per_device = [_tp_lines(spec, shape, summary, spec.tp, len(devices)) for _ in devices]
    plans = []
    for device, lines in zip(devices, per_device):
        lines = dict(lines, overhead=_overhead(device, strategy, n))
        plans.append(DevicePlan(device, {name: lines[name] for name in COMPONENTS}))
    convention = CONVENTION.replace(_SINGLE_RULE, f"(strategy {strategy}: see its rule at the end)")
    return MemoryPlan(counts, plans, strategy, f"{convention} {STRATEGY_CONVENTIONS[strategy]}")


# ------------------------------------------------------------------------------------------------------- strategies
def _tagged(line: Line, tag: str) -> Line:
    """``line`` with ``tag`` (the strategy and its divisor) in front of its method."""
    return Line(line.component, line.bytes, f"{tag}: {line.method}")


def _divided(line: Line, n: int, tag: str) -> Line:
    """``line`` ÷ ``n`` rounded up (ZeRO and FSDP pad shards to equal size), its method saying so."""
    if line.bytes == 0:
        return _tagged(line, f"{tag}, ÷ N={n} (nothing to divide)")
    return Line(line.component, -(-line.bytes // n),
                f"{tag}: ÷ N={n}, ceil({line.bytes:,} B / {n}) of the whole-model figure, {line.method}")


def _ddp_lines(spec: RunSpec, summary: _Summary, common: dict[str, Line], n: int) -> dict[str, Line]:
    """DDP: a full replica per device plus the gradient bucket buffers (PyTorch DDP docs, ``gradient_as_bucket_view``:
    with the default ``False`` the reducer's buckets are a second copy of every gradient; ``True`` saves exactly the
    gradient size). Buckets hold at most ``bucket_cap_mb`` = 25 MiB each (the first one 1 MiB); their sum is the
    gradient bytes. Inference has no backward pass and no buckets."""
    tag = f"ddp (full replica per device, N={n})"
    lines = {name: _tagged(line, tag) for name, line in common.items()}
    temp = common["temporaries"]
    if spec.training:
        buckets = common["gradients"].bytes
        lines["temporaries"] = Line(
            "temporaries",
            temp.bytes + buckets,
            f"{tag}: {temp.method}; + DDP gradient buckets (estimate) {buckets:,} B = the gradient bytes: the reducer "
            f"copies every gradient into flat buckets of bucket_cap_mb = {DDP_BUCKET_CAP_BYTES // 2**20} MiB "
            "(gradient_as_bucket_view=False, DDP's default, kept by Trainer; True would save these bytes)",
        )
    return lines


def _zero_lines(
    spec: RunSpec, shape: "_Shape", summary: _Summary, common: dict[str, Line], strategy: str, n: int
) -> dict[str, Line]:
    """ZeRO stage 1/2/3 (Rajbhandari et al. 2020, arXiv 1910.02054, Fig. 1: P_os, P_os+g, P_os+g+p; ``zero3`` is
    PyTorch FSDP's FULL_SHARD). Stage 1: optimizer states ÷ N; stage 2: + gradients ÷ N; stage 3: + weights ÷ N and the
    largest gathered unit x :data:`ZERO3_GATHERED_UNITS`. The optimizer step runs on each device's shard, so its
    temporaries are ÷ N too; the logits gradient and the activations are per micro-batch and are not divided."""
    stage = strategy[-1]
    label = f"{strategy} (ZeRO stage {stage}" + (" = FSDP full shard" if stage == "3" else "") + ", arXiv 1910.02054)"
    divided = {"1": ("optimizer_states",), "2": ("optimizer_states", "gradients"),
               "3": ("optimizer_states", "gradients", "weights")}[stage]
    lines: dict[str, Line] = {}
    for name, line in common.items():
        if name in divided:
            lines[name] = _divided(line, n, label)
        elif name == "activations":
            lines[name] = _tagged(line, f"{label}, not divided: each device runs its own micro-batch through every "
                                        "layer (case P4)")
        elif name != "temporaries":
            lines[name] = _tagged(line, f"{label}, not divided")
    if spec.training:
        step, step_text, logits_grad = _temporaries_parts(spec, shape, summary)
        step_local = -(-step // n)
        temp_bytes = step_local + logits_grad
        temp_text = (f"{label}: optimizer step on this device's shard, ÷ N={n}: ceil({step:,} B / {n}) of {step_text}; "
                     f"+ fp32 logits gradient b·s·V x {LOGITS_BYTES} B (not divided)")
    else:
        temp = common["temporaries"]
        temp_bytes, temp_text = temp.bytes, f"{label}, not divided: {temp.method}"
    if stage == "3":
        layers = _layer_weight_bytes(summary)
        largest = max(layers.values(), default=0)
        # the root unit (embeddings, final norm, LM head: what no decoder layer holds) stays gathered through the step
        root = max(0, common["weights"].bytes - sum(layers.values()))
        gathered = ZERO3_GATHERED_UNITS * largest + root
        temp_bytes += gathered
        temp_text += (f"; + largest gathered unit x {ZERO3_GATHERED_UNITS} (the one computing and the one prefetched): "
                      f"the largest decoder layer's unsharded weights {largest:,} B x {ZERO3_GATHERED_UNITS}; + the "
                      f"root unit unsharded, {root:,} B (embeddings, final norm, LM head: FSDP does not reshard the "
                      "root after forward, so it is gathered from the first forward to the end of backward)")
    lines["temporaries"] = Line("temporaries", temp_bytes, temp_text)
    return lines


def _layer_weight_bytes(summary: _Summary) -> dict[int, int]:
    """Weight bytes of each decoder layer (its parameters in their dtype; LoRA adapters included)."""
    out: dict[int, int] = {}
    for p in summary.params:
        if p.layer is not None:
            out[p.layer] = out.get(p.layer, 0) + p.numel * DTYPE_BYTES.get(p.dtype, 4)
    return out


def _share(summary: _Summary, params: list[tuple[_Param, int, tuple[int, ...]]], adapters: tuple[_Adapter, ...]) -> _Summary:
    """A :class:`_Summary` of the part of the model one device holds: ``(param, local elements, local shape)``."""
    weight_groups: dict[str, int] = {}
    grad_groups: dict[str, int] = {}
    shapes: list[tuple[int, ...]] = []
    total = trainable = 0
    for p, numel, local_shape in params:
        total += numel
        weight_groups[p.dtype] = weight_groups.get(p.dtype, 0) + numel
        if p.trainable:
            trainable += numel
            grad_groups[p.dtype] = grad_groups.get(p.dtype, 0) + numel
            shapes.append(local_shape)
    return _Summary(ParameterCount(total, trainable), weight_groups, grad_groups, tuple(shapes), adapters)


def _device_map(summary: _Summary, devices: list[DeviceInfo]) -> dict[str, int]:
    """Place the model's units on the devices in order, like accelerate's ``infer_auto_device_map``.

    Units, in order: ``"embeddings"``, each decoder layer ``"layer i"`` (a no-split module: never divided), ``"head"``
    (final norm + LM head). Each device's share of the weight bytes is proportional to its capacity (equal shares when
    a capacity is unknown): a unit goes to the first device whose cumulative share reaches the middle of the unit
    (so a device is filled up to its share, give or take half a layer). The embeddings always go on the first device
    and the head on the last, as accelerate's maps for causal LMs do. Sizes are weights only, as accelerate's are.

    Returns:
        unit name -> device index.
    """
    sizes: dict[str, int] = {"embeddings": 0}
    for layer in sorted({p.layer for p in summary.params if p.layer is not None}):
        sizes[f"layer {layer}"] = 0
    sizes["head"] = 0
    for p in summary.params:
        key = f"layer {p.layer}" if p.layer is not None else p.unit
        sizes[key] += p.numel * DTYPE_BYTES.get(p.dtype, 4)
    n = len(devices)
    caps = [d.capacity_bytes for d in devices]
    weights = [float(c) for c in caps] if all(c for c in caps) else [1.0] * n
    total = sum(sizes.values())
    bounds, acc = [], 0.0
    for w in weights:
        acc += w
        bounds.append(total * acc / sum(weights))
    placement: dict[str, int] = {}
    start, device = 0, 0
    for unit, size in sizes.items():
        middle = start + size / 2
        while device < n - 1 and middle > bounds[device]:
            device += 1
        placement[unit] = device
        start += size
    placement["embeddings"] = 0
    placement["head"] = n - 1
    return placement


def _layer_range(layers: list[int]) -> str:
    if not layers:
        return "no decoder layers"
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]} ({len(layers)})"


def _device_map_lines(spec: RunSpec, shape: "_Shape", summary: _Summary, devices: list[DeviceInfo]) -> list[dict[str, Line]]:
    """device_map: each device holds the units :func:`_device_map` places on it, and what they need in the run."""
    placement = _device_map(summary, devices)
    n = len(devices)
    out = []
    for index in range(n):
        layers = sorted(int(u.split()[1]) for u, d in placement.items() if d == index and u.startswith("layer "))
        held = [u for u in ("embeddings", "head") if placement[u] == index]
        last = index == n - 1
        where = ", ".join([*(["embeddings"] if "embeddings" in held else []), _layer_range(layers),
                           *(["final norm + LM head + logits"] if "head" in held else [])])
        tag = f"device_map (device {index + 1} of {n}: {where})"
        mine = [(p, p.numel, p.shape) for p in summary.params
                if placement[f"layer {p.layer}" if p.layer is not None else p.unit] == index]
        adapters = tuple(a for a in summary.adapters
                         if (a.layer is not None and int(a.layer) in layers) or (a.layer is None and last))
        local = _share(summary, mine, adapters)
        lines = {
            "weights": _tagged(_weights(local, "the parameters of the units on this device, tied weights with the "
                                                      "embedding"), tag),
            "gradients": _tagged(_gradients(spec, local), tag),
            "optimizer_states": _tagged(_optimizer_states(spec, local), tag),
            "activations": _tagged(_activations_part(spec, shape, adapters, len(layers), last, 1), tag),
            "temporaries": _tagged(_temporaries_part(spec, shape, local, len(layers), last, 1), tag),
            "kv_cache": _tagged(_kv_cache_part(spec, shape, len(layers), 1), tag),
        }
        out.append(lines)
    return out


def _check_tp_heads(tp: int, shape: "_Shape") -> None:
    """Megatron-LM splits attention by heads: ``tp`` must divide the attention heads and the KV heads.

    Raises:
        SpecError: naming ``tp`` and the degrees that would work.
    """
    if shape.heads % tp or shape.kv_heads % tp:
        good = [t for t in range(2, shape.kv_heads + 1) if shape.heads % t == 0 and shape.kv_heads % t == 0]
        raise SpecError(
            "tp",
            f"tp = {tp} does not divide the model's {shape.heads} attention heads and {shape.kv_heads} KV heads; "
            "tensor parallelism splits attention by heads: choose tp among "
            + (", ".join(map(str, good)) if good else "none (this model cannot be split by heads; use another strategy)"),
        )


def _tp_lines(spec: RunSpec, shape: "_Shape", summary: _Summary, tp: int, n: int) -> dict[str, Line]:
    """tp (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053): every ``nn.Linear`` / ``Conv1D`` inside the decoder
    layers (attention q/k/v/o, MLP) is split ÷ tp (column- and row-parallel; biases with their weights, though Megatron
    replicates the row-parallel bias: hidden elements per layer), the token embedding and the LM head are
    vocab-parallel ÷ tp; norms, position embeddings and LoRA adapters are replicated. Adafactor shapes: the first
    dimension ÷ tp. Elements per device round up."""
    tag = f"tp (tensor parallel, tp={tp}, arXiv 1909.08053" + (f"; {n // tp} data-parallel replicas" if n > tp else "") + ")"
    mine = []
    split_numel = 0
    for p in summary.params:
        split = (p.kind == "linear" and p.unit == "layer") or (
            p.kind in ("embedding", "linear") and p.unit != "layer" and bool(p.shape) and p.shape[0] == shape.vocab)
        if split:
            split_numel += p.numel
            mine.append((p, -(-p.numel // tp), (-(-p.shape[0] // tp), *p.shape[1:])))
        else:
            mine.append((p, p.numel, p.shape))
    local = _share(summary, mine, summary.adapters)
    rule = (f"linear layers of attention and MLP + vocab-parallel embeddings/LM head ÷ {tp}, the rest replicated "
            f"(split part of the model: {split_numel:,} parameters)")
    return {
        "weights": _tagged(_weights(local, "this device's shards + the replicated parameters"), f"{tag}, {rule}"),
        "gradients": _tagged(_gradients(spec, local), f"{tag}, {rule}"),
        "optimizer_states": _tagged(_optimizer_states(spec, local), f"{tag}, {rule}"),
        "activations": _tagged(_activations_part(spec, shape, summary.adapters, shape.layers, True, tp), tag),
        "temporaries": _tagged(_temporaries_part(spec, shape, local, shape.layers, True, tp), tag),
        "kv_cache": _tagged(_kv_cache_part(spec, shape, shape.layers, tp), tag),
    }


@dataclass(frozen=True)
class _Shape:
    """Config sizes the formulas use: hidden h, layers L, heads a, KV heads, head_dim, vocabulary V, attention kind."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    attention: str  # the config's attention implementation; "sdpa" assumed when it names none

    @classmethod
    def of(cls, config: Any) -> "_Shape":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        hidden = int(text.hidden_size)
        heads = int(text.num_attention_heads)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        attention = getattr(text, "_attn_implementation", None) or "sdpa"
        return cls(hidden, int(text.num_hidden_layers), heads, int(kv_heads), int(head_dim), int(text.vocab_size), attention)

    @property
    def materialises_scores(self) -> bool:
        """True when attention keeps the a·s·s score matrices (eager); SDPA/flash kernels do not."""
        return self.attention == "eager"


def _groups(groups: dict[str, int]) -> str:
    """``"70,553,706,496 x 2 B (bf16)"``, or a sum of such terms when dtypes are mixed (LoRA adapters in fp32)."""
    if not groups:
        return "0 parameters"
    return " + ".join(f"{n:,} x {DTYPE_BYTES.get(d, 4)} B ({d})" for d, n in sorted(groups.items(), key=lambda kv: -kv[1]))


def _group_bytes(groups: dict[str, int]) -> int:
    return sum(n * DTYPE_BYTES.get(d, 4) for d, n in groups.items())


def _weights(summary: _Summary, scope: str | None = None) -> Line:
    """weights = P x bytes of each parameter's dtype (the spec dtype; LoRA adapters fp32). ``scope``: what part of the
    model ``summary`` is, for a device holding part of it (device_map, tp)."""
    if scope is not None:
        return Line("weights", _group_bytes(summary.weight_groups),
                    f"P here x bytes: {_groups(summary.weight_groups)}; {scope}")
    return Line(
        "weights",
        _group_bytes(summary.weight_groups),
        f"P x bytes: {_groups(summary.weight_groups)}; every parameter incl. LM head, tied weights once",
    )


def _gradients(spec: RunSpec, summary: _Summary) -> Line:
    """gradients = T x bytes of the parameter dtype; none for inference."""
    if not spec.training:
        return Line("gradients", 0, "inference: no backward pass, no gradients")
    return Line("gradients", _group_bytes(summary.grad_groups), f"T x bytes (parameter dtype): {_groups(summary.grad_groups)}")


def _optimizer_states(spec: RunSpec, summary: _Summary) -> Line:
    """AdamW 2 x T x 4 B; SGD with momentum T x 4 B; Adafactor (r + c) x 4 B per 2-D parameter (rows x cols), n x 4 B
    per 1-D one (Shazeer & Stern 2018, arXiv 1804.04235; transformers' ``Adafactor`` without a first moment)."""
    if not spec.training:
        return Line("optimizer_states", 0, "inference: no optimizer")
    t = summary.count.trainable
    b = OPTIMIZER_STATE_BYTES
    if spec.optimizer == "adamw":
        return Line("optimizer_states", 2 * t * b, f"AdamW: 2 moments x T x {b} B = 2 x {t:,} x {b} B")
    if spec.optimizer == "sgd":
        return Line("optimizer_states", t * b, f"SGD with momentum: 1 buffer x T x {b} B = {t:,} x {b} B (0 without momentum)")
    elements = 0
    for shape in summary.trainable_shapes:
        if len(shape) >= 2:
            leading = 1
            for d in shape[:-2]:
                leading *= d
            elements += leading * (shape[-2] + shape[-1])
        else:
            elements += _numel(shape)
    return Line(
        "optimizer_states",
        elements * b,
        f"Adafactor factored second moment: (rows + cols) x {b} B per matrix, n x {b} B per vector = {elements:,} x {b} B",
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


#: Module names of the first (up / gate) and second (down) MLP linear layers across common architectures.
_MLP_IN_NAMES = frozenset({"gate_proj", "up_proj", "c_fc", "fc_in", "fc1", "w1", "w3", "dense_h_to_4h"})
_MLP_OUT_NAMES = frozenset({"down_proj", "c_proj", "fc_out", "fc2", "w2", "dense_4h_to_h"})


def _frozen_mlp_inputs(spec: RunSpec) -> int:
    """Korthikanti units (of s·b·h, 16-bit) that LoRA training does not save: a frozen linear layer's backward needs its
    weight, not its input, so the input of a frozen MLP linear is kept only when something else saves it. Of eq. (1)'s
    34: the first MLP linear's input (2, the layer norm's output; the norm saves its own input) and the second's input
    (8, the activation function's output; the function saves its own input) are dropped unless LoRA targets those
    layers. Attention terms are kept (fused attention saves its inputs and output). On SmolLM2 the traced and the CPU
    probe's live tensors agree with this (LoRA q/v activations about 0.7x full fine-tuning's). 0 outside LoRA."""
    if spec.mode != "lora":
        return 0
    targets = set(spec.lora.targets)
    return (0 if targets & _MLP_IN_NAMES else 2) + (0 if targets & _MLP_OUT_NAMES else 8)


def _layer_activation_bytes(spec: RunSpec, shape: _Shape, tp: int = 1) -> tuple[int, str]:
    """One layer's saved activations, Korthikanti et al. 2022 eq. (1): ``s·b·h·(34 + 5·a·s/h)`` bytes in 16-bit, scaled by
    dtype bytes / 2; the ``5·a·s/h`` score term only with eager attention. With tensor parallelism ``tp`` = t > 1, eq. (2)
    (no sequence parallelism): ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``. Returns (bytes, formula text)."""
    s, b, h, a, nbytes = spec.seq_len, spec.batch_size, shape.hidden, shape.heads, spec.dtype_bytes
    if tp == 1:
        units, frozen_text = KORTHIKANTI_SBH_BYTES_16BIT, ""
        unsaved = _frozen_mlp_inputs(spec)
        if unsaved:
            units -= unsaved
            frozen_text = (f" - {unsaved} (LoRA: frozen MLP linears keep no input, they need no weight gradient; "
                           "measured with the traced plan)")
        per_layer = s * b * h * units * nbytes // 2
        if shape.materialises_scores:
            per_layer += 5 * a * s * s * b * nbytes // 2
            text = f"s·b·h·(34{frozen_text} + 5·a·s/h) x {nbytes}/2 B (eager attention keeps the a·s·s scores)"
        else:
            text = f"s·b·h·(34{frozen_text}) x {nbytes}/2 B ({shape.attention} attention assumed fused: no saved scores)"
        return per_layer, text
    per_layer = s * b * h * (10 * tp + 24) * nbytes // (2 * tp)
    if shape.materialises_scores:
        per_layer += 5 * a * s * s * b * nbytes // (2 * tp)
        text = (f"s·b·h·(10 + 24/t + 5·a·s/(h·t)) x {nbytes}/2 B, t={tp} (Korthikanti eq. 2; eager attention keeps "
                "the scores of its heads)")
    else:
        text = (f"s·b·h·(10 + 24/t) x {nbytes}/2 B, t={tp} (Korthikanti eq. 2, no sequence parallelism; "
                f"{shape.attention} attention assumed fused)")
    return per_layer, text


def _activations(spec: RunSpec, shape: _Shape, summary: _Summary) -> Line:
    """Training: L layers of Korthikanti activations (or, with gradient checkpointing, one s·b·h input per layer plus one
    full layer), fp32 logits twice (b·s·V·4 B x 2), and for LoRA each adapter's input and rank-r intermediate.
    Inference: the logits of a full forward pass and the loss over them (:func:`_inference_logits`)."""
    s, b, nbytes = spec.seq_len, spec.batch_size, spec.dtype_bytes
    L, h, V = shape.layers, shape.hidden, shape.vocab
    if not spec.training:
        size, text = _inference_logits(b * s * V, nbytes, f"{b}·{s}·{V:,}")
        return Line("activations", size, f"{text} (no activations are saved; one layer's working set is under "
                                         "temporaries)")
    per_layer, layer_text = _layer_activation_bytes(spec, shape)
    logits = 2 * b * s * V * LOGITS_BYTES
    if spec.gradient_checkpointing:
        layers = L * s * b * h * nbytes + per_layer
        text = f"checkpointing: L·s·b·h x {nbytes} B (one input per layer) + one layer {layer_text}, L={L}, h={h}"
    else:
        layers = L * per_layer
        text = f"Korthikanti et al. 2022: L x {layer_text}, L={L}, h={h}, s={s}, b={b}"
    text += f"; + fp32 logits kept for the loss 2 x b·s·V x 4 B (V={V:,})"
    total = layers + logits
    if summary.adapters:
        extra, extra_text = _adapter_activations(spec, summary.adapters)
        total += extra
        text += f"; + LoRA {extra_text} (adapters save their own inputs)"
    return Line("activations", total, text)


def _inference_logits(elements: int, nbytes: int, numbers: str) -> tuple[int, str]:
    """Inference logits with the loss over them (the probe and the held-out evaluation pass labels): the logits in the
    dtype, plus transformers' fp32 copy for the loss when the dtype is 16-bit, plus the fp32 log-softmax of the cross
    entropy (seen in the traced plan; an fp32 model's ``.float()`` is the same tensor)."""
    copies = nbytes + (LOGITS_BYTES if nbytes != LOGITS_BYTES else 0) + LOGITS_BYTES
    parts = f"{nbytes} B" + (f" + fp32 copy {LOGITS_BYTES} B" if nbytes != LOGITS_BYTES else "") + \
        f" + fp32 log-softmax {LOGITS_BYTES} B"
    return elements * copies, (f"inference: logits of a full forward pass and the loss over them, b·s·V x ({parts}) "
                               f"= {numbers} x {copies} B")


def _adapter_activations(spec: RunSpec, adapters: tuple[_Adapter, ...]) -> tuple[int, str]:
    """Per adapter: its input b·s·in and its rank-r intermediate b·s·r, in the adapter dtype (peft casts the input to it),
    plus a 1 B dropout mask b·s·in when dropout > 0. With gradient checkpointing only the recomputed layer's adapters
    (and adapters outside the layers, e.g. on lm_head) hold theirs at once."""
    s, b = spec.seq_len, spec.batch_size
    mask = 1 if spec.lora.dropout > 0 else 0

    def cost(ad: _Adapter) -> int:
        return b * s * (ad.in_features + ad.r) * ad.element_bytes + b * s * ad.in_features * mask

    if spec.gradient_checkpointing:
        by_layer: dict[str, int] = {}
        outside = 0
        for ad in adapters:
            if ad.layer is None:
                outside += cost(ad)
            else:
                by_layer[ad.layer] = by_layer.get(ad.layer, 0) + cost(ad)
        total = outside + max(by_layer.values(), default=0)
        scope = "for one recomputed layer"
    else:
        total = sum(cost(ad) for ad in adapters)
        scope = f"for {len(adapters)} adapted modules"
    text = "b·s·(in + r) x adapter bytes" + (" + b·s·in x 1 B dropout mask" if mask else "") + f" {scope}"
    return total, text


def _temporaries_parts(spec: RunSpec, shape: _Shape, summary: _Summary) -> tuple[int, str, int]:
    """Training temporaries in two parts: (optimizer step bytes, its formula text, fp32 logits gradient bytes)."""
    t = summary.count.trainable
    b_opt = OPTIMIZER_STATE_BYTES
    if spec.optimizer == "adamw":
        step, step_text = t * b_opt, f"foreach AdamW step ≈ one more state T x {b_opt} B = {t:,} x {b_opt} B"
    elif spec.optimizer == "adafactor":
        largest = max((_numel(sh) for sh in summary.trainable_shapes), default=0)
        step, step_text = 2 * largest * b_opt, f"Adafactor step: 2 x largest trainable tensor x {b_opt} B = 2 x {largest:,} x {b_opt} B"
    else:
        step, step_text = 0, "SGD step: in-place updates, no temporaries"
    logits_grad = spec.batch_size * spec.seq_len * shape.vocab * LOGITS_BYTES
    return step, step_text, logits_grad


def _temporaries(spec: RunSpec, shape: _Shape, summary: _Summary) -> Line:
    """Training: the optimizer step's transient buffers (foreach AdamW ≈ one more state, T x 4 B; Adafactor ≈ two fp32
    copies of the largest trainable tensor; SGD none) plus the fp32 logits gradient b·s·V x 4 B.
    Inference: one layer's working set (one layer of Korthikanti activations)."""
    if not spec.training:
        per_layer, layer_text = _layer_activation_bytes(spec, shape)
        return Line("temporaries", per_layer, f"inference: one layer's working set, {layer_text}")
    step, step_text, logits_grad = _temporaries_parts(spec, shape, summary)
    return Line("temporaries", step + logits_grad, f"{step_text}; + fp32 logits gradient b·s·V x {LOGITS_BYTES} B")


def _temporaries_part(spec: RunSpec, shape: _Shape, local: _Summary, layers: int, logits: bool, tp: int) -> Line:
    """Temporaries of a device holding part of the model (device_map, tp): the optimizer step over its own trainable
    parameters (``local``), the fp32 logits gradient b·s·V/tp x 4 B when it computes the logits; inference: one layer's
    working set when it holds any layer."""
    if not spec.training:
        if layers == 0:
            return Line("temporaries", 0, "inference: no decoder layer here, no layer working set")
        per_layer, layer_text = _layer_activation_bytes(spec, shape, tp)
        return Line("temporaries", per_layer, f"inference: one layer's working set, {layer_text}")
    step, step_text, _ = _temporaries_parts(spec, shape, local)
    if not logits:
        return Line("temporaries", step, f"{step_text} (this device's parameters); no logits here")
    logits_grad = -(-spec.batch_size * spec.seq_len * shape.vocab // tp) * LOGITS_BYTES
    split = f"/{tp} (vocab-parallel)" if tp > 1 else ""
    return Line("temporaries", step + logits_grad,
                f"{step_text} (this device's parameters); + fp32 logits gradient b·s·V{split} x {LOGITS_BYTES} B")


def _n_layers(n: int) -> str:
    return f"{n} layer" if n == 1 else f"{n} layers"


def _activations_part(
    spec: RunSpec, shape: _Shape, adapters: tuple[_Adapter, ...], layers: int, logits: bool, tp: int
) -> Line:
    """Activations of a device running ``layers`` decoder layers (device_map: its own; tp: all, each ÷ tp per
    Korthikanti eq. 2), with the logits when it computes them (÷ tp: vocab-parallel) and the LoRA adapters it holds
    (replicated under tp). Same formulas as :func:`_activations`."""
    s, b, nbytes = spec.seq_len, spec.batch_size, spec.dtype_bytes
    h, V = shape.hidden, shape.vocab
    split = f"/{tp} (vocab-parallel)" if tp > 1 else ""
    if not spec.training:
        if not logits:
            return Line("activations", 0, "inference: no logits on this device (no activations are saved)")
        size, text = _inference_logits(-(-b * s * V // tp), nbytes, f"{b}·{s}·{V:,}{split}")
        return Line("activations", size, f"{text} (no activations are saved)")
    per_layer, layer_text = _layer_activation_bytes(spec, shape, tp)
    if layers == 0:
        total, text = 0, "no decoder layer here"
    elif spec.gradient_checkpointing:
        total = layers * s * b * h * nbytes + per_layer
        text = (f"checkpointing: {_n_layers(layers)} x s·b·h x {nbytes} B (one input per layer) + one layer "
                f"{layer_text}")
    else:
        total = layers * per_layer
        text = f"Korthikanti et al. 2022: {_n_layers(layers)} x {layer_text}, h={h}, s={s}, b={b}"
    if logits:
        total += 2 * -(-b * s * V // tp) * LOGITS_BYTES
        text += f"; + fp32 logits kept for the loss 2 x b·s·V{split} x {LOGITS_BYTES} B (V={V:,})"
    else:
        text += "; no logits here"
    if adapters:
        extra, extra_text = _adapter_activations(spec, adapters)
        total += extra
        text += f"; + LoRA {extra_text}" + (" (replicated under tp)" if tp > 1 else "") + " (adapters save their own inputs)"
    return Line("activations", total, text)


def _kv_cache(spec: RunSpec, shape: _Shape) -> Line:
    """Inference: 2 (K, V) x layers x kv_heads x head_dim x b x s x dtype bytes (grouped-query attention: kv_heads =
    ``num_key_value_heads``; head_dim = ``head_dim`` or hidden / heads). Training runs with ``use_cache`` off."""
    if spec.training:
        return Line("kv_cache", 0, "training: use_cache off, no KV cache")
    nbytes = spec.dtype_bytes
    size = 2 * shape.layers * shape.kv_heads * shape.head_dim * spec.batch_size * spec.seq_len * nbytes
    return Line(
        "kv_cache",
        size,
        f"2 (K,V) x L x kv_heads x head_dim x b x s x {nbytes} B = 2 x {shape.layers} x {shape.kv_heads} x "
        f"{shape.head_dim} x {spec.batch_size} x {spec.seq_len} x {nbytes} B",
    )


def _kv_cache_part(spec: RunSpec, shape: _Shape, layers: int, tp: int) -> Line:
    """:func:`_kv_cache` for ``layers`` decoder layers with the KV heads ÷ ``tp`` (device_map: a device's own layers;
    tp: every layer, each device keeping its heads' K and V)."""
    if spec.training:
        return Line("kv_cache", 0, "training: use_cache off, no KV cache")
    nbytes = spec.dtype_bytes
    kv_heads = shape.kv_heads // tp
    size = 2 * layers * kv_heads * shape.head_dim * spec.batch_size * spec.seq_len * nbytes
    heads = f"kv_heads/{tp}" if tp > 1 else "kv_heads"
    return Line(
        "kv_cache",
        size,
        f"2 (K,V) x layers here x {heads} x head_dim x b x s x {nbytes} B = 2 x {layers} x {kv_heads} x "
        f"{shape.head_dim} x {spec.batch_size} x {spec.seq_len} x {nbytes} B",
    )


def _overhead(device: DeviceInfo, strategy: str = "single", n: int = 1) -> Line:
    """CUDA: CUDA context + cuBLAS workspace, 500 MiB per process per device (estimate), plus NCCL communicator
    buffers (:data:`NCCL_BUFFER_BYTES`, estimate) for strategies that run collectives on N >= 2 devices (ddp, zero*,
    tp; not device_map, which is one process). CPU: nothing planned."""
    if device.kind == "cuda":
        text = "CUDA context + cuBLAS workspace (estimate; 300-700 MB per process per device): 500 MiB"
        if strategy in ("single", "device_map") or n < 2:
            if strategy == "device_map":
                text += " (device_map: one process, a context on each device it uses; no NCCL)"
            return Line("overhead", CUDA_OVERHEAD_BYTES, text)
        return Line(
            "overhead",
            CUDA_OVERHEAD_BYTES + NCCL_BUFFER_BYTES,
            f"{text}; + NCCL communicator buffers for {strategy} over N={n} devices (estimate, not measured here): "
            f"{NCCL_BUFFER_BYTES // 2**20} MiB (NCCL_BUFFSIZE 4 MiB per channel, peer and protocol)",
        )
    return Line("overhead", 0, "no CUDA context on CPU; the Python/torch runtime is counted by the probe's RSS, not planned")
