"""The child's recipe, top to bottom: build the model (LoRA wrapped), the data, and a Trainer that measures.

Read in order: :func:`build_model` loads the weights in the spec's dtype and wraps LoRA adapters; :func:`model_facts`
says what the model actually runs with; :func:`build_data` splits and tokenises the text into blocks;
:func:`build_trainer` puts them in a :class:`~core.child.callbacks.MeasuringTrainer` with the step reporter and the
kill switch (:mod:`core.child.callbacks`), configured by :func:`training_arguments`. The roles that use them are in
:mod:`core.child.worker`; the probe's own steps in :mod:`core.child.probe`. transformers and torch are imported where
they are used, so the worker's lifeline is set before the seconds of their import.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.dtypes import TORCH_DTYPE_NAMES
from core.protocol.events import EventWriter
from core.protocol.job import WorkerJob
from core.spec import RunSpec

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from core.child.callbacks import MeasuringTrainer



# ------------------------------------------------------------------------------------------------------ the model
def build_model(spec: RunSpec, model_path: str, device: str, device_map: Any = None) -> tuple[Any, Any]:
    """Load the model on ``device`` and wrap LoRA adapters when the mode is ``lora`` or ``qlora`` (over a 4-bit base:
    :func:`load_4bit`).

    With ``device_map`` (strategy device_map, inference) the weights are placed by accelerate as
    ``from_pretrained(device_map=...)`` does (``"balanced"``: whole decoder layers spread over the visible devices), not
    moved to ``device``.

    The parameters are loaded in ``spec.param_dtype`` (docs/reference.md "Precision"): the dtype under ``pure`` (LoRA
    adapters fp32: peft's ``autocast_adapter_dtype``), fp32 under ``amp`` (the master copy; Trainer autocasts to the
    16-bit dtype with ``bf16=True`` / ``fp16=True``). ``attn_implementation`` is passed to ``from_pretrained``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.methods.lora import lora_config

    kwargs = {"dtype": getattr(torch, TORCH_DTYPE_NAMES[spec.param_dtype]),
              "attn_implementation": spec.attn_implementation}
    if spec.method.takes("quant"):  # a base stored in 4 bits (QLoRA)
        model = load_4bit(spec, model_path, device, kwargs)
    elif device_map is not None:
        model = AutoModelForCausalLM.from_pretrained(model_path, device_map=device_map, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs).to(device)  # type: ignore[arg-type]
    model.config.use_cache = False if spec.training else model.config.use_cache
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if spec.adapters:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(spec.lora, spec.method.peft_options))
    if not spec.training:
        model.requires_grad_(False)
    if spec.gradient_checkpointing and spec.training:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if spec.adapters:
            model.enable_input_require_grads()
    return model, tokenizer


def load_4bit(spec: RunSpec, model_path: str, device: str, kwargs: dict[str, Any]) -> Any:
    """QLoRA's base: every linear layer of the decoder quantised to 4 bits by bitsandbytes as it loads
    (``BitsAndBytesConfig(load_in_4bit=True)``: ``bnb_4bit_quant_type`` and ``bnb_4bit_use_double_quant`` from the
    spec, ``bnb_4bit_compute_dtype`` its dtype), then peft's ``prepare_model_for_kbit_training``, as QLoRA recipes
    (TRL's, axolotl's) run it: every base parameter frozen, every 16-bit parameter not stored in 4 bits cast to fp32.
    Its gradient checkpointing is the spec's (peft's default would turn it on).

    On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight in place into a CPU-only layout the first time the
    layer runs in eval mode without gradients (``Linear4bit.forward``); a layer so repacked then runs its inference
    kernel, which has no backward, even in training. The evaluation runs in eval mode between training stages, so
    the repacking is turned off here: every forward runs the layout that is trained and checkpointed."""
    import torch
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=spec.qlora.quant_type,
        bnb_4bit_use_double_quant=spec.qlora.double_quant,
        bnb_4bit_compute_dtype=getattr(torch, TORCH_DTYPE_NAMES[spec.dtype]))
    load = dict(kwargs, dtype=getattr(torch, TORCH_DTYPE_NAMES[spec.dtype]))  # quantised from the weights in dtype
    model = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=quant, device_map={"": device},
                                                 **load)
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010 - a bitsandbytes attribute torch's typing does not know
    if spec.training:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # type: ignore[no-untyped-call]
    return model


def model_facts(spec: RunSpec, model: Any) -> dict[str, Any]:
    """What the model actually runs with: its attention implementation (the config's ``_attn_implementation``), its
    parameters by dtype, and for LoRA the short names of the modules peft adapted (``all-linear`` resolved) and how
    many modules that is."""
    from collections import Counter

    from core.child.measure import local_tensor

    dtypes: Counter[str] = Counter()
    for p in model.parameters():
        dtypes[str(p.dtype).removeprefix("torch.")] += local_tensor(p).numel()
    facts: dict[str, Any] = {"attention": str(getattr(model.config, "_attn_implementation", "") or ""),
                             "parameter_dtypes": dict(dtypes)}
    if spec.adapters:  # peft resolves all-linear to every module's full name: recorded by short name, counted
        adapted = [name for name, module in model.named_modules() if hasattr(module, "lora_A") and len(module.lora_A)]
        facts["lora_targets"] = sorted({name.rsplit(".", 1)[-1] for name in adapted})
        facts["lora_modules"] = len(adapted)
    return facts



# ------------------------------------------------------------------------------------------------------- the data
def build_data(spec: RunSpec, tokenizer: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Train blocks (all) and held-out blocks (at most ``eval_max_blocks``) of ``seq_len`` tokens, with split facts."""
    from core.data import load_documents, make_blocks, split_documents

    split = split_documents(load_documents(spec.data), spec.heldout_fraction)
    train = make_blocks(split.train, tokenizer, spec.seq_len)
    if spec.padding == "packed":  # no batch may hold padding: the partial last block is not trained on
        train = [b for b in train if all(b["attention_mask"])]
        if not train:
            from core.errors import DataError

            raise DataError(f"padding = packed: the training text gives no full block of {spec.seq_len} tokens; give "
                            "more text, a shorter seq_len, or padding = padded")
    # only what is evaluated is tokenised (and one block more, to tell whether the split holds more)
    heldout_all = make_blocks(split.heldout, tokenizer, spec.seq_len, max_blocks=spec.eval_max_blocks + 1)
    heldout = heldout_all[: spec.eval_max_blocks]  # evaluation time is bounded by eval_max_blocks
    info = {
        "train_documents": len(split.train),
        "heldout_documents": len(split.heldout),
        "train_blocks": len(train),
        "heldout_blocks": len(heldout_all),
        "heldout_blocks_evaluated": len(heldout),
        "heldout_selection": (f"the first {len(heldout)} held-out blocks (eval_max_blocks = {spec.eval_max_blocks}), "
                              "in document order; the rest of the held-out split is not tokenised"
                              if len(heldout_all) > len(heldout) else
                              f"all {len(heldout)} held-out blocks, in document order"),
        "train_hash": split.train_hash,
        "heldout_hash": split.heldout_hash,
        "split_method": split.method,
        "disjoint_check": split.disjoint_check,
    }
    return train, heldout, info


def collate(features: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    input_ids = torch.tensor([f["input_ids"] for f in features], dtype=torch.long)
    attention_mask = torch.tensor([f["attention_mask"] for f in features], dtype=torch.long)
    labels = input_ids.masked_fill(attention_mask == 0, -100)  # mask by position, never by token id (pad may be eos)
    sample_ids = torch.tensor([f["sample_id"] for f in features], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "sample_ids": sample_ids}


class ListDataset:
    """A map-style dataset over a list of blocks (Trainer needs ``__len__`` and ``__getitem__``)."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]



# ---------------------------------------------------------------------------------------------------- the trainer
def build_trainer(spec: RunSpec, model: Any, blocks: list[dict[str, Any]], out_dir: Path, device: str,
                  events: EventWriter, job: WorkerJob, max_steps: int | None = None, save: bool = True,
                  extra_callbacks: list[TrainerCallback] | None = None) -> MeasuringTrainer:
    """A :class:`~core.child.callbacks.MeasuringTrainer` over ``blocks`` that reports every optimizer step through
    ``events`` (:class:`~core.child.callbacks.StepReporter`) and holds at the interrupted run's kill point
    (:class:`~core.child.callbacks.KillSwitch`).

    Checkpoints every ``resume.checkpoint_every`` steps (and at the last step) when ``save``; ``max_steps`` (the
    probe's) replaces the spec's ``steps``; ``extra_callbacks`` run after the reporter (the probe's measuring one).
    """
    from core.child.callbacks import KillSwitch, MeasuringTrainer, StepReporter
    from core.protocol import faults

    fault = faults.active(job.role)
    kill_switch = KillSwitch(job, events, spec.grad_accum)
    reporter = StepReporter(events, kill_switch, stop_after=job.stop_after_step)
    trainer = MeasuringTrainer(
        model=model,
        args=training_arguments(spec, out_dir, device, job, max_steps, save, ignore_data_skip=fault == "data_restart"),
        train_dataset=ListDataset(blocks),
        data_collator=collate,
        callbacks=[reporter, *(extra_callbacks or [])],
        events=events,
        kill_switch=kill_switch,
        fault=fault,
    )
    reporter.trainer = trainer
    return trainer


def training_arguments(spec: RunSpec, out_dir: Path, device: str, job: WorkerJob, max_steps: int | None = None,
                       save: bool = True, ignore_data_skip: bool = False) -> Any:
    """Trainer's arguments for ``spec``: batch, accumulation, optimizer and schedule, checkpoints every
    ``resume.checkpoint_every`` steps when ``save`` (``job.save_steps`` when given: the twin of the resume check
    saves only at its last step; at most ``job.save_total_limit`` kept), the seeds, autocast (``bf16`` / ``fp16``
    when the spec autocasts), gloo for CPU ranks under torchrun, FSDP2 for zero3. ``ignore_data_skip``: a resume
    starts the data from its first sample (the planted fault ``data_restart``, :mod:`core.protocol.faults`)."""
    from transformers import TrainingArguments

    every = job.save_steps or (spec.resume.checkpoint_every if spec.resume.check else spec.steps)
    # zero3 = FSDP full shard (FSDP2, full state dict checkpoints). accelerate enables FSDP only on accelerators:
    # on the CPU this runs as DDP, which the probe reports from the wrapper it finds (core.stages.probe).
    fsdp: dict[str, Any] = ({"fsdp": True, "fsdp_config": {"version": 2, "reshard_after_forward": True}}
                            if spec.strategy == "zero3" else {})
    return TrainingArguments(
        output_dir=str(out_dir),
        max_steps=max_steps or spec.steps,
        per_device_train_batch_size=spec.batch_size,
        gradient_accumulation_steps=spec.grad_accum,
        learning_rate=spec.learning_rate,
        lr_scheduler_type=spec.lr_scheduler,
        warmup_steps=spec.warmup_steps,
        optim=spec.optimizer_kind.trainer_optim,
        optim_args=spec.optimizer_kind.optim_args or None,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="steps" if save else "no",
        save_steps=every,
        save_total_limit=job.save_total_limit,
        # several nodes: each node keeps a whole checkpoint in its own run folder (its local rank 0 writes the weights,
        # optimizer, scheduler and trainer state; every rank its RNG state), as on nodes without a shared filesystem
        save_on_each_node=spec.torchrun.nnodes > 1,
        seed=spec.seed,
        data_seed=spec.seed,
        report_to=[],
        ignore_data_skip=ignore_data_skip,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        use_cpu=device == "cpu",
        # several CPU processes under torchrun talk over gloo (NCCL is for CUDA devices)
        ddp_backend="gloo" if device == "cpu" and int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        # autocast to the 16-bit dtype (spec.autocast): over fp32 weights (amp), or a 16-bit model's fp32 adapters (pure)
        bf16=spec.autocast and spec.dtype == "bf16",
        fp16=spec.autocast and spec.dtype == "fp16",
        gradient_checkpointing=False,  # enabled on the model in build_model, once
        **fsdp,
    )
