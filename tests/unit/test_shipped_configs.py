"""The trainers' configs as they ship them (issue 50): 49 files taken unchanged from the example and recipe folders of
torchtune, axolotl, LLaMA-Factory, LitGPT and TRL / alignment-handbook at pinned commits
(tests/data/trainers/shipped/MANIFEST.toml), each imported and planned as its tool runs it, with at most the flags its
file cannot state. The expected values (EXPECTED.toml) were derived from each tool's own code, independently of
gpuaccept's: the trainable and total parameters, the objective and its reference, the optimizer's state bytes.

The models are the Hub ids the files name, found in a local Hub cache made from tests/data/models (their
config.json, with SOURCES.md), as on a machine that has downloaded them; relative paths inside a file resolve from the
tool's folder, where its examples expect to be run.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from core.importers import build_spec, import_config
from core.importers.base import NO_MEMORY, UNKNOWN
from core.prerun import make_plan

DATA = Path(__file__).resolve().parents[1] / "data"
SHIPPED = DATA / "trainers" / "shipped"
MANIFEST = {c["file"]: c for c in tomllib.loads((SHIPPED / "MANIFEST.toml").read_text(encoding="utf-8"))["config"]}
EXPECTED = {c["file"]: c for c in tomllib.loads((SHIPPED / "EXPECTED.toml").read_text(encoding="utf-8"))["config"]}

#: what a file cannot state, given as the command its tool runs it with gives it (MANIFEST.toml's ``command``):
#: alignment-handbook's accelerate config (ZeRO-3 or FSDP over 8 processes) and which of its scripts runs the file
#: (dpo.py, run_orpo.py); torchtune's ``tokenizer.max_seq_len: null`` leaves the length to the data
LAUNCHED = {
    "alignment-handbook/recipes/smollm3/dpo/apo.yaml": {"strategy": "zero3", "devices": "8xH100"},
    "alignment-handbook/recipes/smollm3/sft/mid.yaml": {"strategy": "zero3", "devices": "8xH100"},
    "alignment-handbook/recipes/zephyr-141b-A35b/orpo/config_full.yaml": {"strategy": "zero3", "devices": "8xH100",
                                                                          "objective": "orpo"},
    "alignment-handbook/recipes/zephyr-7b-beta/dpo/config_full.yaml": {"strategy": "zero3", "devices": "8xH100",
                                                                       "objective": "dpo"},
    "alignment-handbook/recipes/zephyr-7b-beta/dpo/config_qlora.yaml": {"objective": "dpo"},
    "alignment-handbook/recipes/zephyr-7b-beta/sft/config_full.yaml": {"strategy": "zero3", "devices": "8xH100"},
}
#: where EXPECTED.toml's optimizer bytes are the tool as it was when the file was written, and the plan models the
#: tool as it is now (docs/trainers.md): the difference, and why
OLDER_TOOL = {
    "axolotl/examples/llama-3/fft-8b.yaml": "bitsandbytes 0.43's 2,048-element blocks and transformers of April 2024, "
                                            "before Trainer kept embeddings' 8-bit states in fp32",
    "alignment-handbook/recipes/zephyr-7b-beta/sft/config_qlora.yaml": "TRL before it cast a quantised model's adapters "
                                                                       "to its dtype (fp32 adapters then)",
}
#: keys the issue found called "moves no memory" or not read, which do move it (torchtune's compile, loss and optimizer
#: in backward; axolotl's padding to the sequence length, Liger kernels, modules to save, FSDP offload; TRL's loss type,
#: padding-free batches, activation offloading, launcher; LLaMA-Factory's GaLore), and their kin: a key's full name
#: or its last part
MOVES_MEMORY = frozenset({
    "compile", "loss._component_", "optimizer._component_", "optimizer_in_bwd", "pad_to_sequence_len", "loss_type",
    "use_liger_kernel", "liger_fused_linear_cross_entropy", "liger_rms_norm", "liger_glu_activation",
    "cut_cross_entropy", "padding_free", "activation_offloading", "enable_activation_offloading", "num_processes",
    "accelerate_config", "attn_implementation", "flash_attention", "lora_modules_to_save", "modules_to_save",
    "additional_target", "fsdp_offload_params", "fsdp_cpu_offload", "offload_params", "use_galore", "galore_rank",
    "galore_target", "use_badam", "packing", "sample_packing", "packed", "gradient_checkpointing",
    "enable_activation_checkpointing", "fsdp", "fsdp_config", "deepspeed", "quantize", "quantization_bit",
    "load_in_8bit", "load_in_4bit", "lora_head", "max_seq_len", "sequence_len", "max_length", "cutoff_len",
    "dtype", "torch_dtype", "optim", "optimizer", "lora_dtype", "precompute_ref_log_probs", "ref_model",
    "ref_checkpointer._component_", "rl", "stage", "pref_loss", "use_dora", "lora_rank", "lora_r", "batch_size",
    "micro_batch_size", "per_device_train_batch_size"})
#: EXPECTED.toml's names of objectives, references and methods -> the spec's
OBJECTIVE = {"apo_zero": "dpo"}
REFERENCE = {"adapters_disabled": "adapters"}
METHOD = {"lora-8bit": "lora_int8", "galore": "full"}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A Hub cache holding every model's config.json, as ``huggingface_hub`` lays one out."""
    from tests.hub import hub_cache

    return hub_cache(tmp_path_factory.mktemp("hub"), DATA / "models")


def flags_of(name: str) -> dict[str, object]:
    flags: dict[str, object] = {"devices": "1xH100", **LAUNCHED.get(name, {})}
    if "tokenizer.max_seq_len" in MANIFEST[name].get("missing", {}):
        flags["seq_len"] = 2048
    return flags


def test_the_set_is_what_the_issue_asks():
    """At least 40 files, from the five tools' own folders, each with its derived expectations."""
    tools = {c["tool"] for c in MANIFEST.values()}
    assert len(MANIFEST) >= 40 and tools == {"torchtune", "axolotl", "llamafactory", "litgpt", "trl",
                                             "alignment-handbook"}
    assert set(EXPECTED) == set(MANIFEST)
    import hashlib

    for name, c in MANIFEST.items():  # unchanged: the bytes the manifest pins
        assert hashlib.sha256((SHIPPED / name).read_bytes()).hexdigest() == c["sha256"], name


@pytest.mark.parametrize("name", list(MANIFEST))
def test_each_config_plans_as_its_tool_runs_it(name, hub, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))  # read once, when it was imported
    monkeypatch.chdir(SHIPPED / name.split("/")[0])  # where the tool's examples are run from
    expected, flags = EXPECTED[name], flags_of(name)
    path = SHIPPED / name
    imported = import_config(path, flags)
    spec = build_spec(path, **flags)
    plan = make_plan(spec).plan

    # the trainable parameters exactly, and every parameter (tied weights once, adapters included)
    assert (plan.parameters.trainable, plan.parameters.total) == (expected["trainable"], expected["total"])
    # what it optimises, never SFT for a preference trainer, and where its reference comes from
    assert spec.objective == OBJECTIVE.get(expected["objective"], expected["objective"])
    assert spec.reference_source == REFERENCE.get(expected["reference"], expected["reference"])
    assert spec.mode == METHOD.get(expected["method"], expected["method"])
    # every key accounted for: none unknown to the importer, none waved through
    assert not imported.unknown, imported.unknown
    assert not any(v == UNKNOWN.format(imported.format) for v in imported.ignored.values())
    waved = [k for k, v in imported.ignored.items()
             if v == NO_MEMORY and (k in MOVES_MEMORY or k.rsplit(".", 1)[-1] in MOVES_MEMORY)]
    assert not waved, waved
    # the optimizer's states as the tool keeps them (summed over the ranks that share them)
    states = expected.get("optimizer_state_bytes")
    if states and name not in OLDER_TOOL:
        ranks = len(plan.devices) if spec.strategy.startswith("zero") else 1
        device = plan.devices[0]  # paged states: the resident tensor's on the device, the rest off it
        paged = sum(line.bytes for line in device.host if line.component == "optimizer_states")
        planned = (device.lines["optimizer_states"].bytes + paged) * ranks
        # the plan counts what EXPECTED.toml leaves out: fused AdamW's step counters (4 B a tensor) and
        # bitsandbytes' shared maps (2 KiB), and ZeRO's padding of a shard
        assert planned == pytest.approx(states, rel=1e-3), (planned, states)
