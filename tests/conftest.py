"""Shared fixtures: a tiny randomly initialised Llama with the embedded model's tokenizer, and test isolation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Snapshots and colours must not depend on the developer's terminal.
os.environ.pop("NO_COLOR", None)
os.environ.pop("TEXTUAL_THEME", None)
os.environ.pop("SSH_AUTH_SOCK", None)  # the export screen names the ssh-agent's keys: none in tests


def make_tiny_llama(path: Path, *, tie: bool = True, seed: int = 0) -> Path:
    """Save a tiny random Llama (hidden 32, 2 layers) with the embedded SmolLM2 tokenizer to ``path``.

    The vocabulary must match the tokenizer (49,152), so the embedding dominates its ~1.6M parameters.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from core.models import ensure_embedded_cache

    src = ensure_embedded_cache()
    tok = AutoTokenizer.from_pretrained(src)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tie,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def lora_run(tiny_model_dir, tmp_path_factory):
    """The whole pipeline once on the tiny model (LoRA, accumulation 2, cosine with warmup): spec, record, events."""
    import tomllib

    from core.events import RunFinished
    from core.pipeline import run_pipeline
    from core.spec import RunSpec

    spec = RunSpec.build(model=str(tiny_model_dir), mode="lora", steps=8, seq_len=64, grad_accum=2,
                         resume_checkpoint_every=2, resume_kill_after_checkpoint=2, lr_scheduler="cosine",
                         warmup_steps=2, eval_max_blocks=8)
    events = list(run_pipeline(spec, runs_root=tmp_path_factory.mktemp("runs")))
    assert isinstance(events[-1], RunFinished)
    record = tomllib.loads(Path(events[-1].record_path).read_text())
    return spec, record, events
