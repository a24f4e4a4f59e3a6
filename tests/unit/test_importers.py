"""Trainers' YAML configs read as specs (core/importers/, issue 37): for each of the four formats a sample config,
written here in the tool's documented schema, mapped key by key, with the keys it ignored and why."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from core.errors import SpecError
from core.importers import build_spec, import_config
from core.importers.base import EVALUATION_WHY, HYPER, NO_MEMORY, RUN_LENGTH
from core.spec import RunSpec

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
NOT_READ = "not read by the {} importer: the plan assumes it moves no memory"


def _config(tmp_path: Path, name: str, model: str = "some/model", **replace: str) -> Path:
    """The sample config ``name`` with its model folder set (and any line's text replaced)."""
    text = (CONFIGS / name).read_text(encoding="utf-8").replace("MODEL", model)
    for old, new in replace.items():
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    for extra in CONFIGS.glob("*.json"):  # a DeepSpeed config named by a path relative to the config
        shutil.copy(extra, tmp_path / extra.name)
    return path


def test_trl_sft_qlora(tmp_path):
    got = import_config(_config(tmp_path, "trl_sft_qlora.yaml"))
    assert got.format == "trl"
    assert got.settings == {
        "model": "some/model", "batch_size": 2, "grad_accum": 8, "seq_len": 512, "padding": "packed",
        "learning_rate": 2e-4, "lr_scheduler": "cosine", "optimizer": "paged_adamw_8bit",
        "dtype": "bf16", "precision": "pure", "gradient_checkpointing": True, "attn_implementation": "sdpa",
        "mode": "qlora", "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "lora_targets": "all-linear",
        "lora_dtype": "model", "qlora_quant_type": "nf4", "qlora_double_quant": True, "loss": "chunked_nll",
        "seq_len_limit": "none"}
    assert "trl's default: base_config.py" in got.defaults["gradient_checkpointing"]  # SFTConfig turns it on
    assert "SFTConfig.loss_type" in got.defaults["loss"]  # TRL 1.7's default, said so
    assert "bf16 is TRL's default" in got.defaults["dtype"] and "bf16" not in got.used  # not in the file (issue 51)
    assert got.ignored == {**{k: NO_MEMORY for k in ("dataset_name", "output_dir", "logging_steps", "report_to")},
                           "max_steps": RUN_LENGTH, "warmup_steps": RUN_LENGTH}
    spec = RunSpec.from_dict(got.raw())
    assert (spec.mode, spec.method.variant, spec.qlora.double_quant) == ("qlora", True, True)


def test_trl_defaults_and_a_full_run(tmp_path):
    """Without use_peft TRL trains every parameter; the model is loaded in fp32 (ModelConfig's default) under bf16
    autocast (SFTConfig's bf16 default): precision amp; max_length is TRL's 1,024."""
    path = tmp_path / "full.yaml"
    path.write_text("model_name_or_path: some/model\nper_device_train_batch_size: 1\n", encoding="utf-8")
    got = import_config(path)
    assert {k: got.settings[k] for k in ("mode", "dtype", "precision", "seq_len", "gradient_checkpointing")} == \
        {"mode": "full", "dtype": "bf16", "precision": "amp", "seq_len": 1024, "gradient_checkpointing": True}
    assert "SFTConfig / DPOConfig max_length" in got.defaults["seq_len"]
    assert got.settings["optimizer"] == "adamw_fused" and "adamw_torch_fused" in got.defaults["optimizer"]


def test_axolotl_lora_all_linear_with_deepspeed(tmp_path):
    got = import_config(_config(tmp_path, "axolotl_lora.yml"))
    assert got.format == "axolotl"
    assert got.settings == {
        "model": "some/model", "batch_size": 2, "grad_accum": 4, "seq_len": 1024, "padding": "packed",
        "learning_rate": 2e-4, "lr_scheduler": "cosine", "optimizer": "adamw_8bit",
        "dtype": "bf16", "precision": "pure", "gradient_checkpointing": True,
        "attn_implementation": "flash_attention_2", "mode": "lora", "lora_r": 32, "lora_alpha": 16,
        "lora_dropout": 0.05, "lora_targets": "all-linear", "seq_len_limit": "none"}
    assert "auto: bf16 where the GPU has it" in got.used["bf16"]
    assert "planned on one device" in got.used["deepspeed"]  # the file does not say how many ranks
    assert "not found in the working directory" in got.used["deepspeed"]  # read from beside the config
    assert got.ignored == {
        **{k: NO_MEMORY for k in ("model_type", "datasets", "output_dir", "num_epochs")}, "warmup_steps": RUN_LENGTH,
        "tf32": HYPER["tf32"], "val_set_size": EVALUATION_WHY}
    assert "the plan's length is exact" in got.used["pad_to_sequence_len"]
    sharded = import_config(_config(tmp_path, "axolotl_lora.yml"), {"devices": "2x80GiB"})
    assert sharded.settings["strategy"] == "zero2" and "over the 2 devices given" in sharded.used["deepspeed"]
    RunSpec.from_dict(sharded.raw())


def test_llamafactory_dora_and_its_defaults(tmp_path):
    got = import_config(_config(tmp_path, "llamafactory_dora.yaml"))
    assert got.format == "llamafactory"
    assert got.settings == {
        "model": "some/model", "batch_size": 1, "grad_accum": 8, "seq_len": 256, "padding": "padded",
        "learning_rate": 1e-4, "lr_scheduler": "cosine", "dtype": "bf16", "precision": "pure",
        "optimizer": "adamw_fused", "gradient_checkpointing": True, "attn_implementation": "sdpa", "mode": "dora",
        "lora_r": 8, "lora_alpha": 16, "lora_targets": "q_proj,v_proj", "seq_len_limit": "none"}
    assert "2 x lora_rank" in got.defaults["lora_alpha"]
    assert "disable_gradient_checkpointing off" in got.defaults["gradient_checkpointing"]
    assert "infer_optim_dtype" in got.defaults["dtype"]  # neither bf16 nor fp16: the checkpoint's dtype
    assert got.ignored["warmup_ratio"] == RUN_LENGTH
    assert set(got.ignored) == {"trust_remote_code", "do_train", "dataset", "template", "max_samples", "output_dir",
                                "logging_steps", "save_steps", "num_train_epochs", "warmup_ratio"}
    planned = RunSpec.from_dict(got.raw())  # planned as it is; run only in fp32, without checkpointing (DoRA's own)
    with pytest.raises(SpecError, match="dora is run in fp32"):
        planned.method.check_run(planned)
    in_fp32 = RunSpec.from_dict({**got.raw(), "dtype": "fp32"})
    with pytest.raises(SpecError, match="without gradient checkpointing"):
        in_fp32.method.check_run(in_fp32)
    spec = RunSpec.from_dict({**got.raw(), "gradient_checkpointing": False})
    assert spec.mode == "dora" and spec.lora.variant == "dora"


def test_torchtune_lora_recipe(tmp_path):
    got = import_config(_config(tmp_path, "torchtune_lora.yaml"))
    assert got.format == "torchtune"
    assert got.settings == {  # checkpoint_dir some/model is not here: the builder's Hub model
        "model": "meta-llama/Llama-3.2-1B-Instruct", "batch_size": 4, "grad_accum": 8, "seq_len": 2048, "padding": "padded",
        "dtype": "bf16", "precision": "pure", "gradient_checkpointing": False, "optimizer": "adamw_fused",
        "learning_rate": 3e-4, "lr_scheduler": "cosine", "mode": "lora", "lora_dtype": "model",
        "lora_r": 64, "lora_alpha": 128, "lora_dropout": 0.0, "compile": False, "embedding_fp32_states": False,
        "loss": "linear_chunked", "seq_len_limit": "none",
        "lora_targets": "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"}
    assert "an estimate" in got.used["model._component_"] and "lora_llama3_2_1b" not in got.unknown
    assert got.used["optimizer.fused"] == "True: torch's fused implementation"
    assert got.ignored["max_steps_per_epoch"] == got.ignored["lr_scheduler.num_warmup_steps"] == RUN_LENGTH
    assert got.ignored["metric_logger.log_dir"] == NO_MEMORY
    assert "loss = 'linear_chunked'" in got.used["loss._component_"]
    RunSpec.from_dict(got.raw())


def test_litgpt_qlora_config(tmp_path):
    """LitGPT's finetune_lora config (config_hub layout): 4-bit nf4 with double quantisation from ``bnb.nf4-dq``,
    accumulation from the global batch, adapters from the switches, the run's length and the data ignored."""
    got = import_config(_config(tmp_path, "litgpt_lora.yaml"))
    assert got.format == "litgpt"
    assert got.settings == {
        "model": "some/model", "batch_size": 2, "grad_accum": 4, "seq_len": 512, "padding": "padded",
        "dtype": "bf16", "precision": "pure", "mode": "qlora", "lora_r": 32, "lora_alpha": 16, "lora_dropout": 0.05,
        "lora_targets": "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "qlora_quant_type": "nf4",
        "qlora_double_quant": True, "optimizer": "paged_adamw_32bit", "learning_rate": 2e-4,
        "attn_implementation": "sdpa", "gradient_checkpointing": False, "lora_dtype": "model",
        "untie_embeddings": True, "embedding_fp32_states": False, "loss": "litgpt_chunked", "seq_len_limit": "none"}
    assert got.used["train.global_batch_size"] == "grad_accum = 4 (8 / 1 rank(s) / micro-batch 2)"
    assert got.used["lora_key"] == "off" and got.used["lora_query"].startswith("on: lora_targets gets q_proj")
    assert got.ignored["optimizer.class_path"] == "replaced by PagedAdamW under quantize"  # LitGPT swaps it in
    assert "below the training step's peak" in got.ignored["eval.interval"]
    assert {k for k, v in got.ignored.items() if v == NO_MEMORY} == {
        "out_dir", "logger_name", "seed", "train.save_interval", "train.log_interval", "train.min_lr",
        "data.class_path", *(f"data.init_args.{a}" for a in (
            "mask_prompt", "prompt_style", "ignore_index", "seed", "num_workers"))}
    RunSpec.from_dict(got.raw())


def test_litgpt_full_on_two_devices_is_sharded_with_checkpointing_and_mixed_by_default(tmp_path):
    """No lora_* key: finetune_full; no precision: LitGPT's bf16-mixed (amp); two devices: FSDP with every Block's
    activations checkpointed; the global batch of 16 over 2 ranks of micro-batch 4 is accumulation 2."""
    path = tmp_path / "full.yaml"
    path.write_text("checkpoint_dir: some/model\ndevices: 2\ntrain:\n  global_batch_size: 16\n"
                    "  micro_batch_size: 4\n  max_seq_length: 256\noptimizer: AdamW\n", encoding="utf-8")
    got = import_config(path)
    assert {k: got.settings[k] for k in ("mode", "dtype", "precision", "grad_accum", "strategy",
                                         "gradient_checkpointing", "optimizer")} == {
        "mode": "full", "dtype": "bf16", "precision": "amp", "grad_accum": 2, "strategy": "zero3",
        "gradient_checkpointing": True, "optimizer": "adamw"}
    # issue 51: a key the file does not hold is a default of the tool, said so, never "used"
    assert "LitGPT's default for training (bf16-mixed)" in got.defaults["dtype"] and "precision" not in got.used
    assert "precision is not in the file" in got.defaults["dtype"]


@pytest.mark.parametrize(("name", "replace", "key", "says"), [
    ("litgpt_lora.yaml", {"bnb.nf4-dq": "bnb.int8-training"}, "litgpt:quantize", "4-bit bases"),
    ("litgpt_lora.yaml", {"  max_seq_length: 512\n": ""}, "litgpt:train.max_seq_length", "longest sample"),
    ("litgpt_lora.yaml", {"global_batch_size: 8": "global_batch_size: 7"}, "litgpt:train.global_batch_size",
     "multiple of 2"),
    ("litgpt_lora.yaml", {"devices: 1": "devices: 2"}, "litgpt:quantize", "more than one device"),
    ("trl_sft_qlora.yaml", {"optim: paged_adamw_8bit": "optim: lion_32bit"}, "trl:optim", "lion_32bit"),
    ("trl_sft_qlora.yaml", {"dtype: bfloat16": "dtype: auto"}, "trl:dtype", "checkpoint's dtype decides"),
])
def test_what_cannot_be_planned_is_refused_by_its_key(tmp_path, name, replace, key, says):
    with pytest.raises(SpecError, match=says) as caught:
        import_config(_config(tmp_path, name, **replace))
    assert caught.value.field == key


@pytest.mark.parametrize(("name", "replace", "overrides", "expect"), [
    ("litgpt_lora.yaml", {"lora_head: false": "lora_head: true"}, {},
     {"lora_targets": "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head"}),
    ("axolotl_lora.yml", {"adapter: lora": "adapter: lora\nload_in_8bit: true"}, {}, {"mode": "lora_int8"}),
    ("llamafactory_dora.yaml", {"use_dora: true": "quantization_bit: 8"}, {}, {"mode": "lora_int8"}),
    ("axolotl_lora.yml", {"sequence_len: 1024\n": ""}, {}, {"seq_len": 512}),
    ("axolotl_lora.yml", {"ds_zero2.json": "ds_offload.json"}, {"devices": "4xH100"},
     {"strategy": "zero3", "offload": "optimizer"}),
    ("llamafactory_dora.yaml", {"stage: sft": "stage: dpo"}, {}, {"objective": "dpo"}),
    ("torchtune_lora.yaml", {"enable_activation_offloading: false": "enable_activation_offloading: true"}, {},
     {"activation_offloading": True}),
])
def test_what_moves_memory_in_their_recipes_is_planned(tmp_path, name, replace, overrides, expect):
    """What earlier imports refused (an adapter on the output head, an 8-bit base, a preference stage, offloads) is
    planned now: the setting it maps to, and a spec that validates."""
    got = import_config(_config(tmp_path, name, **replace), overrides)
    assert {k: got.settings.get(k) for k in expect} == expect
    RunSpec.from_dict({**got.raw(), **overrides})


def test_an_offload_on_one_device_is_said_to_be_not_modelled(tmp_path):
    """ZeRO-Offload on one GPU: the file's offload is not planned (strategy single holds every state on the device),
    said so, with the direction of the error."""
    got = import_config(_config(tmp_path, "axolotl_lora.yml", **{"ds_zero2.json": "ds_offload.json"}))
    assert "strategy" not in got.settings and "offload" not in got.settings
    assert "an upper bound" in got.not_modelled["deepspeed"]


def test_a_deepspeed_config_found_nowhere_names_both_places(tmp_path):
    path = _config(tmp_path, "axolotl_lora.yml", **{"ds_zero2.json": "nowhere.json"})
    with pytest.raises(SpecError, match="neither in the working directory") as caught:
        import_config(path)
    assert caught.value.field == "axolotl:deepspeed"


def test_a_file_of_no_known_format_names_the_four(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("learning_rate: 0.1\n", encoding="utf-8")
    with pytest.raises(SpecError, match="not a config of torchtune, axolotl, llamafactory, trl, litgpt"):
        import_config(path)
    path.write_text("- a list\n", encoding="utf-8")
    with pytest.raises(SpecError, match="not a mapping"):
        import_config(path)
    path.write_text("a: [\n", encoding="utf-8")
    with pytest.raises(SpecError, match="not valid YAML"):
        import_config(path)


def test_a_yaml_spec_path_is_read_through_its_importer_with_flags_over_it(tmp_path, tiny_model_dir):
    """``RunSpec.build`` (what ``gpuaccept plan`` and ``run`` call) reads a .yaml spec through the importers, flags
    over it; the plan is made from it."""
    from core.prerun import make_plan

    spec = build_spec(_config(tmp_path, "torchtune_lora.yaml", model=str(tiny_model_dir)), batch_size=1,
                         seq_len=64, devices="cpu", dtype="fp32")
    assert (spec.mode, spec.batch_size, spec.seq_len, spec.lora.r, spec.grad_accum) == ("lora", 1, 64, 64, 8)
    assert make_plan(spec).plan.parameters.trainable > 0


def test_the_wizard_opens_prefilled_from_a_trainers_config(tmp_path, monkeypatch):
    """``gpuaccept run their.yaml`` (no --headless): the wizard opens in the config's mode, each field it sets filled
    in, flags over it."""
    from tests.wizard_helpers import wizard_opened_with

    path = _config(tmp_path, "axolotl_lora.yml")
    seen = wizard_opened_with(monkeypatch, ["run", str(path), "--batch-size", "1", "--devices", "2x80GiB"])
    assert seen["mode"] == "lora"
    assert {k: seen["fields"][k] for k in ("model", "seq_len", "lora_r", "lora_targets", "strategy", "batch_size")} == \
        {"model": "some/model", "seq_len": 1024, "lora_r": 32, "lora_targets": ("all-linear",), "strategy": "zero2",
         "batch_size": 1}


def test_a_value_the_file_leaves_to_the_data_is_asked_for_by_name_and_taken_from_the_flag(tmp_path):
    """torchtune's ``tokenizer.max_seq_len: null`` (no truncation: the data decides): the import names the key and the
    flag; with ``--seq-len`` given it plans, and says where the length came from."""
    from core.importers import NeedsValue

    path = _config(tmp_path, "torchtune_lora.yaml", **{"max_seq_len: 2048": "max_seq_len: null"})
    with pytest.raises(NeedsValue, match="give it with --seq-len") as caught:
        import_config(path)
    assert (caught.value.field, caught.value.dest) == ("torchtune:tokenizer.max_seq_len", "seq_len")
    got = import_config(path, {"seq_len": 4096})
    assert got.settings["seq_len"] == 4096 and "--seq-len 4096" in got.flags["seq_len"]
    assert build_spec(path, seq_len=4096).seq_len == 4096


def test_flags_apply_over_the_file_before_anything_is_refused(tmp_path):
    """An optimizer the planner does not model is refused, naming the key and the flag that replaces it; given that
    flag, the file's value is not used and the summary says so; a flag over a value the file holds is listed too."""
    path = _config(tmp_path, "trl_sft_qlora.yaml", **{"optim: paged_adamw_8bit": "optim: lion_32bit"})
    with pytest.raises(SpecError, match="or give --optimizer on the command line"):
        import_config(path)
    got = import_config(path, {"optimizer": "adamw", "batch_size": 1})
    assert got.settings["optimizer"] == "adamw" and "in place of optim" in got.flags["optimizer"]
    assert got.flags["batch_size"] == "--batch-size 1 over the file's 2"
    assert any(line.startswith("  flag optimizer:") for line in got.summary())
