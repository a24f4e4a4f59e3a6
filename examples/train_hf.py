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
    p.add_argument("--lora_r", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume_from_checkpoint", help="a checkpoint-<step> folder Trainer wrote")
    return p.parse_args(argv)


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
    model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                                             target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    on_cpu = not torch.cuda.is_available()
    training_args = TrainingArguments(
        output_dir=args.out, max_steps=args.max_steps, per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, learning_rate=args.learning_rate,
        save_steps=args.save_steps, save_strategy="steps", logging_steps=1, seed=args.seed, data_seed=args.seed,
        report_to=[], disable_tqdm=True, use_cpu=on_cpu, dataloader_num_workers=0,
        ddp_backend="gloo" if on_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=blocks(tokenizer, args.text, args.seq_len),
                      data_collator=default_data_collator)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
