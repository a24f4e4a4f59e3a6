"""A LitGPT checkpoint folder (``lit_model.pth``, ``model_config.yaml``, the tokenizer) of a Hugging Face Llama folder:
the test's tiny Llama is no config LitGPT names, so its config is registered under the new folder's name first, from
the Hugging Face ``config.json``; then LitGPT's own converter (``convert_hf_checkpoint``) maps the weights.

Usage: ``python litgpt_convert.py HF_FOLDER NEW_FOLDER`` (in the environment that has LitGPT).
"""

import json
import shutil
import sys
from pathlib import Path

from litgpt.config import name_to_config
from litgpt.scripts.convert_hf_checkpoint import convert_hf_checkpoint

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
shutil.copytree(src, dst)
hf = json.loads((src / "config.json").read_text(encoding="utf-8"))
if hf.get("model_type") != "llama" or hf.get("tie_word_embeddings"):
    sys.exit(f"{src}: a Llama with untied embeddings is converted here (got {hf.get('model_type')}, tied "
             f"{hf.get('tie_word_embeddings')})")
rope = hf.get("rope_parameters") or {}
name_to_config[dst.name] = dict(
    name=dst.name, hf_config=dict(org="local", name=dst.name), block_size=hf["max_position_embeddings"],
    vocab_size=hf["vocab_size"], padded_vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"],
    n_head=hf["num_attention_heads"], n_query_groups=hf["num_key_value_heads"], n_embd=hf["hidden_size"],
    rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm", norm_eps=hf["rms_norm_eps"],
    mlp_class_name="LLaMAMLP", intermediate_size=hf["intermediate_size"],
    rope_base=int(rope.get("rope_theta", hf.get("rope_theta", 10000))))
convert_hf_checkpoint(dst, model_name=dst.name)
