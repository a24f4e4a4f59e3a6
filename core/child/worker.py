"""The child process: one readable recipe that builds the model, runs real steps and reports what it measured.

Run as ``python -m core.child.worker JOB.json``; started by :mod:`core.stages.childproc` in its own process group with stdin from
/dev/null and stdout/stderr to a log file. It talks to the parent only through the JSON-lines events file named in the job.

Roles (``job["role"]``):

- ``probe``: ``probe_steps`` real steps (Trainer + PEFT for training, forward passes under ``torch.no_grad`` for
  inference) with a measuring callback; emits a measured ledger per device.
- ``evaluate``: held-out perplexity of the fixed weights (inference mode).
- ``train``: held-out perplexity before, ``steps`` optimizer steps with Trainer checkpoints, perplexity after. This run is
  also the reference of the resume check.
- ``interrupted``: the same training (from ``resume_from`` when given: a copy of the reference's checkpoint before c);
  once step ``kill_step`` is done it emits ``kill_point`` and holds there until the parent SIGKILLs its process group
  (so the kill lands after checkpoint c and before the next on any machine speed).
- ``resumed``: the same training resumed with ``resume_from_checkpoint``, stopped after ``stop_after_step``.

Every training role emits one ``step`` event per optimizer step: global step, epoch, the learning rate applied, the loss
(mean over the micro-batches of the step, unrounded) and the sample ids consumed.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
import time
from pathlib import Path
from typing import Any

from core.child.lifeline import exit_with_parent
from core.events import EventWriter
from core.spec import TORCH_DTYPE_NAMES, RunSpec

_TRAINER_OPTIM = {"adamw": "adamw_torch", "sgd": "sgd", "adafactor": "adafactor"}


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    exit_with_parent()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1  # launched by torchrun (core.stages.childproc, nproc > 1)
    events = EventWriter(job["events"], int(os.environ["RANK"]) if distributed else None,
                         int(os.environ["LOCAL_RANK"]) if distributed else None)
    try:
        run_job(job, events)
        _close_process_group()
    except BaseException as exc:  # the parent reads this event; the traceback goes to the child's log
        import traceback

        traceback.print_exc()
        events.emit("error", error=f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        events.close()
    return 0


def _close_process_group() -> None:
    """Under torchrun: wait for every rank, then destroy the process group before the interpreter exits (a gloo
    group left to interpreter teardown can abort the process with "terminate called without an active exception",
    an exit status torchrun reports as a failure)."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_job(job: dict[str, Any], events: EventWriter) -> None:
    import torch
    from transformers import set_seed
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    spec = RunSpec.from_dict(job["spec"])
    role = job["role"]
    device, name = rank_device(job)
    rss_start = _rss_bytes()
    events.emit("started", role=role, pid=os.getpid(), pgid=os.getpgid(0), device=name, torch=torch.__version__,
                host=socket.gethostname(), **rank_info())
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        events.emit("device_uuid", device=name, uuid=str(torch.cuda.get_device_properties(device).uuid))

    set_seed(spec.seed)
    device_map = job.get("device_map") or ("balanced" if spec.strategy == "device_map" else None)
    if device_map is not None:
        device = "cuda:0" if name.startswith("cuda") else "cpu"  # the first device: where the inputs go
    model, tokenizer = build_model(spec, job["model_path"], device, device_map)
    events.emit("model_built", **model_facts(spec, model))
    train_blocks, heldout_blocks, data_info = build_data(spec, tokenizer)
    events.emit("data", **data_info)

    if role == "probe":
        probe(spec, model, tokenizer, train_blocks, Path(job["output_dir"]), device, events, job, rss_start, name)
        return

    from core.child.evaluate import evaluate_perplexity

    if role in ("train", "evaluate"):
        before = evaluate_perplexity(model, heldout_blocks, spec.batch_size, device=device,
                                     autocast=spec.dtype if spec.autocast else None)
        events.emit("evaluation", when="before", **_eval_dict(before))
        if role == "evaluate":  # inference: fixed weights, evaluated once
            return
    trainable = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    events.emit("trainable", names=[n for n, _ in trainable], parameters=sum(k for _, k in trainable))
    out_dir = Path(job["output_dir"])
    trainer = build_trainer(spec, model, tokenizer, train_blocks, out_dir, device, events, job)
    if not _checkpoint_intact(job, events, "before_load"):
        return  # the parent fails the check, naming the files; nothing changed is loaded
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=job.get("resume_from"))
    train_s = time.perf_counter() - started
    _checkpoint_intact(job, events, "after_load")
    events.emit("trained", seconds=train_s, global_step=trainer.state.global_step, output_dir=str(out_dir))
    if role == "train":
        after = evaluate_perplexity(model, heldout_blocks, spec.batch_size, device=device,
                                    autocast=spec.dtype if spec.autocast else None)
        events.emit("evaluation", when="after", **_eval_dict(after))


def _checkpoint_intact(job: dict[str, Any], events: EventWriter, when: str) -> bool:
    """Verify the checkpoint resumed from (``job["resume_from"]``) against the parent's sha256 manifest
    (``job["manifest"]``), in this process: ``before_load`` right before Trainer reads the files, ``after_load`` once
    its run is over. Emits ``manifest`` {when, files, bad}; True when nothing changed (or there is nothing to check)."""
    if not job.get("resume_from") or not job.get("manifest"):
        return True
    from core.child.manifest import read_manifest, verify_manifest

    manifest = read_manifest(Path(job["manifest"]))
    bad = verify_manifest(Path(job["resume_from"]), manifest)
    events.emit("manifest", when=when, files=len(manifest), bad=bad)
    return not bad


def rank_info() -> dict[str, int]:
    """This process's place under torchrun (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``GROUP_RANK`` = the node's
    rank, from torch.distributed.run's environment); a single process is rank 0 of 1."""
    env = os.environ
    return {"global_rank": int(env.get("RANK", 0)), "local_rank": int(env.get("LOCAL_RANK", 0)),
            "world_size": int(env.get("WORLD_SIZE", 1)), "node_rank": int(env.get("GROUP_RANK", 0))}


def rank_device(job: dict[str, Any]) -> tuple[str, str]:
    """(torch device, reported name) of this rank.

    One process: ``job["device"]`` for both. Under torchrun each rank takes the device of its local rank: on the CPU
    ``"cpu"``, reported ``cpu:<local rank>`` (the ranks share the host); on CUDA the parent restricted
    ``CUDA_VISIBLE_DEVICES`` to the devices named in ``job["devices"]``, so the torch device is ``cuda:<local rank>``
    and the name reported is the one planned (``job["devices"][local rank]``)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and "LOCAL_RANK" not in os.environ:
        return job["device"], job["device"]
    local = int(os.environ.get("LOCAL_RANK", "0"))
    names = job.get("devices") or [job["device"]]
    name = names[local] if local < len(names) else f"{job['device']}:{local}"
    if name.startswith("cuda"):
        return f"cuda:{local}", name
    return "cpu", name


# ----------------------------------------------------------------------------------------------------------- building
def build_model(spec: RunSpec, model_path: str, device: str, device_map: Any = None) -> tuple[Any, Any]:
    """Load the model on ``device`` and wrap LoRA adapters when the mode is ``lora``.

    With ``device_map`` (strategy device_map, inference) the weights are placed by accelerate as
    ``from_pretrained(device_map=...)`` does (``"balanced"``: whole decoder layers spread over the visible devices), not
    moved to ``device``.

    The parameters are loaded in ``spec.param_dtype`` (README "Precision"): the dtype under ``pure`` (LoRA adapters
    fp32: peft's ``autocast_adapter_dtype``), fp32 under ``amp`` (the master copy; Trainer autocasts to the 16-bit
    dtype with ``bf16=True`` / ``fp16=True``). ``attn_implementation`` is passed to ``from_pretrained``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.plan.memory import lora_config

    kwargs = {"dtype": getattr(torch, TORCH_DTYPE_NAMES[spec.param_dtype]),
              "attn_implementation": spec.attn_implementation}
    if device_map is not None:
        model = AutoModelForCausalLM.from_pretrained(model_path, device_map=device_map, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs).to(device)  # type: ignore[arg-type]
    model.config.use_cache = False if spec.training else model.config.use_cache
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if spec.mode == "lora":
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(spec.lora))
    if spec.mode == "inference":
        model.requires_grad_(False)
    if spec.gradient_checkpointing and spec.training:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if spec.mode == "lora":
            model.enable_input_require_grads()
    return model, tokenizer


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
    if spec.mode == "lora":  # peft resolves all-linear to every module's full name: recorded by short name, counted
        adapted = [name for name, module in model.named_modules() if hasattr(module, "lora_A") and len(module.lora_A)]
        facts["lora_targets"] = sorted({name.rsplit(".", 1)[-1] for name in adapted})
        facts["lora_modules"] = len(adapted)
    return facts


def build_data(spec: RunSpec, tokenizer: Any) -> tuple[list[dict], list[dict], dict[str, Any]]:
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


def _collate(features: list[dict]) -> dict[str, Any]:
    import torch

    input_ids = torch.tensor([f["input_ids"] for f in features], dtype=torch.long)
    attention_mask = torch.tensor([f["attention_mask"] for f in features], dtype=torch.long)
    labels = input_ids.masked_fill(attention_mask == 0, -100)  # mask by position, never by token id (pad may be eos)
    sample_ids = torch.tensor([f["sample_id"] for f in features], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "sample_ids": sample_ids}


def build_trainer(spec, model, tokenizer, blocks, out_dir: Path, device: str, events: EventWriter, job: dict,
                  max_steps: int | None = None, save: bool = True, extra_callbacks: list | None = None):
    """A transformers Trainer over ``blocks`` that reports every optimizer step through ``events``.

    Checkpoints every ``resume.checkpoint_every`` steps (and at the last step) when ``save``.
    """
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from core.child.rng import live_rng_state, rng_digest

    kill = (job["kill_at"], job["kill_step"]) if job["role"] == "interrupted" else None
    stop_after = job.get("stop_after_step")  # the resumed run of the resume check: the last step it compares

    def maybe_kill(trainer, where: str) -> None:
        """Hold at the kill point (``resume.kill_at``) so the parent SIGKILLs this process group there."""
        if kill is None:
            return
        at, k = kill
        step, done = trainer.state.global_step, len(MeasuringTrainer.micro)
        n = getattr(trainer, "current_gradient_accumulation_steps", spec.grad_accum)
        hit = {
            "boundary": where == "step_end" and step == k,
            "boundary-1": where in ("step_begin", "micro") and step == k - 1 and done == n - 1,
            "boundary+1": where == "micro" and step == k and done == 1,
            "checkpoint-write": where == "save" and step == k,
        }.get(at, False)
        if hit:
            events.emit("kill_point", step=step, where=where, micro_done=done, micro_in_step=n)
            while True:  # hold: the parent kills this process group now
                time.sleep(0.05)

    class MeasuringTrainer(Trainer):
        """Trainer that records, per micro-batch, the sample ids fed to the model and the unrounded loss, reports the
        random generators right after a checkpoint's RNG state is restored, and holds at the interrupted run's kill
        point (a private hook of Trainer each: ``_load_rng_state``, ``_save_optimizer_and_scheduler``)."""

        micro: list[tuple[list[int], float]] = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            ids = inputs.pop("sample_ids").tolist()
            loss = super().training_step(model, inputs, num_items_in_batch)
            MeasuringTrainer.micro.append((ids, float(loss)))
            maybe_kill(self, "micro")
            return loss

        def _load_rng_state(self, checkpoint):
            super()._load_rng_state(checkpoint)
            if checkpoint is not None:
                events.emit("rng_restored", digest=rng_digest(live_rng_state()), checkpoint=str(checkpoint))

        def _save_optimizer_and_scheduler(self, output_dir):
            maybe_kill(self, "save")  # weights are written, optimizer and the rest not: a partial checkpoint
            super()._save_optimizer_and_scheduler(output_dir)

    class StepReporter(TrainerCallback):
        def __init__(self) -> None:
            self.lr: float | None = None
            self.rng: dict[str, str] | None = None
            self.trainer: Any = None  # the Trainer it reports for (set once the Trainer is built)

        def on_step_begin(self, args, state, control, **kw):
            self.rng = rng_digest(live_rng_state())  # the generators as this optimizer step starts
            maybe_kill(self.trainer, "step_begin")

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
            self.lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None

        def on_step_end(self, args, state, control, **kw):
            micro, MeasuringTrainer.micro = MeasuringTrainer.micro, []
            events.emit(
                "step",
                step=state.global_step,
                epoch=float(state.epoch or 0.0),
                learning_rate=self.lr,
                loss=sum(loss for _, loss in micro),
                sample_ids=[i for ids, _ in micro for i in ids],
                rng=self.rng,
            )
            maybe_kill(self.trainer, "step_end")
            if stop_after is not None and state.global_step >= stop_after:
                # the resume check's window ends here (a checkpoint step: Trainer still saves it, then stops);
                # max_steps stays the spec's, so the learning-rate schedule is the uninterrupted run's
                control.should_training_stop = True

        def on_save(self, args, state, control, **kw):
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            events.emit("checkpoint", step=state.global_step, path=str(path))

    every = spec.resume.checkpoint_every if spec.resume.check else spec.steps
    # zero3 = FSDP full shard (FSDP2, full state dict checkpoints). accelerate enables FSDP only on accelerators:
    # on the CPU this runs as DDP, which the probe reports from the wrapper it finds (core.stages.probe).
    fsdp: dict[str, Any] = ({"fsdp": True, "fsdp_config": {"version": 2, "reshard_after_forward": True}}
                            if spec.strategy == "zero3" else {})
    args = TrainingArguments(
        output_dir=str(out_dir),
        max_steps=max_steps or spec.steps,
        per_device_train_batch_size=spec.batch_size,
        gradient_accumulation_steps=spec.grad_accum,
        learning_rate=spec.learning_rate,
        lr_scheduler_type=spec.lr_scheduler,
        warmup_steps=spec.warmup_steps,
        optim=_TRAINER_OPTIM[spec.optimizer],
        optim_args="momentum=0.9" if spec.optimizer == "sgd" else None,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="steps" if save else "no",
        save_steps=every,
        save_total_limit=job.get("save_total_limit"),
        seed=spec.seed,
        data_seed=spec.seed,
        report_to=[],
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
    reporter = StepReporter()
    trainer = MeasuringTrainer(
        model=model,
        args=args,
        train_dataset=_ListDataset(blocks),
        data_collator=_collate,
        callbacks=[reporter, *(extra_callbacks or [])],
    )
    reporter.trainer = trainer
    return trainer


class _ListDataset:
    """A map-style dataset over a list of blocks (Trainer needs ``__len__`` and ``__getitem__``)."""

    def __init__(self, items: list[dict]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


# ------------------------------------------------------------------------------------------------------------ probe
def probe(spec: RunSpec, model, tokenizer, blocks: list[dict], out_dir: Path, device: str, events: EventWriter,
          job: dict, rss_start: int, name: str | None = None) -> None:
    """Run ``probe_steps`` real steps and emit the measured ledger (``ledger`` event) and the placement.

    Training modes run Trainer steps (its own optimizer and schedule) with a callback that counts gradients at the
    optimizer step and optimizer states after it from the live tensors; inference runs forward passes under
    ``torch.no_grad`` (not ``inference_mode``: under it a composite op such as ``cross_entropy_loss`` reaches the CPU
    tracker whole, and the ``log_softmax`` it allocates inside is not seen; the bytes are the same). On CUDA the
    allocator's peak allocated and reserved are read; on CPU a
    :class:`~core.child.measure.LiveTensorTracker` follows the step's tensors. With ``padding = padded`` every block's last
    position is padding (:func:`padded_blocks`): each step is one of a batch holding padding, as the plan counts.
    """
    import torch
    from transformers import TrainerCallback

    from core.child.measure import LiveTensorTracker, optimizer_state_bytes, parameter_placement

    if spec.padding == "padded":
        blocks = padded_blocks(blocks)
    names = job.get("devices") or [name or device]
    # accelerate sets hf_device_map only for a map over several devices; a one-device map is the whole model there
    hf_map = getattr(model, "hf_device_map", None) or (
        {"": device} if job.get("device_map") or spec.strategy == "device_map" else None)
    if hf_map is not None:  # device_map: torch's cuda:i is the i-th device named (CUDA_VISIBLE_DEVICES)
        rename = {f"cuda:{i}": n for i, n in enumerate(names) if n.startswith("cuda")}
        if not rename:
            rename = {"cpu": names[0]}
    else:
        rename = {device: name} if name else {}
    placement = {rename.get(k, k): v for k, v in parameter_placement(model).items()}
    events.emit("placement", devices=placement)
    if hf_map is not None:
        events.emit("device_map", layers=layer_placement(hf_map, rename))
    weights = sum(d["bytes"] for d in placement.values())
    rss_loaded = _rss_bytes()
    is_cuda = device.startswith("cuda")
    if is_cuda:
        torch.cuda.synchronize()
        for i in range(torch.cuda.device_count()):  # device_map: every device the model is on
            torch.cuda.reset_peak_memory_stats(i)
    tracker = None if is_cuda else LiveTensorTracker(baseline_bytes=weights)
    seen = {"gradients": 0, "optimizer_states": 0}
    step_times: list[float] = []
    n = spec.probe_steps

    fsdp2_cpu = (spec.training and spec.strategy == "zero3" and not is_cuda
                 and int(os.environ.get("WORLD_SIZE", "1")) > 1)
    if fsdp2_cpu:
        wrapper, local_weights = _fsdp2_cpu_steps(spec, model, blocks, tracker, seen, step_times, events,
                                                  name or device)
    elif spec.training:

        class ProbeCallback(TrainerCallback):
            def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
                self.started = time.perf_counter()
                if tracker is not None:  # what is alive as the step starts, counted once from the live tensors
                    tracker.restart(weights + optimizer_state_bytes(optimizer) + _gradient_bytes(model))
                    tracker.__enter__()

            def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
                seen["gradients"] = max(seen["gradients"], _gradient_bytes(model))

            def on_step_end(self, args, state, control, optimizer=None, **kw):
                if tracker is not None:
                    tracker.__exit__(None, None, None)
                if is_cuda:
                    torch.cuda.synchronize()
                step_times.append(time.perf_counter() - self.started)
                seen["optimizer_states"] = optimizer_state_bytes(optimizer)
                events.emit("probe_step", step=state.global_step, total=n, seconds=step_times[-1])

        trainer = build_trainer(spec, model, tokenizer, blocks, out_dir, device, events, job,
                                max_steps=n, save=False, extra_callbacks=[ProbeCallback()])
        trainer.train()
        # what the run was actually wrapped in (Trainer may fall back, e.g. FSDP requested on CPU runs as DDP)
        wrapper = type(trainer.model_wrapped).__name__
        # this rank's share of the weights after wrapping (FSDP keeps a shard of each parameter, DDP all of them)
        local_weights = sum(_local_bytes(p) for p in trainer.model_wrapped.parameters())
    else:
        batch = _collate(blocks[: spec.batch_size])
        batch.pop("sample_ids")
        batch = {k: v.to(device) for k, v in batch.items()}
        model.eval()
        with torch.no_grad():  # not inference_mode: see the docstring
            for step in range(1, n + 1):
                started = time.perf_counter()
                if tracker is not None:
                    tracker.__enter__()
                try:
                    out = model(**batch)
                    del out
                finally:
                    if tracker is not None:
                        tracker.__exit__(None, None, None)
                if is_cuda:
                    torch.cuda.synchronize()
                step_times.append(time.perf_counter() - started)
                events.emit("probe_step", step=step, total=n, seconds=step_times[-1])
    if not spec.training:
        wrapper, local_weights = "none (inference, one process)", weights
    steady = step_times[1:] or step_times  # the first step pays one-off allocations and kernel choices
    step_s = sum(steady) / len(steady)
    tokens = spec.batch_size * spec.seq_len * (spec.grad_accum if spec.training else 1)
    ledger: dict[str, Any] = {
        "device": name or device,
        "host": socket.gethostname(),
        **rank_info(),
        "weights_bytes": local_weights,
        "weights_loaded_bytes": weights,
        "gradients_bytes": seen["gradients"],
        "optimizer_states_bytes": seen["optimizer_states"],
        "step_time_s": step_s,
        "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
        "steps": n,
        "rss_start_bytes": rss_start,
        "rss_after_load_bytes": rss_loaded,
        "peak_rss_bytes": _peak_rss_bytes(),
        "wrapper": wrapper,
        "torch_threads": torch.get_num_threads(),  # torchrun sets OMP_NUM_THREADS=1 per rank unless it is set
    }
    if is_cuda:
        ledger["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
        ledger["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
    if hf_map is not None and is_cuda:  # one process, several devices: a peak on each
        ledger["per_device"] = [
            {"device": n, "weights_bytes": placement.get(n, {}).get("bytes", 0),
             "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(i)),
             "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(i))}
            for i, n in enumerate(names)]
    else:
        assert tracker is not None  # no CUDA: the CPU tracker followed the step
        ledger["peak_tracked_tensor_bytes"] = tracker.peak_bytes
        ledger["tracked_method"] = tracker.method
    events.emit("ledger", **ledger)
    _gather_ledgers(ledger, events)


def padded_blocks(blocks: list[dict]) -> list[dict]:
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


def _fsdp2_cpu_steps(spec: RunSpec, model, blocks: list[dict], tracker, seen: dict[str, int],
                     step_times: list[float], events: EventWriter, name: str) -> tuple[str, int]:
    """zero3 (FSDP full shard) on the CPU: ``probe_steps`` steps under torch's FSDP2 over gloo, outside Trainer.

    accelerate enables FSDP only on accelerators, so Trainer on the CPU runs DDP instead; to measure the sharding the
    plan divides by N, the probe shards the model itself with ``torch.distributed.fsdp.fully_shard`` (each decoder
    layer, ``_no_split_modules``, then the root, as Trainer's transformer-based wrap does) and runs the spec's
    optimizer over this rank's shard: rank r takes blocks r, r + N, ... (as a DistributedSampler without shuffling).
    Measured as the Trainer path is: gradients before the optimizer step, optimizer states after it, live tensors
    (local shards) in the step.

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

    if spec.optimizer not in ("adamw", "sgd"):
        raise SpecError("optimizer", "the CPU zero3 probe (FSDP2 outside Trainer) runs adamw or sgd; choose one, or "
                                     "probe zero3 on CUDA devices")
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
    events.emit("placement", devices={name: placed["cpu"]})
    params = [p for p in model.parameters() if p.requires_grad]
    opt: torch.optim.Optimizer
    if spec.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=spec.learning_rate, weight_decay=0.0)
    else:
        opt = torch.optim.SGD(params, lr=spec.learning_rate, momentum=0.9)
    local_weights = sum(tensor_bytes(p) for p in model.parameters())
    mine = blocks[rank::world] or blocks
    model.train()
    i = 0
    for step in range(1, spec.probe_steps + 1):
        started = time.perf_counter()
        tracker.restart(local_weights + optimizer_state_bytes(opt) + _gradient_bytes(model))
        tracker.__enter__()
        try:
            for _ in range(spec.grad_accum):
                batch = _collate([mine[(i + j) % len(mine)] for j in range(spec.batch_size)])
                i += spec.batch_size
                batch.pop("sample_ids")
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.autocast and spec.dtype == "bf16"):
                    loss = model(**batch).loss / spec.grad_accum
                loss.backward()
                del loss
            grads = sum(tensor_bytes(p.grad) for p in params if p.grad is not None)
            seen["gradients"] = max(seen["gradients"], grads)
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            tracker.__exit__(None, None, None)
        step_times.append(time.perf_counter() - started)
        seen["optimizer_states"] = optimizer_state_bytes(opt)
        events.emit("probe_step", step=step, total=spec.probe_steps, seconds=step_times[-1])
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


def _gather_ledgers(ledger: dict[str, Any], events: EventWriter) -> None:
    """Under torchrun, rank 0 gathers every rank's ledger (``torch.distributed.all_gather_object``, over the run's
    own process group) and emits them as one ``ledgers`` event: on several nodes the parent on node 0 sees the ledgers
    of every node, not only the files written on its own disk."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ledger)
    if dist.get_rank() == 0:
        events.emit("ledgers", ledgers=gathered)


def _gradient_bytes(model: Any) -> int:
    """Bytes of the gradients ``model``'s parameters hold now (this rank's shards under FSDP2)."""
    from core.child.measure import tensor_bytes

    return sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)


def _local_bytes(t: Any) -> int:
    """Bytes of ``t`` held by this process: a DTensor's local shard (FSDP2), else the whole tensor."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _eval_dict(result: Any) -> dict[str, Any]:
    return {
        "perplexity": result.perplexity,
        "mean_nll": result.mean_nll,
        "nll_sum": result.nll_sum,
        "tokens": result.tokens,
        "blocks": result.blocks,
        "seconds": result.seconds,
        "metric": result.metric,
    }


def _rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _peak_rss_bytes() -> int:
    # Linux reports ru_maxrss in KiB.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
