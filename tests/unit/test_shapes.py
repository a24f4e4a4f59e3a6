"""The planner's fast path (core/plan/shapes.py) against the reference it replaces: the model built on the meta device.

For every config, mode, dtype and LoRA target set here, the summary written from config.json alone must equal the one
read from ``AutoModelForCausalLM.from_config`` (+ peft) on the meta device: counts, dtype groups, trainable shapes,
adapters and each parameter's place, in order.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest

from core.plan.meta import build_meta_model, linear_module_names, meta_summary, summarise_model, summary_from_shapes
from core.plan.shapes import FastConfig, fast_config
from core.spectables import LoraSettings
from tests import paths

CASES = {c["id"].split("-")[0]: c for c in
         tomllib.loads((paths.CASES / "planner.toml").read_text())["case"]}
SMALL = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
             num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
CONFIGS = {
    "P1 llama 70B": CASES["P1"]["config"],
    "P2 qwen2 72B": dict(CASES["P2"]["config"]),
    "P6 llama 8B": CASES["P6"]["config"],
    "llama tied": dict(SMALL, tie_word_embeddings=True),
    "llama biases": dict(SMALL, attention_bias=True, mlp_bias=True),
    "llama head_dim": dict(SMALL, head_dim=32),
    "llama MHA (no kv heads key)": {k: v for k, v in SMALL.items() if k != "num_key_value_heads"},
    "mistral": dict(SMALL, model_type="mistral"),
    "qwen2 tied": dict(SMALL, model_type="qwen2", tie_word_embeddings=True),
}
LORAS = {
    "q,v r8": LoraSettings(r=8, alpha=16, dropout=0.0, targets=("q_proj", "v_proj")),
    "all r4": LoraSettings(r=4, alpha=8, dropout=0.05, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj")),
}


def _reference(raw: dict, mode: str, lora, dtype):
    return summarise_model(build_meta_model(FastConfig(raw).to_transformers(), mode, lora, dtype), mode)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("mode,lora,dtype", [("inference", None, "bf16"), ("full", None, "fp32"),
                                             ("lora", "q,v r8", "fp32"), ("lora", "all r4", "bf16")])
def test_the_fast_summary_equals_the_meta_build(name, mode, lora, dtype):
    raw = CONFIGS[name]
    config = fast_config(raw)
    assert config is not None
    settings = LORAS[lora] if lora else None
    assert summary_from_shapes(config, mode, settings, dtype) == _reference(raw, mode, settings, dtype)


def test_the_p1_and_p2_counts_come_out_of_the_fast_path():
    for case in ("P1", "P2"):
        config = fast_config(CASES[case]["config"])
        assert summary_from_shapes(config, "inference", None, "bf16").count.total == CASES[case]["expect_parameters"]


def test_the_embedded_models_config_takes_the_fast_path_and_matches(tmp_path):
    from core.models import ensure_embedded_cache, load_config, resolve_model

    ensure_embedded_cache()
    config = load_config(resolve_model("smollm2-135m"))
    assert isinstance(config, FastConfig)
    lora = LORAS["q,v r8"]
    assert summary_from_shapes(config, "lora", lora, "fp32") == _reference(config.raw, "lora", lora, "fp32")
    assert linear_module_names(config) == linear_module_names(config.to_transformers())


@pytest.mark.parametrize("change", [
    {"model_type": "gptj"},                       # another family: the meta build
    {"tie_word_embeddings": None},                # a number left to a library default is never guessed
    {"intermediate_size": None},
    {"quantization_config": {"quant_method": "gptq"}},
    {"attention_bias": "yes"},
])
def test_configs_it_cannot_write_exactly_go_to_the_meta_build(change):
    raw = {k: v for k, v in dict(SMALL, **change).items() if v is not None}
    assert fast_config(raw) is None


def test_lora_on_other_modules_uses_the_meta_build_and_still_plans():
    config = fast_config(SMALL)
    lora = LoraSettings(r=4, alpha=8, dropout=0.0, targets=("q_proj", "lm_head"))
    assert meta_summary(config, "lora", lora, "fp32") == _reference(SMALL, "lora", lora, "fp32")


def test_a_cold_plan_of_a_llama_config_imports_neither_torch_nor_transformers(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CASES["P1"]["config"]))
    code = ("import sys, json\nfrom tui.cli import main\n"
            f"main(['plan', '--model', {str(cfg)!r}, '--mode', 'inference', '--dtype', 'fp16', '--devices', "
            "'8x80GiB', '--json'])\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["parameters"]["total"] == CASES["P1"]["expect_parameters"]
    assert out.stderr.strip().splitlines()[-1] == "False False"
