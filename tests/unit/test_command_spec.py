"""Command mode's pure parts: the spec and its refusals, the readers of what a run leaves, the plan of what ran, the
step comparison of the resume check and the evaluation's criterion (no process is started here)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from core.commandspec import CommandSpec, read_command_table, substitute
from core.errors import SpecError

PY = sys.executable
CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


def spec(**kw):
    return CommandSpec.from_dict({"train": f"{PY} train.py --output_dir {{out}}", **kw})


@pytest.mark.parametrize("raw, field, words", [
    ({"train": f"{PY} train.py"}, "command.train", "put {out} where your script takes its output folder"),
    ({"train": f"{PY} train.py --config {CONFIGS / 'trl_sft_qlora.yaml'} --output_dir out"}, "command.train",
     "sets --output_dir itself"),
    ({"train": f"{PY} train.py --config {CONFIGS / 'trl_sft_qlora.yaml'} --output-dir out"}, "command.train",
     "sets --output-dir itself"),  # issue 52: transformers takes the dash spelling too
    ({"train": ""}, "command.train", "the training command is missing"),
    ({"train": f"{PY} train.py --config {CONFIGS / 'trl_sft_qlora.yaml'}", "resume": "--resume {checkpoint}"},
     "command.resume", "start the resume command with {command}"),
    ({"train": f"{PY} train.py --out {{out}} > log.txt"}, "command.train", "runs without a shell"),
    ({"train": f"{PY} train.py --out {{out}}", "resume": "{command} --resume"}, "command.resume", "{checkpoint}"),
    ({"train": f"{PY} train.py --out {{out}}", "resume": "x{command} {checkpoint}"}, "command.resume",
     "stands alone"),
    ({"train": "no-such-program-here --out {out}"}, "command.train", "not found"),
    ({"train": f"{PY} t.py --out {{out}}", "checkpoints": "/abs/checkpoint-*"}, "command.checkpoints",
     "inside the run's output folder"),
    ({"train": f"{PY} t.py --out {{out}} --model {{model}}"}, "command.model", "give the base model folder"),
    ({"train": f"{PY} t.py --out {{out}}", "eval": f"{PY} eval.py"}, "command.eval", "{checkpoint}"),
    ({"train": f"{PY} t.py --out {{out}}", "kill_after_checkpoint": 0}, "command.kill_after_checkpoint",
     "at least 1"),
    ({"train": f"{PY} t.py --out {{out}}", "batch_size": 4}, "command.batch_size", "unknown setting"),
    ({"train": f"{PY} t.py --out {{out}}", "eval_max_blocks": "8"}, "command.eval_max_blocks", "not an integer"),
    ({"train": f"{PY} 't.py --out {{out}}"}, "command.train", "close the quote"),
])
def test_a_command_gpuaccept_cannot_run_as_asked_is_refused_naming_the_field(raw, field, words):
    with pytest.raises(SpecError) as err:
        CommandSpec.from_dict(raw)
    assert err.value.field == field and words in str(err.value)


def test_the_resume_command_holds_the_training_commands_words_and_placeholders_stay_one_word():
    s = spec(resume="{command} --resume_from_checkpoint {checkpoint}")
    assert s.resume_words() == [PY, "train.py", "--output_dir", "{out}", "--resume_from_checkpoint", "{checkpoint}"]
    argv = substitute(s.resume_words(), {"{out}": "/runs/a b/out", "{checkpoint}": "/runs/a b/ck-2"})
    assert argv[3] == "/runs/a b/out" and argv[-1] == "/runs/a b/ck-2" and len(argv) == 6
    assert s.label == "train.py" and s.uses("{out}") and not s.uses("{train_data}")


def test_the_spec_hash_is_of_the_whole_command_table():
    a, b = spec(), spec(kill_after_checkpoint=2)
    assert a.spec_hash() == spec().spec_hash() and a.spec_hash() != b.spec_hash()
    assert a.to_dict()["mode"] == "command" and a.to_dict()["command"]["train"] == a.train


def test_a_spec_file_holds_command_mode_in_its_command_table_alone(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text(f'[command]\ntrain = "{PY} t.py --out {{out}}"\nmetrics = "metrics.jsonl"\n'
                    '[command.env]\nWANDB_MODE = "offline"\n')
    assert read_command_table(good)["metrics"] == "metrics.jsonl"
    assert CommandSpec.from_file(good).env == {"WANDB_MODE": "offline"}
    mixed = tmp_path / "mixed.toml"
    mixed.write_text(f'batch_size = 4\n[command]\ntrain = "{PY} t.py --out {{out}}"\n')
    with pytest.raises(SpecError, match="belong to gpuaccept's own recipe"):
        CommandSpec.from_file(mixed)


# ------------------------------------------------------------------------------------------- what a run leaves
def test_the_metrics_file_is_read_as_it_grows_and_bad_lines_are_named(tmp_path):
    from core.command.reports import MetricsFile, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.5, "lr": 0.1}\nnot json\n{"step": 2}\n{"step": 3, "loss": 2.0')
    m = MetricsFile(path)
    got = read_metrics(m)
    assert [(s.step, s.loss, s.learning_rate) for s in got] == [(1, 2.5, 0.1)]
    assert m.problems == ["metrics.jsonl line 2: not JSON", "metrics.jsonl line 3: needs an integer step and a finite loss"]
    with open(path, "a") as f:  # the partial last line completes
        f.write(', "sample_ids": [4, 7]}\n')
    assert [(s.step, s.sample_ids) for s in read_metrics(m)] == [(3, [4, 7])]



def test_a_csv_metrics_file_is_read_as_lightning_writes_it_rewritten_with_a_wider_header(tmp_path):
    """Lightning's CSVLogger (LitGPT's default logger) appends rows, and rewrites the file with a wider header when a
    metric first appears (``val_loss``); rows without a loss are other metrics, a bad loss is named."""
    from core.command.reports import MetricsFile, read_metrics

    path = tmp_path / "metrics.csv"
    path.write_text("epoch,iter,learning_rate,loss,step\n0,1,0.001,10.81,1\n0,2,0.0009,10.8")
    m = MetricsFile(path)
    assert [(s.step, s.loss, s.learning_rate) for s in read_metrics(m)] == [(1, 10.81, 0.001)]
    path.write_text("epoch,iter,learning_rate,loss,step,val_loss\n0,1,0.001,10.81,1,\n0,2,0.0009,10.8,2,\n"
                    ",,,,2,10.9\n0,3,0.0007,nan,3,\n0,4,0.0005,10.7,4,\n")
    assert [(s.step, s.loss) for s in read_metrics(m)] == [(2, 10.8), (4, 10.7)]
    assert m.problems == ["metrics.csv line 5: needs an integer step and a finite loss"]
    assert read_metrics(m) == [] and [s.step for s in m.steps] == [1, 2, 4]

def test_checkpoints_are_ordered_by_the_number_in_their_name(tmp_path):
    from core.stages.checkpoint import list_checkpoints

    for name in ("checkpoint-10", "checkpoint-9", "checkpoint-last"):
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-11").write_text("a file")
    found, skipped = list_checkpoints(tmp_path, "checkpoint-*")
    assert [(c.step, c.name) for c in found] == [(9, "checkpoint-9"), (10, "checkpoint-10")]
    assert skipped == ["checkpoint-11: a file, not a folder (checkpoints are read as folders of files)",
                       "checkpoint-last: no step number in its name"]


# ------------------------------------------------------------------------------------------- the plan of what ran
def trainer(**kw):
    base = {"world_size": 1, "device": "cpu", "parameters": 1000, "trainable_parameters": 1000,
            "parameter_dtypes": {"float32": {"trainable": 1000, "frozen": 0}}, "attn_implementation": "sdpa",
            "config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                       "max_position_embeddings": 256},
            "arguments": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "optim": "adamw_torch",
                          "max_steps": 5, "bf16": False, "fp16": False}}
    for k, v in kw.items():
        if k == "arguments":
            base["arguments"] = {**base["arguments"], **v}
        else:
            base[k] = v
    return base


BATCHES = [{"widths": [48], "padded": False}, {"widths": [64, 40], "padded": True}]


@pytest.mark.parametrize("report, want", [
    (trainer(), dict(mode="full", dtype="fp32", precision="pure", batch_size=2, grad_accum=3, seq_len=64,
                     padding="padded", optimizer="adamw", strategy="single", devices="cpu")),
    (trainer(arguments={"bf16": True}), dict(dtype="bf16", precision="amp")),
    (trainer(parameter_dtypes={"bfloat16": {"trainable": 8, "frozen": 992}}, trainable_parameters=8,
             peft={"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["v_proj", "q_proj"]}),
     dict(mode="lora", dtype="bf16", precision="pure")),
    (trainer(world_size=2), dict(strategy="ddp", devices="cpu")),
    (trainer(arguments={"optim": "adamw_bnb_8bit"}), dict(optimizer="adamw_8bit")),
])
def test_the_plan_is_made_from_what_the_trainer_reported(tmp_path, report, want):
    from core.command.plan import spec_from_run

    ran = spec_from_run(report, BATCHES, tmp_path / "config.json", 5)
    assert ran.spec is not None, ran.reason
    assert {k: getattr(ran.spec, k) for k in want} == want
    assert json.loads((tmp_path / "config.json").read_text())["hidden_size"] == 32
    if report["world_size"] == 2:
        assert ran.spec.torchrun.nproc_per_node == 2
    if report.get("peft"):
        assert ran.spec.lora.targets == ("q_proj", "v_proj") and ran.spec.lora.r == 4


@pytest.mark.parametrize("report, words", [
    (None, "no transformers Trainer"),
    (trainer(trainable_parameters=10), "partly frozen"),
    (trainer(arguments={"deepspeed": "ds.json"}), "DeepSpeed"),
    (trainer(arguments={"optim": "lion_32bit"}), "lion_32bit"),
    (trainer(attn_implementation="flex_attention"), "flex_attention"),
])
def test_what_the_planner_does_not_model_gets_no_plan_and_says_why(tmp_path, report, words):
    from core.command.plan import spec_from_run

    ran = spec_from_run(report, BATCHES, tmp_path / "config.json", 5)
    assert ran.spec is None and words in ran.reason


# ------------------------------------------------------------------------------------------- the resume comparison
def steps(losses, start=1, lr=True, ids=True):
    from core.command.reports import StepRecord

    return [StepRecord(step=start + i, loss=x, learning_rate=0.1 if lr else None, sample_ids=[start + i] if ids else None)
            for i, x in enumerate(losses)]


def test_a_resume_that_continues_the_run_passes_the_step_checks():
    from core.command.resumechecks import compare_steps
    from core.stages.noise import required_tier

    ref = steps([5.0, 4.0, 3.5, 3.2, 3.0, 2.9])
    not_compared: list[str] = []
    checks, rows = compare_steps(ref, steps([5.0, 4.0, 3.5]), steps([3.5, 3.2, 3.0, 2.9], start=3), 2,
                                 required_tier("cpu", "fp32"), not_compared)
    assert [(c.name, c.status) for c in checks] == [("global_steps", "pass"), ("reproducible", "pass"),
                                                    ("learning_rate", "pass"), ("sample_ids", "pass"),
                                                    ("loss", "pass")]
    assert [r["step"] for r in rows] == [3, 4, 5, 6] and not_compared == []


def test_a_resume_that_drifts_fails_naming_the_steps_and_what_was_not_in_the_metrics():
    from core.command.resumechecks import compare_steps
    from core.stages.noise import required_tier

    ref = steps([5.0, 4.0, 3.5, 3.2, 3.0, 2.9], lr=False, ids=False)
    not_compared: list[str] = []
    checks, _ = compare_steps(ref, steps([5.0, 4.0, 3.5], lr=False, ids=False),
                              steps([3.5, 3.3, 3.1], start=3, lr=False, ids=False), 2,
                              required_tier("cpu", "fp32"), not_compared)
    by = {c.name: c for c in checks}
    assert by["global_steps"].status == "fail" and "resumed steps 3-5, expected 3-6" in by["global_steps"].evidence
    assert by["loss"].status == "fail" and "steps 4-5" in by["loss"].evidence
    assert abs(by["loss"].largest_difference - 0.1) < 1e-9
    assert [n.split(":")[0] for n in not_compared] == ["learning rate", "sample ids"]


def test_a_command_that_does_not_give_the_same_run_twice_is_named_before_any_resume_is_judged():
    from core.command.resumechecks import compare_steps
    from core.stages.noise import required_tier

    ref = steps([5.0, 4.0, 3.5, 3.2])
    checks, _ = compare_steps(ref, steps([5.0, 4.1, 3.6]), steps([3.2], start=4), 3, required_tier("cpu", "fp32"), [])
    repro = next(c for c in checks if c.name == "reproducible")
    assert repro.status == "fail" and "at steps 2-3" in repro.evidence and "set_seed" in repro.evidence


def test_loaded_states_are_compared_to_the_first_difference():
    import torch

    from core.stages.states import first_difference

    a = {"torch": torch.arange(4, dtype=torch.uint8), "python": (3, (1, 2, 3), None), "lr": [0.1]}
    assert first_difference(a, {**a, "python": (3, (1, 2, 3), None)}) is None
    assert first_difference(a, {**a, "python": (3, (1, 9, 3), None)}) == "python[1][1]"
    assert first_difference(a, {**a, "torch": torch.zeros(4, dtype=torch.uint8)}) == "torch"
    assert first_difference({"lr": 0.1}, {"lr": 0.1 + 1e-9}) == "lr"
    # numbers within 4 x the noise family's spread at the same place (a JSON state of a script under a twin tier):
    # the root mean square of its pairs' differences 1e-9, 1.3e-9 and 3e-10 is 9.6e-10, the bound 3.85e-9
    family, pairs = [{"lr": 0.1}, {"lr": 0.1 + 1e-9}, {"lr": 0.1 + 1.3e-9}], [(0, 1), (0, 2), (1, 2)]
    assert first_difference({"lr": 0.1}, {"lr": 0.1 + 3.7e-9}, family=family, multiple=4.0, pairs=pairs) is None
    assert first_difference({"lr": 0.1}, {"lr": 0.1 + 4.0e-9}, family=family, multiple=4.0, pairs=pairs) == "lr"
    assert first_difference({"lr": 0.1}, {"lr": 0.1 + 1e-9}, family=family[:1] * 2, multiple=4.0,
                            pairs=pairs[:1]) == "lr"  # a family that drew no noise bounds nothing



def _combined_checkpoint(folder: Path, weight: float, moment: float, step: int = 6) -> Path:
    """A checkpoint whose one pickle holds everything, as LitGPT's ``lit_model.pth`` (weights, AdamW, the schedule
    and the step counter), with the weight and first moment given."""
    import torch

    path = folder / f"step-{step:06d}"
    path.mkdir(parents=True)
    state = {"model": {"w": torch.full((4,), weight), "b": torch.zeros(2)},
             "optimizer": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.full((4,), moment),
                                         "exp_avg_sq": torch.full((4,), 1e-4)}},
                           "param_groups": [{"lr": 1e-3, "params": [0]}]},
             "scheduler": {"last_epoch": step}, "step_count": step}
    torch.save(state, path / "lit_model.pth")
    return path


def test_a_combined_pickle_is_compared_entry_by_entry_as_what_each_entry_is(tmp_path):
    """Under a twin tier, noise in the weights and moments of a one-pickle checkpoint within 4 x the twin's passes (a
    whole-pickle exact comparison failed every correct resume on a GPU); a weight off by far more fails as weights; a
    step counter off by one fails exactly, by its entry."""
    from core.stages.noise import Family, required_tier
    from core.stages.states import Noisy, compare_final_files

    twin_tier = required_tier("cuda:0", "bf16")
    ref = _combined_checkpoint(tmp_path / "ref", 1.0, 0.5)
    twin = Noisy([ref, _combined_checkpoint(tmp_path / "twin", 1.0 + 2e-3, 0.5 + 2e-3)], Family.of(1, True))

    def checks(weight: float, moment: float, step: int = 6, tier=twin_tier) -> dict[str, tuple[str, str]]:
        folder = tmp_path / f"res-{weight}-{moment}-{step}-{tier.method}"
        res = _combined_checkpoint(folder, weight, moment)
        if step != 6:
            import torch

            state = torch.load(res / "lit_model.pth")
            torch.save({**state, "step_count": step}, res / "lit_model.pth")
        got = compare_final_files(ref, res, twin if not tier.exact else None, tier, [])
        return {c.name: (c.status, c.evidence) for c in got}

    noisy = checks(1.0 + 1e-3, 0.5 - 1e-3)
    assert {k: v[0] for k, v in noisy.items()} == {"final_checkpoint": "pass", "optimizer_progress": "pass",
                                                   "optimizer_moments": "pass", "final_weights": "pass",
                                                   "states": "pass"}
    assert noisy["final_weights"][1].startswith("2 tensors of lit_model.pth[model]")
    assert noisy["optimizer_moments"][1].startswith("lit_model.pth[optimizer]: ")
    assert checks(1.5, 0.5)["final_weights"][0] == "fail"
    assert checks(1.0, 0.5, step=5)["states"] == ("fail", "lit_model.pth[step_count] differs at the top")
    exact = checks(1.0 + 1e-3, 0.5, tier=required_tier("cpu", "fp32"))  # on the CPU the same noise is a fault
    assert exact["final_weights"][0] == "fail" and exact["optimizer_moments"][0] == "pass"

# ------------------------------------------------------------------------------------------- the evaluation
def test_the_evaluation_passes_only_when_training_improved_on_the_base():
    from core.command.evaluate import _judged

    common = {"checkpoint": "checkpoint-6", "checkpoint_step": 6, "base": "/m", "independence": "x"}
    lower = _judged("perplexity", "d", False, {"value": 20.0}, {"value": 17.5}, {}, "", common)
    assert lower.status == "pass" and "20 -> 17.5" in lower.summary
    assert _judged("perplexity", "d", False, {"value": 20.0}, {"value": 21.0}, {}, "", common).status == "fail"
    assert _judged("accuracy", "d", True, {"value": 0.5}, {"value": 0.6}, {}, "", common).status == "pass"
    alone = _judged("perplexity", "d", False, None, {"value": 17.5}, {}, "", common)
    assert alone.status == "fail" and "nothing to compare it with" in alone.summary


def test_the_evaluation_commands_result_is_its_last_json_line_with_a_metric(tmp_path):
    from core.command.evaluate import last_json

    log = tmp_path / "command.log"
    log.write_text('loading...\n{"metric": "accuracy", "value": 0.5}\n{"note": 1}\n{"metric": "accuracy", '
                   '"value": 0.71, "higher_is_better": true}\ndone\n')
    assert last_json(log) == {"metric": "accuracy", "value": 0.71, "higher_is_better": True}
    log.write_text('{"metric": "accuracy", "value": NaN}\n')
    assert last_json(log) is None


def test_a_checkpoint_of_a_trainer_must_hold_what_trainer_resumes_from():
    from core.command.resumechecks import required_files
    from core.stages.checkpoint import missing

    plain = spec()
    assert list(required_files(plain, {"peft": {"r": 8}}, 1).values()) == [
        "adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state.pth"]
    assert list(required_files(plain, {"arguments": {"fp16": True}}, 2).values())[-3:] == [
        "rng_state_0.pth", "rng_state_1.pth", "scaler.pt"]
    assert required_files(plain, None, 1) == {}  # a script: gpuaccept cannot know what its checkpoint holds
    listed = required_files(spec(checkpoint_files=["a.pt"]), {"peft": True}, 1)
    assert listed == {"a.pt": "a.pt"} and missing(Path("/nonexistent"), listed) == ["a.pt"]


def test_outside_the_gpus_memory_of_the_job_comes_from_nvmls_per_process_list(tmp_path):
    """With an NVML backend, each CUDA device's memory held by the job's processes is sampled beside their RSS, and
    a device only the outside view saw is judged by it (a script without Trainer on a GPU)."""
    import os
    import subprocess as sp

    from core.command.probe import build_probe
    from core.command.process import Job, sample_memory
    from core.command.run import RunOutcome
    from core.monitor.sampler import DeviceSample, Reading

    class FakeNvml:
        name = "nvml"

        def sample(self, pids):
            assert os.getpid() not in pids and pids  # the job's processes, not gpuaccept
            r = Reading(3 * 2**30)
            return [DeviceSample(0.0, "cuda:0", "GPU", "nvml", Reading(80 * 2**30), r, r, r, Reading(0)),
                    DeviceSample(0.0, "nvml:1", "GPU", "nvml", Reading(80 * 2**30), r, r, r, Reading(0))]

    import psutil

    # in the keeper's place (core/command/keeper.py), a process whose child is the job's
    proc = sp.Popen([sys.executable, "-c", "import subprocess, sys; "
                     "subprocess.run([sys.executable, '-c', 'import time; time.sleep(30)'])"])
    try:
        while not psutil.Process(proc.pid).children():
            time.sleep(0.02)
        job = Job("x", [], tmp_path, proc, "token", 0.0)
        sample = sample_memory(job, FakeNvml())
        assert sample["cuda:0"] == 3 * 2**30 and "nvml:1" not in sample and sample["cpu"] > 0
    finally:
        for child in psutil.Process(proc.pid).children():
            child.kill()
        proc.kill()
        proc.wait()
    outcome = RunOutcome("reference", [], tmp_path, tmp_path, tmp_path / "log", exit_code=0, peaks=job.peaks)
    probe = build_probe(outcome, {"cuda:0": (80 * 2**30, "torch.cuda total memory"), "cpu": (64 * 2**30, "host")})
    row = next(d for d in probe.devices if d.device == "cuda:0")
    assert row.measured_bytes == 3 * 2**30 and row.fits and "NVML" in row.method and probe.status == "pass"


def test_a_quoted_shell_character_is_an_argument_and_an_unquoted_one_is_refused():
    assert spec(train=f"{PY} train.py --sep '|' --out {{out}} --cmp '>5'").words()[3] == "|"
    with pytest.raises(SpecError, match="runs without a shell"):
        spec(train=f"{PY} train.py --out {{out}} | tee log")


def test_a_recipe_flag_in_command_mode_is_refused_under_its_own_name(tmp_path):
    from tui.flags import build_parser, command_spec_from_args

    args = build_parser().parse_args(["run", "--command", f"{PY} t.py --out {{out}}", "--kill-at", "boundary"])
    with pytest.raises(SpecError, match="--kill-at applies to gpuaccept's own recipe"):
        command_spec_from_args(args)


TORCHRUN_2 = f"{PY} -m torch.distributed.run --nnodes 2 --nproc-per-node 4 --rdzv-endpoint n0:29500 t.py --out {{out}}"


@pytest.mark.parametrize("raw, field, words", [
    ({"train": TORCHRUN_2, "resume_check": False}, "command.nnodes",
     "your launcher line runs on 2 nodes (--nnodes 2) and gpuaccept was told 1"),
    ({"train": f"{PY} -m torch.distributed.run --nproc-per-node 1 t.py --out {{out}}", "nnodes": 2,
      "rdzv_endpoint": "n0:29500", "resume_check": False}, "command.nnodes",
     "your launcher line runs on one node (torchrun's default) and gpuaccept was told 2"),
    ({"train": TORCHRUN_2, "nnodes": 2, "resume_check": False}, "command.rdzv_endpoint", "host:port every node"),
])
def test_a_launcher_line_across_nodes_needs_gpuaccept_told_so(raw, field, words):
    with pytest.raises(SpecError) as err:
        CommandSpec.from_dict(raw)
    assert err.value.field == field and words in str(err.value)
    # told so, its resume check is taken across the nodes (one of them lost: core/command/nodeloss.py)
    assert CommandSpec.from_dict({"train": TORCHRUN_2, "nnodes": 2, "rdzv_endpoint": "n0:29500"}).resume_check


def test_the_node_count_is_read_from_torchrun_options_not_from_the_scripts_own():
    from core.commandspec import launcher_nnodes

    assert launcher_nnodes(["torchrun", "--nnodes=1:4", "--nproc-per-node", "8", "t.py"]) == 4
    assert launcher_nnodes([PY, "-u", "-m", "torch.distributed.run", "--nnodes", "3", "t.py"]) == 3
    assert launcher_nnodes(["torchrun", "--standalone", "t.py", "--nnodes", "9"]) == 1  # the script's own flag
    assert launcher_nnodes([PY, "t.py", "--nnodes", "2"]) is None  # no launcher
    from tui.flags import build_parser, command_spec_from_args

    args = build_parser().parse_args(["run", "--command", TORCHRUN_2, "--nnodes", "2", "--rdzv-endpoint", "n0:29500",
                                      "--no-resume-check"])
    spec = command_spec_from_args(args)  # the recipe's flags of the same meaning set the command's
    assert (spec.nnodes, spec.rdzv_endpoint, spec.resume_check) == (2, "n0:29500", False)


def test_the_hook_is_not_installed_in_a_process_that_never_imports_transformers(tmp_path):
    """core/child/inject on PYTHONPATH: a Python process that never imports transformers' Trainer is not made to
    (the import hook waits for it), and says nothing. The hook's reports on a real Trainer, one per rank:
    tests/integration/test_command_mode.py."""
    import os
    import subprocess

    from core.command.process import INJECT_DIR

    env = {**os.environ, "PYTHONPATH": str(INJECT_DIR), "GPUACCEPT_EVENTS": str(tmp_path / "events.jsonl")}
    done = subprocess.run([sys.executable, "-c", "import sys; print('transformers' in sys.modules, "
                           "'_gpuaccept_trainer_hook' in sys.modules)"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.stdout.split() == ["False", "True"] and done.stderr == ""
    assert not (tmp_path / "events.jsonl").exists()


def test_criteria_in_command_mode_come_from_the_accept_table_and_the_flags_and_the_others_are_refused(tmp_path):
    """Command mode applies the criteria it can judge (core/criteria.py COMMAND_CRITERIA), from the spec file's
    [accept] table with the flags over it; a criterion only the recipe measures is refused by name, not dropped."""
    from tui.flags import build_parser, command_criteria_from_args, command_spec_from_args

    spec = tmp_path / "job.toml"
    spec.write_text(f'[command]\ntrain = "{PY} t.py --out {{out}}"\n[accept]\nmax_perplexity = 30\n'
                    'max_step_time_s = 9.0\n')
    args = build_parser().parse_args(["run", str(spec), "--max-step-time", "2.5", "--max-device-share", "0.9"])
    assert command_spec_from_args(args).train.endswith("t.py --out {out}")
    crit = command_criteria_from_args(args)
    assert (crit.max_perplexity, crit.max_step_time_s, crit.max_device_share) == (30.0, 2.5, 0.9)
    args = build_parser().parse_args(["run", "--command", f"{PY} t.py --out {{out}}", "--min-accuracy", "0.5"])
    with pytest.raises(SpecError, match="min_accuracy judge what only gpuaccept's own recipe measures") as caught:
        command_criteria_from_args(args)
    assert caught.value.field == "accept.min_accuracy"


@pytest.mark.parametrize("name, flag, keys", [
    ("trl_sft_qlora.yaml", "--config", {"output_dir": "OUT"}),
    # torchtune: its metric logger's ${output_dir}/logs follows output_dir, so it is left as written
    ("torchtune_lora.yaml", "--config=", {"output_dir": "OUT", "metric_logger.log_dir": "${output_dir}/logs"}),
    ("litgpt_lora.yaml", "--config", {"out_dir": "OUT"}),
])
def test_a_command_without_out_writes_each_run_into_its_own_folder_through_its_configs_output_key(
        tmp_path, name, flag, keys):
    import yaml

    from core.command.configplan import run_words
    from core.importers.base import leaves

    (tmp_path / name).write_text((CONFIGS / name).read_text())
    config_word = f"{flag}{name}" if flag.endswith("=") else name
    words = [PY, "train.py"] + ([config_word] if flag.endswith("=") else [flag, config_word])
    s = CommandSpec.from_dict({"train": " ".join(words), "workdir": str(tmp_path)})
    out = tmp_path / "run" / "resume-resumed" / "out"
    argv = run_words(s, s.resume_words(), {"{checkpoint}": "CKPT"}, out)
    copy = out.parent / name.replace(".yaml", ".gpuaccept.yaml")
    config_at = [w for w in argv if copy.name in w]
    assert config_at == [f"{flag}{copy}" if flag.endswith("=") else str(copy)], argv
    assert argv[-2:] == ["--resume_from_checkpoint", "CKPT"] and str(out) not in argv
    written, original = leaves(yaml.safe_load(copy.read_text())), leaves(yaml.safe_load((CONFIGS / name).read_text()))
    assert {k: written[k] for k in keys} == {k: str(out) if v == "OUT" else v for k, v in keys.items()}
    assert {k: v for k, v in written.items() if k not in keys} == {k: v for k, v in original.items() if k not in keys}


def test_the_record_names_the_package_that_installed_the_program(tmp_path):
    """A console script's package and version, as its own interpreter reports them (gpuaccept's own script here); a
    shell script is said to be none."""
    import importlib.metadata
    import shutil

    from core.command.provenance import program_package

    found = program_package(shutil.which("gpuaccept", path=str(Path(PY).parent)))
    assert (found["name"], found["version"]) == ("gpuaccept", importlib.metadata.version("gpuaccept"))
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    assert program_package(str(script)) == {"package": "not a Python console script (no python on its #! line)"}
