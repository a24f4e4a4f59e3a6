"""The child process of command mode's evaluation: held-out perplexity of the user's final checkpoint and of its base.

Run as ``python -m core.child.checkpoint_eval JOB.json`` (:func:`core.stages.childproc.start_child` with this module) in
its own process group; it talks to the parent through the events file named in the job only. The job
(:class:`~core.protocol.job.EvalJob`, read once) names:

- ``checkpoint``: the final checkpoint, a Hugging Face model folder (``config.json`` and weights) or a peft adapter
  folder (``adapter_config.json``: loaded over its base with ``PeftModel.from_pretrained``);
- ``base``: the model before training (the adapter's base; the model the full fine-tuning started from), or "";
- ``data``, ``heldout_fraction``, ``seq_len``, ``max_blocks``: gpuaccept's text, split by a hash of each document id
  (:func:`core.data.split_documents`); the held-out blocks of ``seq_len`` tokens, at most ``max_blocks``.

It writes ``data`` (the split's facts), then ``evaluation`` events ``before`` (the base, when there is one) and
``after`` (the checkpoint): token-weighted perplexity, :func:`core.child.evaluate.evaluate_perplexity`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from core.protocol.events import ChildError, DataInfo, EventWriter, Started
from core.protocol.job import EvalJob
from core.protocol.lifeline import exit_with_parent


def main(argv: list[str]) -> int:
    job = EvalJob.read(argv[0])  # a file that is no job: JobFormatError, naming the key (the log says it)
    exit_with_parent()
    events = EventWriter(job.events)
    try:
        run(job, events)
    except BaseException as exc:  # the parent reads this event; the traceback goes to the child's log
        import traceback

        traceback.print_exc()
        events.write(ChildError(error=f"{type(exc).__name__}: {exc}"))
        return 1
    finally:
        events.close()
    return 0


def run(job: EvalJob, events: EventWriter) -> None:
    """Evaluate the base (when named) and the checkpoint on the held-out blocks (see the module docstring)."""
    import torch
    from transformers.utils import logging as hf_logging

    from core.child.evaluate import evaluate_perplexity, evaluation_event

    hf_logging.disable_progress_bar()
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    events.write(Started(role="evaluate_checkpoint", pid=os.getpid(), pgid=os.getpgid(0), device=device,
                         torch=torch.__version__, host=socket.gethostname()))
    checkpoint, base = Path(job.checkpoint), job.base
    tokenizer = load_tokenizer(checkpoint, base)
    blocks, info = heldout_blocks(job, tokenizer)
    events.write(DataInfo(**info))
    batch = job.batch_size
    if base:
        model = load_model(Path(base), device)
        result = evaluate_perplexity(model, blocks, batch, device=device)
        events.write(evaluation_event("before", result))
        del model
    model = load_checkpoint(checkpoint, base, device)
    result = evaluate_perplexity(model, blocks, batch, device=device)
    events.write(evaluation_event("after", result))


def load_tokenizer(checkpoint: Path, base: str) -> Any:
    """The checkpoint's tokenizer when it saved one, else the base's.

    Raises:
        ValueError: neither holds a tokenizer (name the base model with ``model``)."""
    from transformers import AutoTokenizer

    for folder in (checkpoint, Path(base) if base else None):
        if folder is not None and any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json",
                                                                        "tokenizer.model")):
            return AutoTokenizer.from_pretrained(folder)
    raise ValueError(f"no tokenizer in {checkpoint}" + (f" nor in {base}" if base else "") +
                     "; name the base model folder (with its tokenizer) as command.model")


def heldout_blocks(job: EvalJob, tokenizer: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The held-out blocks to evaluate and the split's facts (the ``data`` event's fields)."""
    from core.data import load_documents, make_blocks, split_documents

    split = split_documents(load_documents(job.data), float(job.heldout_fraction))
    seq_len, limit = job.seq_len, job.max_blocks
    every = make_blocks(split.heldout, tokenizer, seq_len, max_blocks=limit + 1)
    blocks = every[:limit]
    info = {"train_documents": len(split.train), "heldout_documents": len(split.heldout), "train_blocks": 0,
            "heldout_blocks": len(every), "heldout_blocks_evaluated": len(blocks),
            "heldout_selection": (f"the first {len(blocks)} held-out blocks (eval_max_blocks = {limit}), in document "
                                  "order" if len(every) > len(blocks) else f"all {len(blocks)} held-out blocks"),
            "train_hash": split.train_hash, "heldout_hash": split.heldout_hash, "split_method": split.method,
            "disjoint_check": split.disjoint_check}
    return blocks, info


def load_model(folder: Path, device: str) -> Any:
    """A Hugging Face causal LM folder, in the dtype it was saved in, on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    return model.to(device)  # type: ignore[arg-type]  # transformers types .to() as a decorator's wrapper


def load_checkpoint(checkpoint: Path, base: str, device: str) -> Any:
    """The trained model of ``checkpoint``: its adapter over ``base`` (or the base its ``adapter_config.json``
    names), or the model folder itself.

    Raises:
        ValueError: the checkpoint is neither a model folder nor an adapter folder, or an adapter has no base."""
    if (checkpoint / "adapter_config.json").is_file():
        from peft import PeftModel

        named = json.loads((checkpoint / "adapter_config.json").read_text(encoding="utf-8")).get(
            "base_model_name_or_path") or ""
        folder = base or named
        if not folder or not Path(folder).is_dir():
            raise ValueError(f"{checkpoint} is a peft adapter whose base ({named or 'not named'}) is not a folder "
                             "here; name it as command.model")
        return PeftModel.from_pretrained(load_model(Path(folder), device), checkpoint).to(device)
    if (checkpoint / "config.json").is_file():
        return load_model(checkpoint, device)
    raise ValueError(f"{checkpoint} is neither a Hugging Face model folder (config.json) nor a peft adapter folder "
                     "(adapter_config.json); give an evaluation command (command.eval) instead")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
