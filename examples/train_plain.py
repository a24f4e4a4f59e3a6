"""A plain PyTorch training loop of the kind teams write themselves: its own checkpoints, its own ``--resume``.

gpuaccept's command mode (issue 21) accepts a user's own training command; this script is the example of a job that
does not use transformers' Trainer. It fine-tunes a Hugging Face causal LM (every parameter, AdamW, a linear
learning-rate schedule) on blocks of text and writes:

- ``OUT/metrics.jsonl``: one JSON object per optimizer step, ``{"step", "loss", "learning_rate", "sample_ids"}``;
- ``OUT/checkpoint-<step>/`` every ``--checkpoint-every`` steps and at the last: ``model.safetensors`` (the weights)
  and ``config.json`` (so the checkpoint loads with ``from_pretrained``),
  ``optimizer.pt`` (AdamW's state; left out with ``--forget-optimizer``), ``scheduler.pt``, ``rng.pt`` (torch's,
  Python's and the data order's generator) and ``progress.json`` (the step). A checkpoint folder is written under a
  temporary name and renamed when complete.

``--resume OUT/checkpoint-<step>`` loads all of it and continues; the run then trains on the same samples, with the
same learning rates and (on the CPU, fp32) the same losses as an uninterrupted run. ``--forget-optimizer`` is a
deliberate bug: the checkpoint has no optimizer state, a resume starts AdamW from zero moments (the script warns),
and the resumed losses drift from the uninterrupted run's; gpuaccept's resume check must fail it and say why.
``--fault NAME`` plants one resume bug of the kinds real loops have (the checkpoint is complete; the resume does not
use all of it): ``fresh_optimizer`` (AdamW's state not loaded), ``scheduler_restart`` (the schedule not loaded),
``rng_not_restored`` (the generators not restored: shows with ``--dropout``), ``data_restart`` (the data order
restarts from the first batch). ``--dropout P`` sets the attention dropout (the model's ``attention_dropout``).

Usage::

    python examples/train_plain.py --model MODEL_DIR --out OUT --steps 8 --checkpoint-every 2
    python examples/train_plain.py --model MODEL_DIR --out OUT --steps 8 --checkpoint-every 2 \\
        --resume OUT/checkpoint-4

The text is ``--text FILE`` (documents separated by blank lines) or, by default, the standard library's
``pydoc_data.topics``. Sample order: a permutation of the blocks drawn from ``--seed`` for each epoch, so step ``k``
takes the same blocks whether the run was resumed or not.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a Hugging Face causal LM directory")
    p.add_argument("--out", required=True, help="where checkpoints and metrics.jsonl go")
    p.add_argument("--text", help="a text file (default: the standard library's pydoc_data.topics)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--checkpoint-every", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", help="a checkpoint-<step> folder this script wrote")
    p.add_argument("--forget-optimizer", action="store_true",
                   help="a deliberate bug: save checkpoints without the optimizer state")
    p.add_argument("--fault", choices=FAULTS, help="a deliberate resume bug (see the docstring)")
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout (the model's attention_dropout)")
    return p.parse_args(argv)


#: the resume bugs ``--fault`` plants, each a way a hand-written resume goes wrong
FAULTS = ("fresh_optimizer", "scheduler_restart", "rng_not_restored", "data_restart")


def blocks(tokenizer: Any, text_file: str | None, seq_len: int) -> list[list[int]]:
    """Every full block of ``seq_len`` tokens of the text, in order."""
    if text_file:
        text = Path(text_file).read_text(encoding="utf-8")
    else:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text)["input_ids"]
    return [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]


def batch_ids(step: int, batch_size: int, n_blocks: int, seed: int) -> list[int]:
    """The block ids of optimizer step ``step`` (1-based): epoch e is a permutation drawn from ``seed + e``."""
    import torch

    per_epoch = n_blocks // batch_size
    epoch, index = divmod(step - 1, per_epoch)
    order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return order[index * batch_size:(index + 1) * batch_size]


def save_checkpoint(out: Path, step: int, model: Any, optimizer: Any, scheduler: Any, forget_optimizer: bool) -> Path:
    import torch
    from safetensors.torch import save_model

    final = out / f"checkpoint-{step}"
    tmp = out / f".checkpoint-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))  # tied weights once (safetensors' shared-tensor handling)
    model.config.save_pretrained(tmp)  # config.json: the checkpoint is a Hugging Face model folder
    if not forget_optimizer:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng.pt")
    (tmp / "progress.json").write_text(json.dumps({"step": step}))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def load_checkpoint(path: Path, model: Any, optimizer: Any, scheduler: Any, fault: str | None = None) -> int:
    import torch
    from safetensors.torch import load_model

    load_model(model, str(path / "model.safetensors"))
    if (path / "optimizer.pt").exists() and fault != "fresh_optimizer":
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    elif fault != "fresh_optimizer":
        print(f"train_plain: {path} has no optimizer.pt: AdamW starts again from zero moments", file=sys.stderr)
    if fault != "scheduler_restart":
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    if fault != "rng_not_restored":
        rng = torch.load(path / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
    return int(json.loads((path / "progress.json").read_text())["step"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attention_dropout=args.dropout)
    model.train()
    data = blocks(tokenizer, args.text, args.seq_len)
    if len(data) < args.batch_size:
        print(f"train_plain: the text gives {len(data)} blocks of {args.seq_len} tokens, fewer than a batch",
              file=sys.stderr)
        return 2
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1.0 - s / args.steps))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = load_checkpoint(Path(args.resume), model, optimizer, scheduler, args.fault) if args.resume else 0
    with (out / "metrics.jsonl").open("a", encoding="utf-8") as metrics:
        for step in range(start + 1, args.steps + 1):
            # data_restart (a deliberate bug): the resumed run counts its batches from its own start
            ids = batch_ids(step - start if args.fault == "data_restart" else step, args.batch_size, len(data),
                            args.seed)
            batch = torch.tensor([data[i] for i in ids])
            lr = scheduler.get_last_lr()[0]
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            metrics.write(json.dumps({"step": step, "loss": loss.item(), "learning_rate": lr, "sample_ids": ids}) + "\n")
            metrics.flush()
            print(f"step {step}/{args.steps} loss {loss.item():.4f}", flush=True)
            if step % args.checkpoint_every == 0 or step == args.steps:
                save_checkpoint(out, step, model, optimizer, scheduler, args.forget_optimizer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
