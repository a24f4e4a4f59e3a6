"""A transformers Trainer + PEFT LoRA script of the kind teams write (TRL's SFT scripts, axolotl and LLaMA-Factory
subclass the same Trainer): gpuaccept's command mode (issue 21) accepts such a job as the user runs it.

It trains LoRA adapters (peft) on blocks of text with ``transformers.Trainer``: Trainer writes the checkpoints
(``OUT/checkpoint-<step>/``: adapter weights, optimizer, scheduler, RNG, ``trainer_state.json`` with the per-step
log history) and resumes from one with ``--resume_from_checkpoint``. Nothing here knows about gpuaccept.

Usage::

    python examples/train_hf.py --model MODEL_DIR --out OUT --max_steps 8 --save_steps 2
    python examples/train_hf.py --model MODEL_DIR --out OUT --max_steps 8 --save_steps 2 \\
        --resume_from_checkpoint OUT/checkpoint-4

The text is ``--text FILE`` or, by default, the standard library's ``pydoc_data.topics``; under ``torchrun`` each
rank trains its share of every batch (Trainer's DDP; gloo on the CPU).

``--fault NAME`` plants one resume bug, for showing that gpuaccept's resume check fails it: ``fresh_optimizer`` (the
optimizer's state not restored), ``scheduler_restart`` (the schedule not restored), ``rng_not_restored`` (the random
generators not restored: shows with ``--lora_dropout``), ``data_restart`` (Trainer's ``ignore_data_skip``: the data
order restarts from the first batch), ``adapters_not_restored`` (the base is loaded, the adapters keep their initial
values).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a Hugging Face causal LM directory")
    p.add_argument("--out", required=True, help="Trainer's output_dir: checkpoints and trainer_state.json")
    p.add_argument("--text", help="a text file (default: the standard library's pydoc_data.topics)")
    p.add_argument("--max_steps", type=int, default=8)
    p.add_argument("--per_device_train_batch_size", type=int, default=2)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--save_steps", type=int, default=2)
    p.add_argument("--save_on_each_node", action="store_true",
                   help="Trainer's save_on_each_node: every node writes whole checkpoints to its own --out (a job "
                        "whose nodes do not share a filesystem must, to resume after losing a node)")
    p.add_argument("--lora_r", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume_from_checkpoint", help="a checkpoint-<step> folder Trainer wrote")
    p.add_argument("--lora_dropout", type=float, default=0.0)
    p.add_argument("--fault", choices=FAULTS, help="a deliberate resume bug (see the docstring)")
    return p.parse_args(argv)


#: the resume bugs ``--fault`` plants
FAULTS = ("fresh_optimizer", "scheduler_restart", "rng_not_restored", "data_restart", "adapters_not_restored")


def faulty_trainer(trainer_class: Any, fault: str | None) -> Any:
    """``trainer_class`` committing ``fault`` when it loads a checkpoint (``None``: the class itself)."""
    if fault is None:
        return trainer_class

    class Faulty(trainer_class):  # type: ignore[misc, valid-type]
        def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
            if fault != "adapters_not_restored":
                super()._load_from_checkpoint(resume_from_checkpoint, model)

        def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
            import copy

            fresh = copy.deepcopy(self.lr_scheduler.state_dict()) if fault == "scheduler_restart" else None
            super()._load_optimizer_and_scheduler(checkpoint)
            if checkpoint is not None and fault == "fresh_optimizer":
                getattr(self.optimizer, "optimizer", self.optimizer).state.clear()
            if checkpoint is not None and fresh is not None:
                self.lr_scheduler.load_state_dict(fresh)

        def _load_rng_state(self, checkpoint: Any) -> None:
            if fault != "rng_not_restored":
                super()._load_rng_state(checkpoint)

    return Faulty


def blocks(tokenizer: Any, text_file: str | None, seq_len: int) -> list[dict[str, list[int]]]:
    """Every full block of ``seq_len`` tokens of the text, as Trainer's examples (labels = inputs)."""
    if text_file:
        text = Path(text_file).read_text(encoding="utf-8")
    else:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text)["input_ids"]
    return [{"input_ids": ids[i:i + seq_len], "labels": ids[i:i + seq_len]}
            for i in range(0, len(ids) - seq_len + 1, seq_len)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Trainer,
        TrainingArguments,
        default_data_collator,
        set_seed,
    )

    set_seed(args.seed)  # before the adapters are built: their initial A matrices are drawn here, not by Trainer
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=args.lora_dropout,
                                             target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    on_cpu = not torch.cuda.is_available()
    training_args = TrainingArguments(
        output_dir=args.out, max_steps=args.max_steps, per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, learning_rate=args.learning_rate,
        save_steps=args.save_steps, save_strategy="steps", logging_steps=1, seed=args.seed, data_seed=args.seed,
        report_to=[], disable_tqdm=True, use_cpu=on_cpu, dataloader_num_workers=0,
        ddp_backend="gloo" if on_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        ignore_data_skip=args.fault == "data_restart", save_on_each_node=args.save_on_each_node,
    )
    trainer = faulty_trainer(Trainer, args.fault)(model=model, args=training_args,
                                                  train_dataset=blocks(tokenizer, args.text, args.seq_len),
                                                  data_collator=default_data_collator)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
