"""RunSpec: TOML + flags, defaults per mode, named errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from core.devicespec import parse_devices
from core.errors import SpecError
from core.spec import RunSpec
from core.specdraft import validate_against_config


def test_defaults_are_the_embedded_lora_run():
    spec = RunSpec.build()
    assert (spec.mode, spec.model, spec.data, spec.dtype) == ("lora", "smollm2-135m", "embedded", "fp32")
    assert spec.steps == 30 and spec.learning_rate == 1e-3
    assert spec.resume.kill_checkpoint_step() == 20 and spec.resume.kill_step() == 25


def test_mode_defaults_follow_the_mode():
    full = RunSpec.build(mode="full")
    inference = RunSpec.build(mode="inference")
    assert full.steps == 12 and full.learning_rate == 5e-5
    assert full.resume.kill_checkpoint_step() < full.resume.kill_step() < full.steps
    assert inference.steps == 0 and not inference.training


def test_flags_override_the_toml_file(tmp_path):
    path = tmp_path / "spec.toml"
    path.write_text('mode = "full"\nbatch_size = 2\nseq_len = 64\nsteps = 12\n[lora]\nr = 4\n[resume]\ncheckpoint_every = 3\n')
    spec = RunSpec.build(path, batch_size=8, lora_targets="q_proj,k_proj")
    assert spec.mode == "full" and spec.batch_size == 8 and spec.seq_len == 64 and spec.steps == 12
    assert spec.lora.r == 4 and spec.lora.targets == ("q_proj", "k_proj")
    assert spec.resume.checkpoint_every == 3


@pytest.mark.parametrize(
    ("overrides", "field", "hint"),
    [
        ({"mode": "train"}, "mode", "inference, full, lora"),
        ({"dtype": "fp8"}, "dtype", "fp32, bf16, fp16"),
        ({"batch_size": 0}, "batch_size", "at least 1"),
        ({"seq_len": 1}, "seq_len", "at least 2"),
        ({"heldout_fraction": 1.5}, "heldout_fraction", "between 0 and 1"),
        ({"mode": "inference", "steps": 5}, "steps", "steps = 0"),
        ({"devices": "gpu0"}, "devices", "auto, cpu, or CUDA indices"),
        ({"data": "missing.txt"}, "data", "not found"),
        ({"data": "notes.csv"}, "data", ".txt / .jsonl"),
        ({"steps": 25}, "resume.kill_after_checkpoint", "raise steps"),
        ({"lora_r": 0}, "lora.r", "at least 1"),
        ({"batch_size": "4"}, "batch_size", "expected int"),
    ],
)
def test_bad_values_name_the_field_and_what_to_change(overrides, field, hint):
    with pytest.raises(SpecError) as info:
        RunSpec.build(**overrides)
    assert info.value.field == field
    assert hint in info.value.message


def test_unknown_toml_key_is_named(tmp_path):
    path = tmp_path / "spec.toml"
    path.write_text("batchsize = 4\n")
    with pytest.raises(SpecError) as info:
        RunSpec.build(path)
    assert info.value.field == "batchsize" and "batch_size" in info.value.message


def test_invalid_toml_is_a_spec_error(tmp_path):
    path = tmp_path / "spec.toml"
    path.write_text("mode = \n")
    with pytest.raises(SpecError, match="not valid TOML"):
        RunSpec.build(path)


def test_seq_len_above_max_position_embeddings_is_named():
    spec = RunSpec.build(seq_len=512)
    with pytest.raises(SpecError) as info:
        validate_against_config(spec, 256)
    assert info.value.field == "seq_len" and "at most 256" in info.value.message
    validate_against_config(RunSpec.build(seq_len=256), 256)  # the limit itself is allowed
    validate_against_config(spec, None)  # a config that declares no limit


def test_lora_target_missing_from_model_lists_the_modules():
    with pytest.raises(SpecError) as info:
        validate_against_config(RunSpec.build(lora_targets="qkv"), None, {"q_proj", "v_proj"})
    assert info.value.field == "lora.targets" and "q_proj, v_proj" in info.value.message


def test_parse_devices():
    assert parse_devices("auto") == ["auto"]
    assert parse_devices("cpu") == ["cpu"]
    assert parse_devices("0,cuda:1") == ["cuda:0", "cuda:1"]
    with pytest.raises(SpecError, match="twice"):
        parse_devices("0,0")


def test_planned_boxes_are_valid_specs_but_not_run_devices():
    from core.devicespec import device_count, parse_device_capacities

    assert RunSpec.build(devices="8x80GiB").devices == "8x80GiB"
    assert device_count("8x80GiB") == 8 and device_count("24GiB,8GiB") == 2
    assert device_count("cpu") == 1 and device_count("0,1") == 2 and device_count("auto") is None
    assert parse_device_capacities("2x24GB") == [24 * 10**9] * 2  # GB is decimal, GiB binary
    assert parse_device_capacities("2x24GiB") == [24 * 2**30] * 2
    with pytest.raises(SpecError) as info:
        parse_devices("2x80GiB")
    assert info.value.field == "devices" and "plan it with `gpuaccept plan`" in info.value.message


def test_spec_hash_is_stable_across_processes():
    code = "from core.spec import RunSpec; print(RunSpec.build(mode='full', seed=7).spec_hash())"
    hashes = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(hashes) == 1
    assert RunSpec.build(mode="full", seed=7).spec_hash() in hashes
    assert RunSpec.build(mode="full", seed=8).spec_hash() not in hashes


def test_round_trip_through_dict():
    spec = RunSpec.build(mode="full", batch_size=2, lora_targets="q_proj")
    assert RunSpec.from_dict(spec.to_dict()) == spec
    assert spec.to_dict()["strategy"] == "single" and spec.to_dict()["tp"] == 1


@pytest.mark.parametrize(
    ("strategy", "tp", "devices"),
    [("ddp", 1, "0,1"), ("zero2", 1, "8x80GiB"), ("tp", 4, "8x80GiB"), ("device_map", 1, "24GiB,8GiB"), ("zero3", 1, "auto")],
)
def test_round_trip_with_a_strategy(strategy, tp, devices, tmp_path):
    import tomli_w

    spec = RunSpec.build(mode="full", strategy=strategy, tp=tp, devices=devices)
    assert (spec.strategy, spec.tp, spec.devices) == (strategy, tp, devices)
    assert RunSpec.from_dict(spec.to_dict()) == spec
    path = tmp_path / "spec.toml"  # the run directory's spec.toml reads back to the same spec
    path.write_text(tomli_w.dumps(spec.to_dict()))
    assert RunSpec.build(path) == spec


def test_strategy_and_tp_from_toml(tmp_path):
    path = tmp_path / "spec.toml"
    path.write_text('mode = "full"\nstrategy = "fsdp"\ndevices = ["24GiB", "8GiB"]\n')
    spec = RunSpec.build(path)
    assert spec.strategy == "zero3" and spec.devices == "24GiB,8GiB"
    assert RunSpec.build(path, strategy="tp", tp=2).tp == 2  # flags win


@pytest.mark.parametrize(("toml", "field", "says"), [
    ('lora = "abc"', "lora", "must be a table [lora]"),
    ("resume = 5", "resume", "must be a table [resume]"),
    ("[[lora]]\nr = 4", "lora", "an array of tables ([[lora]])"),
    ("[lora]\ntargets = [1, 2]", "lora.targets", "a list of strings"),
    ("learning_rate = nan", "learning_rate", "finite"),
    ("learning_rate = inf", "learning_rate", "finite"),
    ("heldout_fraction = -inf", "heldout_fraction", "finite"),
    ("seed = -1", "seed", "between 0 and 2**32 - 1"),
    ("seed = 4294967296", "seed", "between 0 and 2**32 - 1"),
    ("seed = 18446744073709551616", "seed", "out of range"),
    ("steps = 9223372036854775807", "steps", "at most 1,000,000"),
    ("batch_size = 4.5", "batch_size", "expected int"),
])
def test_spec_types_and_ranges_are_named_errors(toml, field, says):
    """Issue 16: these were an internal error, or accepted (nan, inf, a seed numpy refuses, 2**63 - 1 steps)."""
    import tomllib

    with pytest.raises(SpecError) as info:
        RunSpec.from_dict(tomllib.loads(toml))
    assert info.value.field == field and says in info.value.message


@pytest.mark.parametrize("content", [b"\xff\xfe\x00m\x00o\x00d\x00e", "mode = 'lora'".encode("utf-16"), b"\x00\x01\x02"])
def test_a_binary_or_utf16_spec_file_is_a_named_error(tmp_path, content):
    path = tmp_path / "spec.toml"
    path.write_bytes(content)
    with pytest.raises(SpecError) as info:
        RunSpec.build(path)
    assert info.value.field == "spec" and ("UTF-8" in info.value.message or "not valid TOML" in info.value.message)


def test_a_draft_names_every_field_at_fault_and_keeps_the_rest():
    """The form's view of validate: one error per field, each refused value at its default in the stand-in."""
    from core.specdraft import draft_spec

    draft = draft_spec({"mode": "lora", "batch_size": 0, "seq_len": 1, "lora_r": 0, "steps": 40},
                       refused={"grad_accum": "a whole number"})
    assert draft.spec is None
    assert set(draft.errors) == {"batch_size", "seq_len", "lora.r", "grad_accum"}, draft.errors
    assert "at least 2 tokens" in draft.errors["seq_len"]
    defaults = RunSpec.build(mode="lora")
    assert draft.stand_in is not None
    assert (draft.stand_in.batch_size, draft.stand_in.seq_len, draft.stand_in.lora.r) == (
        defaults.batch_size, defaults.seq_len, defaults.lora.r)
    assert draft.stand_in.steps == 40  # what was not refused is kept
    ok = draft_spec({"mode": "full", "batch_size": 3})
    assert ok.errors == {} and ok.spec == ok.stand_in and ok.spec.batch_size == 3


def test_a_draft_stops_at_a_rule_it_cannot_undo():
    """An error on a field the caller did not give (here the mode's default steps against warmup) ends the search."""
    from core.specdraft import draft_spec

    draft = draft_spec({"mode": "lora", "warmup_steps": 10**6, "batch_size": 0})
    assert draft.spec is None
    assert "warmup_steps" in draft.errors or "batch_size" in draft.errors
    assert all(field in ("warmup_steps", "batch_size") for field in draft.errors)


def test_config_problems_names_both_the_sequence_and_the_targets():
    from core.specdraft import config_problems

    spec = RunSpec.build(mode="lora", seq_len=4096, lora_targets="q_proj,qq_proj")
    problems = config_problems(spec, 256, {"q_proj", "v_proj"})
    assert [p.field for p in problems] == ["seq_len", "lora.targets"]
    with pytest.raises(SpecError, match="max_position_embeddings"):
        validate_against_config(spec, 256, {"q_proj", "v_proj"})


@pytest.mark.parametrize(("overrides", "field", "says"), [
    ({"mode": "qlora", "precision": "amp", "dtype": "bf16"}, "precision", "no fp32 master copy"),
    ({"mode": "qlora", "strategy": "ddp", "devices": "0,1"}, "strategy", "one process in this version"),
    ({"mode": "lora", "qlora_quant_type": "fp4"}, "qlora", "apply to mode qlora"),
    ({"mode": "qlora", "qlora_quant_type": "int4"}, "qlora.quant_type", "choose nf4"),
    ({"mode": "qlora", "lora_r": 0}, "lora.r", "at least 1"),
])
def test_qlora_settings_are_refused_by_name(overrides, field, says):
    """Refused when the spec is read, or (what is planned but not run: QLoRA over several processes, FSDP-QLoRA)
    before a run."""
    with pytest.raises(SpecError) as err:
        spec = RunSpec.build(**overrides)
        spec.method.check_run(spec)
    assert err.value.field == field and says in err.value.message


def test_qlora_keeps_its_4_bit_settings_and_every_other_spec_hashes_as_before(tmp_path):
    """The [qlora] table belongs to mode qlora: a LoRA spec's dict (and so its hash, and every record written before
    the variant) is unchanged; a QLoRA spec round-trips through TOML with its settings, flags as the file."""
    lora = RunSpec.build(mode="lora")
    assert "qlora" not in lora.to_dict() and lora.spec_hash() == RunSpec.from_dict(lora.to_dict()).spec_hash()
    spec = RunSpec.build(mode="qlora", qlora_quant_type="fp4", qlora_double_quant=False, dtype="bf16")
    assert spec.to_dict()["qlora"] == {"quant_type": "fp4", "double_quant": False}  # bitsandbytes: at its default
    assert spec.adapters and spec.base_mode == "lora" and spec.param_dtype == "fp32" and spec.autocast
    path = tmp_path / "q.toml"
    path.write_text('mode = "qlora"\ndtype = "bf16"\n[qlora]\nquant_type = "fp4"\ndouble_quant = false\n')
    assert RunSpec.build(path) == spec
