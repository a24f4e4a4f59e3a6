"""Held-out perplexity of a LitGPT checkpoint folder: the evaluation script a team that trains with LitGPT keeps.

Usage::

    python litgpt_perplexity.py CHECKPOINT_DIR TEXT_FILE [--seq-len 64] [--max-blocks 8]

``CHECKPOINT_DIR`` holds ``lit_model.pth`` (a base model's weights, or a ``finetune_full`` checkpoint: its ``model``
entry) and ``model_config.yaml`` with the tokenizer files. The text is cut into blocks of ``--seq-len`` tokens; the
perplexity is ``exp(sum of the next-token NLL / predicted tokens)`` over the first ``--max-blocks`` blocks. The last line
printed is the JSON object gpuaccept's command mode reads: ``metric``, ``value``, ``higher_is_better``, ``definition``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from litgpt import GPT, Config, Tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("text", type=Path)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--max-blocks", type=int, default=8)
    args = p.parse_args()
    model = GPT(Config.from_file(args.checkpoint / "model_config.yaml"))
    state = torch.load(args.checkpoint / "lit_model.pth", map_location="cpu", weights_only=False)
    model.load_state_dict(state.get("model", state))
    model.eval()
    ids = Tokenizer(args.checkpoint).encode(args.text.read_text(encoding="utf-8"))
    n = min(args.max_blocks, len(ids) // args.seq_len)
    blocks = ids[:n * args.seq_len].long().view(n, args.seq_len)
    with torch.no_grad():
        logits = model(blocks)
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                blocks[:, 1:].reshape(-1), reduction="sum")
    tokens = n * (args.seq_len - 1)
    print(json.dumps({"metric": "perplexity", "value": math.exp(nll.item() / tokens), "higher_is_better": False,
                      "definition": f"exp(sum NLL / {tokens} predicted tokens) over {n} blocks of {args.seq_len} "
                                    f"tokens of {args.text.name}"}))


if __name__ == "__main__":
    main()
