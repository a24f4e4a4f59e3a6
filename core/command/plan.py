"""The plan of the user's job, made from what it ran (the Trainer hook's report), and its comparison per device.

:func:`spec_from_run` turns what the script's Trainer reported (its model config, micro-batch, the widest batch it
trained on, accumulation, the parameters' dtypes and the bf16/fp16 flags, gradient checkpointing, the optimizer, peft's
LoRA settings, the world size) into the :class:`~core.spec.RunSpec` gpuaccept's planner reads
(:func:`core.plan.memory.plan_memory`), each setting saying where it came from. What the planner does not model (a
partly frozen model without adapters, DeepSpeed, an optimizer or attention implementation it does not know) gives no
plan, with the reason. A script that reported no Trainer (measured from outside) gets no plan either: nothing says
what it holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import GpuAcceptError, SpecError
from core.methods import METHODS
from core.optim import named
from core.spec import ALL_LINEAR, ATTN_IMPLEMENTATIONS, RunSpec

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class RanSpec:
    """The spec of what ran, or why there is none.

    Attributes:
        spec: the RunSpec to plan (its ``model`` is the config the script's model ran with, written to a file).
        reason: why no plan is made (``spec`` None).
        sources: each setting and where it came from, in words.
        made_from: the Trainer's report, or the trainer's config file (:mod:`core.command.configplan`).
        ignored: the config keys not used, with why.
    """

    spec: RunSpec | None
    reason: str = ""
    sources: dict[str, str] = field(default_factory=dict)
    #: what the spec was made from, in words
    made_from: str = "the setup the Trainer reported"
    #: the config keys not used, with why (a spec made from a trainer's config file: core/command/configplan.py)
    ignored: dict[str, str] = field(default_factory=dict)


def spec_from_run(trainer: dict[str, Any] | None, batches: list[dict[str, Any]], config_path: Path,
                  steps_ran: int, nodes: tuple[int, str] | None = None) -> RanSpec:
    """The RunSpec of what the Trainer-based script ran (see the module docstring).

    Args:
        trainer: rank 0's ``trainer`` report of the hook (None: no Trainer reported itself).
        batches: the hook's ``batches`` events (widths of the micro-batches, padding seen).
        config_path: where to write the model's config (``config.json``) for the planner to read.
        steps_ran: optimizer steps the run made (when ``max_steps`` is not set).
        nodes: several nodes (``command.nnodes`` and its ``rdzv_endpoint``): the world size is shared among them,
            and this node's plan holds its own ranks (world size / nodes).
    """
    if trainer is None:
        return RanSpec(None, "measured from outside: the command reported no transformers Trainer (the Trainer hook "
                             "saw none), so nothing says which model, batch or optimizer it holds; its measured peaks "
                             "per device stand alone")
    args = trainer.get("arguments") or {}
    config = trainer.get("config")
    if not isinstance(config, dict) or not config.get("model_type"):
        return RanSpec(None, "the Trainer's model has no Hugging Face config to plan from")
    if args.get("deepspeed"):
        return RanSpec(None, "DeepSpeed runs the job (TrainingArguments.deepspeed): its ZeRO configuration is not read "
                             "by this version; the measured peaks stand alone")
    sources: dict[str, str] = {}
    try:
        values = {**_mode(trainer, sources), **_precision(trainer, args, sources), **_shape(args, batches, sources),
                  **_placement(trainer, args, sources, nodes), **_schedule(args, steps_ran, sources)}
    except _NotPlanned as exc:
        return RanSpec(None, str(exc), sources)
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(json.dumps(config, indent=2, default=str), encoding="utf-8")
    values["model"] = str(config_path)
    sources["model"] = f"the model's config as it ran ({trainer.get('model')}, {config.get('model_type')})"
    try:
        return RanSpec(RunSpec.build(**values), "", sources)
    except SpecError as exc:
        return RanSpec(None, f"what ran is not a setup the planner models ({exc})", sources)


class _NotPlanned(Exception):
    pass


def _mode(trainer: dict[str, Any], sources: dict[str, str]) -> dict[str, Any]:
    peft = trainer.get("peft")
    total, trainable = int(trainer.get("parameters", 0)), int(trainer.get("trainable_parameters", 0))
    if isinstance(peft, dict):
        if str(peft.get("peft_type", "")).upper() != "LORA":
            raise _NotPlanned(f"peft {peft.get('peft_type')} adapters: the planner models LoRA only")
        quant = trainer.get("quantization") or {}
        four_bit = isinstance(quant, dict) and bool(quant.get("load_in_4bit"))
        if isinstance(quant, dict) and quant.get("load_in_8bit"):
            raise _NotPlanned("an 8-bit base (load_in_8bit): the planner models 4-bit bases (QLoRA) only")
        targets = peft.get("target_modules")
        if isinstance(targets, str):
            if targets != ALL_LINEAR:
                raise _NotPlanned(f"LoRA target_modules {targets!r} is a pattern: the planner takes module names")
            targets = [ALL_LINEAR]
        options = peft.get("options") or {}
        variant = next((name for name, m in METHODS.items() if m.peft_options
                        and all(options.get(k) == v for k, v in m.peft_options.items())), None)
        if variant is not None and four_bit:
            raise _NotPlanned(f"the LoRA variant {variant} over a 4-bit base: the planner models one variant at a time")
        sources["mode"] = (f"a PeftModel with LoRA adapters{' over a 4-bit base' if four_bit else ''}"
                           + (f" ({', '.join(k for k in METHODS[variant].peft_options)})" if variant else ""))
        out: dict[str, Any] = {"mode": "qlora" if four_bit else variant or "lora", "lora_r": int(peft.get("r") or 8),
                               "lora_alpha": int(peft.get("lora_alpha") or 8),
                               "lora_dropout": float(peft.get("lora_dropout") or 0.0),
                               "lora_targets": ",".join(sorted(targets or []))}
        if four_bit:
            out["qlora_quant_type"] = quant.get("bnb_4bit_quant_type", "nf4")
            out["qlora_double_quant"] = bool(quant.get("bnb_4bit_use_double_quant", False))
        return out
    if trainable and trainable == total:
        sources["mode"] = f"every parameter trainable ({total:,})"
        return {"mode": "full"}
    raise _NotPlanned(f"{trainable:,} of {total:,} parameters trainable without a LoRA adapter (a partly frozen "
                      "model): not a mode the planner models")


def _precision(trainer: dict[str, Any], args: dict[str, Any], sources: dict[str, str]) -> dict[str, Any]:
    dtypes: dict[str, dict[str, int]] = trainer.get("parameter_dtypes") or {}
    side = "frozen" if trainer.get("peft") else "trainable"
    counts = {k: v.get(side, 0) for k, v in dtypes.items()}
    stored = max(counts, key=lambda k: counts[k]) if counts else "float32"
    flag = "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else None
    quant = trainer.get("quantization") or {}
    if isinstance(quant, dict) and quant.get("load_in_4bit"):
        compute = str(quant.get("bnb_4bit_compute_dtype", "float32")).replace("torch.", "")
        dtype = _DTYPES.get(compute, "fp32")
        sources["dtype"] = f"the 4-bit layers' compute dtype ({compute})"
        return {"dtype": dtype, "precision": "pure"}
    if stored not in _DTYPES and stored != "uint8":
        raise _NotPlanned(f"parameters stored in {stored}: not a dtype the planner models")
    base = _DTYPES.get(stored, "fp32")
    if base == "fp32" and flag:
        sources["dtype"] = f"fp32 parameters with Trainer's {flag}=True: autocast to {flag} (precision amp)"
        return {"dtype": flag, "precision": "amp"}
    sources["dtype"] = f"the {side} parameters are {stored}" + (f" (Trainer's {flag}=True)" if flag else "")
    return {"dtype": base, "precision": "pure"}


def _shape(args: dict[str, Any], batches: list[dict[str, Any]], sources: dict[str, str]) -> dict[str, Any]:
    widths = [w for b in batches for w in b.get("widths", [])]
    if not widths:
        raise _NotPlanned("the Trainer hook saw no training batch (no forward in training mode), so the sequence "
                          "length is unknown")
    padded = any(b.get("padded") for b in batches)
    sources["seq_len"] = (f"the widest micro-batch the model's forward received ({max(widths)} tokens; widths seen: "
                          f"{', '.join(map(str, sorted(set(widths))[:6]))})")
    sources["padding"] = ("padded: an attention mask with padding reached the model" if padded else
                          "packed: no attention mask with padding reached the model")
    sources["batch_size"] = "TrainingArguments.per_device_train_batch_size"
    return {"batch_size": int(args.get("per_device_train_batch_size") or 1), "seq_len": max(widths),
            "grad_accum": int(args.get("gradient_accumulation_steps") or 1),
            "padding": "padded" if padded else "packed"}


def _placement(trainer: dict[str, Any], args: dict[str, Any], sources: dict[str, str],
               nodes: tuple[int, str] | None = None) -> dict[str, Any]:
    attention = str(trainer.get("attn_implementation") or "sdpa")
    if attention not in ATTN_IMPLEMENTATIONS:
        raise _NotPlanned(f"attention implementation {attention!r}: the planner models {', '.join(ATTN_IMPLEMENTATIONS)}")
    optim = str(args.get("optim") or "adamw_torch")
    found = named("trainer", optim)  # Trainer's optim names, read by the optimizers' registry (core/optim/)
    if found is None:
        raise _NotPlanned(f"optimizer {optim!r} (TrainingArguments.optim): not one the planner models")
    optimizer = found.name
    sources["optimizer"] = f"TrainingArguments.optim = {optim} ({trainer.get('optimizer') or 'class not reported'})"
    world = int(trainer.get("world_size", 1))
    device = str(trainer.get("device", "cpu"))
    fsdp = args.get("fsdp")
    out: dict[str, Any] = {"optimizer": optimizer, "attn_implementation": attention,
                           "gradient_checkpointing": bool(args.get("gradient_checkpointing")
                                                          or trainer.get("gradient_checkpointing"))}
    nnodes, endpoint = nodes if nodes is not None and nodes[0] > 1 and world % nodes[0] == 0 else (1, "")
    local = world // nnodes  # this node's ranks
    if world > 1:
        out["strategy"] = "zero3" if fsdp else "ddp"
        sources["strategy"] = f"{world} ranks ({'FSDP' if fsdp else 'DDP'}: TrainingArguments.fsdp = {fsdp!r})"
        if device.startswith("cuda"):
            out["devices"] = ",".join(str(i) for i in range(local))
        else:
            out["devices"], out["torchrun_nproc_per_node"] = "cpu", local
        if nnodes > 1:
            out["torchrun_nnodes"], out["torchrun_rdzv_endpoint"] = nnodes, endpoint
            out["torchrun_nproc_per_node"] = local
    else:
        out["devices"] = "cpu" if not device.startswith("cuda") else device.split(":", 1)[-1] or "0"
    sources["devices"] = f"the Trainer's device {device}, world size {world}" + (
        f" over {nnodes} nodes (command.nnodes): {local} rank(s) on this node" if nnodes > 1 else "")
    return out


def _schedule(args: dict[str, Any], steps_ran: int, sources: dict[str, str]) -> dict[str, Any]:
    steps = int(args.get("max_steps") or 0)
    steps = steps if steps > 0 else max(steps_ran, 1)
    scheduler = str(args.get("lr_scheduler_type") or "linear")
    return {"steps": steps, "learning_rate": float(args.get("learning_rate") or 1e-3),
            "lr_scheduler": scheduler if scheduler in ("linear", "cosine", "constant") else "linear",
            "warmup_steps": int(args.get("warmup_steps") or 0) if isinstance(args.get("warmup_steps"), int) else 0,
            "resume_check": False}


@dataclass(frozen=True)
class DeviceComparison:
    """The plan of one device against what was measured there (bytes). ``error_pct`` = 100 x (planned - measured) /
    measured; ``compared`` says which measured quantity and which part of the plan."""

    device: str
    rank: int
    planned_bytes: int
    measured_bytes: int
    error_pct: float
    compared: str


def plan_for(ran: RanSpec) -> tuple[Any, str]:
    """The plan of ``ran.spec`` (:func:`core.prerun.make_plan`: per device, detected here), or (None, why not)."""
    from core.prerun import make_plan

    if ran.spec is None:
        return None, ran.reason
    try:
        return make_plan(ran.spec), ""
    except GpuAcceptError as exc:
        return None, f"the planner refused what ran: {exc}"


def compare(plan: Any, measured: list[dict[str, Any]]) -> list[DeviceComparison]:
    """Each measured rank against the plan of its device: on CUDA its peak allocated against the plan's tensors (the
    total without the overhead line: peak allocated holds no CUDA context); on the CPU its peak RSS against the
    plan's total (its runtime line included: the process competes for host memory as a whole).

    Args:
        measured: one mapping per rank: ``device``, ``rank``, ``peak_allocated_bytes``, ``nvml_used_bytes`` (from
            outside) or ``peak_rss_bytes``.
    """
    by_name = {d.device.name: d for d in plan.devices}
    out = []
    for m in measured:
        d = by_name.get(m["device"]) or (plan.devices[0] if len(plan.devices) == 1 else None)
        if d is None:
            continue
        if m["device"].startswith("cuda") and m.get("peak_allocated_bytes"):
            planned = d.total_bytes - d.lines["overhead"].bytes
            got, what = int(m["peak_allocated_bytes"]), "peak allocated (torch.cuda) vs the plan's tensors"
        elif m.get("nvml_used_bytes"):
            planned, got = d.total_bytes, int(m["nvml_used_bytes"])
            what = "NVML's memory of the job's processes (outside) vs the plan's total (CUDA context line included)"
        elif m.get("peak_rss_bytes"):
            planned, got = d.total_bytes, int(m["peak_rss_bytes"])
            what = "peak RSS of the rank's process vs the plan's total (runtime line included)"
        else:
            continue
        out.append(DeviceComparison(m["device"], int(m.get("rank", 0)), planned, got,
                                    100.0 * (planned - got) / got if got else 0.0, what))
    return out
