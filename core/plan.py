"""The analytic memory plan: bytes per device and per component, before anything runs (DESIGN §3).

The model is built on the meta device from its config (no weights are read or allocated), so a 70B model plans in well
under a second on a laptop. Parameter counts and shapes come from that meta model; everything else is a formula of the
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

Nothing here imports torch, transformers or peft at module import; functions import them when called.
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass
from typing import Any

from core.errors import SpecError
from core.spec import DTYPE_BYTES, LoraSettings, RunSpec, parse_devices

COMPONENTS = ("weights", "gradients", "optimizer_states", "activations", "temporaries", "overhead", "kv_cache")

#: Per-process, per-device CUDA context + cuBLAS workspace estimate (DESIGN §3: 300-700 MB; lazy module loading).
CUDA_OVERHEAD_BYTES = 500 * 2**20
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
        strategy: how the run is spread over devices; ``"single"``: each device holds the whole run.
        convention: one paragraph stating the accounting convention.
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
    "attention scores) unless the config asks for eager attention, plus fp32 logits for the loss; LoRA does not "
    "shrink them. Inference holds weights, the KV cache and one layer's working set. The CUDA context and cuBLAS "
    "workspace are a separate overhead line (estimate)."
)


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


def count_parameters(config: Any, mode: str, lora: LoraSettings | None) -> ParameterCount:
    """Parameter counts from the meta model (see :class:`ParameterCount`).

    ``total`` counts each parameter once (``Module.parameters()`` skips tied duplicates), LM head included; for LoRA it
    includes the adapters and ``trainable`` is peft's own ``get_nb_trainable_parameters()``.
    """
    model = build_meta_model(config, mode, lora)
    return _summarise(model, mode).count


def linear_module_names(config: Any) -> set[str]:
    """Short names (``q_proj``, ``down_proj``, ``lm_head`` ...) of the modules LoRA can target.

    These are ``torch.nn.Linear`` modules and transformers' GPT-2-style ``Conv1D`` (peft adapts both).
    """
    model = build_meta_model(config, "full", None)
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if name and _is_linear(module)}


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
class _Summary:
    """What the plan needs from the meta model."""

    count: ParameterCount
    weight_groups: dict[str, int]  # dtype name -> number of parameters
    grad_groups: dict[str, int]  # dtype name -> number of trainable parameters
    trainable_shapes: tuple[tuple[int, ...], ...]
    adapters: tuple[_Adapter, ...]


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
    return _Summary(ParameterCount(total, trainable), weight_groups, grad_groups, tuple(shapes), tuple(adapters))


# ---------------------------------------------------------------------------------------------------------- devices
def detect_devices(devices: str) -> list[DeviceInfo]:
    """The devices named by a spec's ``devices`` setting, with their capacity.

    - ``"cpu"``: the host, capacity = ``psutil.virtual_memory().available`` (bytes free for a new process now);
    - ``"auto"``: every visible CUDA device if ``torch.cuda.is_available()``, else the host CPU;
    - ``"0,1"`` / ``"cuda:0"``: those CUDA devices, capacity = ``torch.cuda.get_device_properties(i).total_memory``,
      or ``None`` (with ``capacity_source`` saying why) when CUDA is unavailable or the index is not visible.

    Raises:
        SpecError: ``devices`` is none of the forms above.
    """
    names = parse_devices(devices)
    if names == ["cpu"]:
        return [_host_device()]
    import torch

    cuda = torch.cuda.is_available()
    if names == ["auto"]:
        if not cuda:
            return [_host_device()]
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


def _host_device() -> DeviceInfo:
    import psutil

    return DeviceInfo("cpu", "cpu", "host CPU", int(psutil.virtual_memory().available), "available host memory (psutil)")


# ------------------------------------------------------------------------------------------------------------- plan
def plan_memory(
    spec: RunSpec, config: Any, devices: list[DeviceInfo], parameters: ParameterCount | None = None
) -> MemoryPlan:
    """Plan the memory of ``spec`` on each device (strategy ``single``: each device holds the whole run).

    Args:
        spec: the run; ``batch_size`` is the micro-batch per device.
        config: the model's ``transformers.PretrainedConfig``.
        devices: from :func:`detect_devices` (or made by hand).
        parameters: counts already computed by :func:`count_parameters` for this spec, to report as they are; the meta
            model is built here anyway (in the spec dtype) for parameter dtypes and shapes.

    Returns:
        a :class:`MemoryPlan` whose device plans hold a :class:`Line` for every name in :data:`COMPONENTS`.
    """
    # Mixed precision: training keeps fp32 parameters (master weights) and autocasts; inference loads in the dtype.
    param_dtype = "fp32" if spec.training else spec.dtype
    model = build_meta_model(config, spec.mode, spec.lora if spec.mode == "lora" else None, param_dtype)
    summary = _summarise(model, spec.mode)
    del model
    counts = parameters if parameters is not None else summary.count
    shape = _Shape.of(config)
    common = {
        "weights": _weights(summary),
        "gradients": _gradients(spec, summary),
        "optimizer_states": _optimizer_states(spec, summary),
        "activations": _activations(spec, shape, summary),
        "temporaries": _temporaries(spec, shape, summary),
        "kv_cache": _kv_cache(spec, shape),
    }
    plans = []
    for device in devices:
        lines = dict(common, overhead=_overhead(device))
        plans.append(DevicePlan(device, {name: lines[name] for name in COMPONENTS}))
    return MemoryPlan(counts, plans, "single", CONVENTION)


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
    return " + ".join(f"{n:,} x {DTYPE_BYTES.get(d, 4)} B ({d})" for d, n in sorted(groups.items(), key=lambda kv: -kv[1]))


def _group_bytes(groups: dict[str, int]) -> int:
    return sum(n * DTYPE_BYTES.get(d, 4) for d, n in groups.items())


def _weights(summary: _Summary) -> Line:
    """weights = P x bytes of each parameter's dtype (the spec dtype; LoRA adapters fp32)."""
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


def _layer_activation_bytes(spec: RunSpec, shape: _Shape) -> tuple[int, str]:
    """One layer's saved activations, Korthikanti et al. 2022 eq. (1): ``s·b·h·(34 + 5·a·s/h)`` bytes in 16-bit, scaled by
    dtype bytes / 2; the ``5·a·s/h`` score term only with eager attention. Returns (bytes, formula text)."""
    s, b, h, a, nbytes = spec.seq_len, spec.batch_size, shape.hidden, shape.heads, spec.dtype_bytes
    per_layer = s * b * h * KORTHIKANTI_SBH_BYTES_16BIT * nbytes // 2
    if shape.materialises_scores:
        per_layer += 5 * a * s * s * b * nbytes // 2
        text = f"s·b·h·(34 + 5·a·s/h) x {nbytes}/2 B (eager attention keeps the a·s·s scores)"
    else:
        text = f"s·b·h·34 x {nbytes}/2 B ({shape.attention} attention assumed fused: no saved scores)"
    return per_layer, text


def _activations(spec: RunSpec, shape: _Shape, summary: _Summary) -> Line:
    """Training: L layers of Korthikanti activations (or, with gradient checkpointing, one s·b·h input per layer plus one
    full layer), fp32 logits twice (b·s·V·4 B x 2), and for LoRA each adapter's input and rank-r intermediate.
    Inference: the logits of a full forward pass, b·s·V x dtype bytes."""
    s, b, nbytes = spec.seq_len, spec.batch_size, spec.dtype_bytes
    L, h, V = shape.layers, shape.hidden, shape.vocab
    if not spec.training:
        logits = b * s * V * nbytes
        return Line(
            "activations",
            logits,
            f"inference: logits of a full forward pass b·s·V x {nbytes} B = {b}·{s}·{V:,} x {nbytes} B "
            "(no activations are saved; one layer's working set is under temporaries)",
        )
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
        text += f"; + LoRA {extra_text} (LoRA does not shrink activations)"
    return Line("activations", total, text)


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


def _temporaries(spec: RunSpec, shape: _Shape, summary: _Summary) -> Line:
    """Training: the optimizer step's transient buffers (foreach AdamW ≈ one more state, T x 4 B; Adafactor ≈ two fp32
    copies of the largest trainable tensor; SGD none) plus the fp32 logits gradient b·s·V x 4 B.
    Inference: one layer's working set (one layer of Korthikanti activations)."""
    if not spec.training:
        per_layer, layer_text = _layer_activation_bytes(spec, shape)
        return Line("temporaries", per_layer, f"inference: one layer's working set, {layer_text}")
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
    return Line("temporaries", step + logits_grad, f"{step_text}; + fp32 logits gradient b·s·V x {LOGITS_BYTES} B")


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


def _overhead(device: DeviceInfo) -> Line:
    """CUDA: CUDA context + cuBLAS workspace, 500 MiB per process per device (estimate). CPU: nothing planned."""
    if device.kind == "cuda":
        return Line(
            "overhead",
            CUDA_OVERHEAD_BYTES,
            "CUDA context + cuBLAS workspace (estimate; 300-700 MB per process per device): 500 MiB",
        )
    return Line("overhead", 0, "no CUDA context on CPU; the Python/torch runtime is counted by the probe's RSS, not planned")
