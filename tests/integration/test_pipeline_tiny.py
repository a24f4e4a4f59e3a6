"""The whole pipeline on a tiny random Llama, for each mode: record tables, verdicts, resume checks, the kill."""

from __future__ import annotations

import tomllib
from pathlib import Path

from core.events import Progress, RunFinished, StageFinished
from core.pipeline import run_pipeline
from core.spec import RunSpec
from core.stages.childproc import group_alive
from tests.wizard_helpers import worker_processes


def run(spec: RunSpec, runs: Path) -> tuple[dict, list]:
    gen = run_pipeline(spec, runs_root=runs)
    events = list(gen)
    final = events[-1]
    assert isinstance(final, RunFinished)
    record = tomllib.loads(Path(final.record_path).read_text())
    return record, events


def test_lora_record_has_every_table_and_passes(lora_run):
    spec, record, events = lora_run
    for table in ("spec", "environment", "plan", "probe", "evaluation", "resume", "verdict"):
        assert table in record
    assert record["spec"]["hash"] == spec.spec_hash()
    assert record["resume"]["status"] == "pass", record["resume"]
    assert record["verdict"]["status"] == "pass", record["verdict"]
    assert record["plan"]["provenance"] == "estimated" and record["probe"]["provenance"] == "measured"
    traced = record["plan"]["traced"]  # made by the plan stage in a child process, beside the analytic plan
    assert traced["status"] == "estimated" and traced["compared_with"] == record["plan"]["devices"][0]["name"]
    assert traced["lines"]["weights"]["traced_bytes"] == record["plan"]["devices"][0]["components"]["weights"]
    assert record["evaluation"]["provenance"] == "measured"
    assert record["evaluation"]["after"]["perplexity"] < record["evaluation"]["before"]["perplexity"]
    assert record["created_utc"].tzinfo is not None


def test_lora_probe_times_its_untracked_steps_and_every_wait_is_named(lora_run):
    """Issue 34: the probe's speed is its untracked steps' (the tracker slows a step several times over on the CPU);
    each child's wait before its first step is said; the resume check's bar counts the steps of all its runs."""
    from core.events import Waiting

    spec, record, events = lora_run
    probe = record["probe"]
    assert spec.probe_steps == 3
    assert probe["timing"] | {"tracked_step_time_s": 0, "method": ""} == {
        "timed_steps": [3], "timed_tracked": False, "warmup_excluded": True, "tracked_steps": [1, 2],
        "tracked_step_time_s": 0, "method": ""}
    times = probe["devices"][0]["step_times_s"]
    assert len(times) == 3 and probe["step_time_s"] == times[2] and probe["timing"]["tracked_step_time_s"] == times[1]
    assert "step 3 untracked, warm-up step 1 left out; steps 1–2 tracked for memory" in \
        next(e.summary for e in events if isinstance(e, StageFinished) and e.stage == "probe")
    waits = [(e.stage, e.run, e.what) for e in events if isinstance(e, Waiting)]
    for stage, run in (("probe", "probe"), ("train_eval", "train"), ("resume", "interrupted"), ("resume", "resumed")):
        assert (stage, run, "loading the model") in waits, waits
    assert ("resume", "resumed", "loading the checkpoint and running its first step") in waits
    work = [e for e in events if isinstance(e, Progress) and e.stage == "resume"]
    done = [e.work_done for e in work]
    assert done == sorted(set(done)) and done[-1] == work[-1].work_total, done  # never back, to the end


def test_lora_resume_compares_every_resumed_step_exactly(lora_run):
    spec, record, _ = lora_run
    resume = record["resume"]
    c, k = spec.resume.kill_checkpoint_step(), spec.resume.kill_step()
    assert (resume["checkpoint_step"], resume["kill_step"]) == (c, k) == (4, 5)
    # issue 16: the interrupted run starts from a copy of the reference's checkpoint-2 (steps 3-5, killed inside 6)
    # and the resumed run trains one checkpoint interval (steps 5-6), not to step 8: 5 steps instead of 9
    every = spec.resume.checkpoint_every
    assert resume["interrupted_start_step"] == c - every == 2
    assert resume["compared_steps"] == [c + 1, c + every] == [5, 6] and c + every < spec.steps
    assert [row["step"] for row in resume["comparison"]] == [5, 6]
    assert resume["extra_steps"] == 3 + 2
    assert "compared at steps 5-6" in resume["summary"]
    assert all(row["difference"] == 0.0 for row in resume["comparison"])  # CPU fp32: exact tier
    checks = {ch["name"]: ch for ch in resume["checks"]}
    assert checks["final_weights"]["tier"] == "cpu-fp32-exact"
    assert "bit-identical" in checks["final_weights"]["evidence"]
    assert {"kill", "checkpoint_complete", "manifest", "learning_rate", "sample_ids", "optimizer_progress"} <= set(checks)
    assert "adapter weights (adapter_model.safetensors)" in checks["checkpoint_complete"]["evidence"]
    assert set(resume["checkpoint_manifest"]) >= {"adapter_model.safetensors", "optimizer.pt", "rng_state.pth"}


def test_no_process_of_the_killed_group_is_left(lora_run):
    _, record, _ = lora_run
    pgid = record["resume"]["killed_process_group"]
    assert pgid > 1 and not group_alive(pgid)


def test_lora_probe_measures_components_and_compares_with_the_plan(lora_run):
    _, record, _ = lora_run
    (device,) = record["probe"]["devices"]
    plan_device = record["plan"]["devices"][0]
    assert device["weights_bytes"] == plan_device["components"]["weights"]  # counted from live tensors, fp32
    assert device["gradients_bytes"] == plan_device["components"]["gradients"]
    assert device["optimizer_states_bytes"] >= plan_device["components"]["optimizer_states"]  # + step counters
    assert device["trainable_parameters"] == record["plan"]["parameters"]["trainable"]
    comparison = record["probe"]["plan_comparison"][0]
    # the plan's tensors: the bytes its fit is judged by, without the overhead line (the CPU runtime is not a tensor)
    assert comparison["planned_bytes"] == plan_device["fit_bytes"] - plan_device["components"]["overhead"]
    assert comparison["measured_bytes"] == device["peak_bytes"] > device["weights_bytes"]


def test_events_carry_progress_of_every_run(lora_run):
    spec, _, events = lora_run
    runs = {e.run for e in events if isinstance(e, Progress)}
    assert runs == {"probe", "train", "interrupted", "resumed"}
    stages = [e.stage for e in events if isinstance(e, StageFinished)]
    assert stages == ["plan", "probe", "train_eval", "resume", "record"]
    # one status live and in the record: each stage ended with the verdict engine's status, which the record states
    _, record, _ = lora_run
    live = {e.stage: str(e.status) for e in events if isinstance(e, StageFinished) and e.stage != "record"}
    stated = {name: s["status"] for name, s in record["verdict"]["stages"].items()}
    assert live == {"plan": stated["plan"], "probe": stated["probe"], "train_eval": stated["evaluation"],
                    "resume": stated["resume"]}


def test_full_fine_tuning_with_tied_embeddings_resumes(tiny_model_dir, tmp_path):
    spec = RunSpec.build(model=str(tiny_model_dir), mode="full", steps=6, seq_len=64, learning_rate=1e-3,
                         resume_checkpoint_every=2, resume_kill_after_checkpoint=1, eval_max_blocks=4)
    record, _ = run(spec, tmp_path)
    assert record["resume"]["status"] == "pass", record["resume"]["checks"]
    checks = {ch["name"]: ch for ch in record["resume"]["checks"]}
    assert "model weights (model.safetensors)" in checks["checkpoint_complete"]["evidence"]
    assert record["evaluation"]["after"]["perplexity"] < record["evaluation"]["before"]["perplexity"]
    assert record["probe"]["devices"][0]["trainable_parameters"] == record["plan"]["parameters"]["total"]


def test_inference_evaluates_once_and_resume_is_not_applicable(tiny_model_dir, tmp_path):
    spec = RunSpec.build(model=str(tiny_model_dir), mode="inference", seq_len=64, eval_max_blocks=4)
    record, _ = run(spec, tmp_path)
    assert record["resume"]["status"] == "not_applicable"
    assert record["evaluation"]["after"]["provenance"] == "not_run"
    assert record["evaluation"]["before"]["perplexity"] > 1.0
    assert record["probe"]["devices"][0]["gradients_bytes"] == 0
    assert record["verdict"]["status"] == "pass"


def test_stopping_the_pipeline_mid_probe_leaves_no_child(tiny_model_dir, tmp_path):
    spec = RunSpec.build(model=str(tiny_model_dir), mode="full", steps=6, seq_len=64, probe_steps=50,
                         resume_checkpoint_every=2, resume_kill_after_checkpoint=1)
    gen = run_pipeline(spec, runs_root=tmp_path)
    for event in gen:
        if isinstance(event, Progress) and event.run == "probe":
            assert worker_processes(tmp_path), "the probe child should be running now"
            break
    gen.close()  # what a Ctrl-C or a quitting UI does to the generator
    assert worker_processes(tmp_path) == []


def test_cancelling_kills_the_child_and_still_writes_the_record(tiny_model_dir, tmp_path):
    state = {"steps": 0}

    def cancelled() -> bool:
        return state["steps"] >= 1

    spec = RunSpec.build(model=str(tiny_model_dir), mode="full", steps=6, seq_len=64, probe_steps=50,
                         resume_checkpoint_every=2, resume_kill_after_checkpoint=1)
    events = []
    for event in run_pipeline(spec, runs_root=tmp_path, cancelled=cancelled):
        events.append(event)
        if isinstance(event, Progress):
            state["steps"] += 1
    assert worker_processes(tmp_path) == []
    record = tomllib.loads(Path(events[-1].record_path).read_text())
    assert record["verdict"]["status"] == "fail"
    assert record["probe"]["provenance"] == "not_run"
    assert record["verdict"]["stages"]["probe"]["status"] == "cancelled"
    assert "cancelled" in record["verdict"]["stages"]["probe"]["evidence"]
    assert record["verdict"]["stages"]["evaluation"]["status"] == "not_run"
    assert record["signoff"]["status"] == "unsigned"


def test_bf16_lora_on_a_16_bit_base_resumes_exactly_and_weighs_what_it_planned(tiny_model_dir, tmp_path):
    """precision pure (the default): the base loaded in bf16, the adapters fp32 (peft); the probe's live weights are
    the plan's weights line to the byte, and the CPU's kernels resume it bit for bit (the exact tier)."""
    spec = RunSpec.build(model=str(tiny_model_dir), mode="lora", dtype="bf16", steps=6, seq_len=64,
                         resume_checkpoint_every=2, resume_kill_after_checkpoint=1, eval_max_blocks=4)
    record, _ = run(spec, tmp_path)
    assert record["spec"]["precision"] == "pure" and record["verdict"]["status"] == "pass", record["verdict"]
    assert record["resume"]["status"] == "pass", record["resume"]["checks"]
    assert record["resume"]["tier"]["name"] == "cpu-bf16-exact" and record["resume"]["tier"]["multiple"] == 0.0
    plan = record["plan"]["devices"][0]
    adapters = record["plan"]["parameters"]["trainable"]
    base = record["plan"]["parameters"]["total"] - adapters
    assert record["probe"]["devices"][0]["weights_bytes"] == plan["components"]["weights"] == 2 * base + 4 * adapters
    assert record["probe"]["attention_implementation"] == "sdpa"
    assert record["probe"]["lora_targets_resolved"] == ["q_proj", "v_proj"]
    assert record["probe"]["lora_modules_adapted"] == 2 * 2  # 2 layers x (q, v)
    assert record["probe"]["findings"] == []  # no under-estimate
    # case R5: the checkpoint of a tied model saved, resumed, and the tie holds in the resumed run's final checkpoint
    from transformers import AutoModelForCausalLM

    last = record["resume"]["compared_steps"][1]  # the resumed run's last step: one interval after checkpoint-2
    assert last == 4
    final = Path(record["run_dir"]) / "resume-resumed" / "output" / f"checkpoint-{last}"
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_amp_probe_holds_fp32_weights_and_meets_its_plan(tiny_model_dir, tmp_path):
    """precision amp: fp32 master weights under bf16 autocast; the probe alone (real Trainer steps): its live weights
    are 4 B each, as planned, and its measured peak is the plan's within 1 % (the plan holds autocast's bf16 weight
    copies with the activations)."""
    from core.pipeline import AcceptanceRun

    spec = RunSpec.build(model=str(tiny_model_dir), mode="full", dtype="bf16", precision="amp", seq_len=64,
                         devices="cpu", probe_steps=2, resume_check=False)
    run = AcceptanceRun(spec, tmp_path, traced={"status": "not_run", "reason": "test"})
    list(run.probe_stage())
    run.close()
    probe = run.results["probe"]
    assert probe.status == "pass"
    (m,) = probe.devices
    assert m.weights_bytes == run.ctx.plan.devices[0].lines["weights"].bytes == 4 * run.ctx.plan.parameters.total
    (row,) = probe.comparisons
    assert abs(row.error_pct) < 1.0, row
    assert probe.findings == []


def test_inference_on_a_users_jsonl_file(tiny_model_dir, tmp_path):
    data = tmp_path / "notes.jsonl"
    data.write_text("\n".join(f'{{"id": "doc{i}", "text": "Document {i} says the number {i * 7} twice: {i * 7}."}}'
                              for i in range(40)))
    spec = RunSpec.build(model=str(tiny_model_dir), mode="inference", seq_len=16, data=str(data), heldout_fraction=0.3)
    record, _ = run(spec, tmp_path / "runs")
    assert record["data"]["source"] == str(data)
    assert record["data"]["heldout_documents"] + record["data"]["train_documents"] == 40
    assert record["evaluation"]["before"]["tokens"] > 0


def test_r1_r2_accumulation_4_killed_in_a_later_epoch_resumes_on_the_same_samples(tiny_model_dir, tmp_path):
    """Cases R1 and R2: gradient accumulation 4 on a small dataset, so the kill (after checkpoint 6, at step 7) lands
    in the third epoch; the resumed run must consume exactly the reference's sample ids, epochs and learning rates."""
    data = tmp_path / "small.jsonl"
    data.write_text("\n".join(f'{{"id": "d{i}", "text": "Note {i}: the value {i * 3} follows {i * 3 - 3}, and '
                              f'{i * 5} is five times {i}."}}' for i in range(16)))
    spec = RunSpec.build(model=str(tiny_model_dir), mode="lora", steps=8, seq_len=16, batch_size=2, grad_accum=4,
                         data=str(data), heldout_fraction=0.25, resume_checkpoint_every=2,
                         resume_kill_after_checkpoint=3, eval_max_blocks=4)
    record, events = run(spec, tmp_path / "runs")
    assert record["resume"]["status"] == "pass", record["resume"]["checks"]
    checks = {ch["name"]: ch for ch in record["resume"]["checks"]}
    assert checks["sample_ids"]["status"] == checks["epoch"]["status"] == checks["learning_rate"]["status"] == "pass"
    assert record["resume"]["kill_step"] == 7 and record["resume"]["checkpoint_step"] == 6
    epochs = record["evaluation"]["epoch_per_step"]
    assert epochs[5] >= 2.0 and epochs[6] > 2.0, epochs  # killed at step 7, in the third epoch


def test_a_checkpoint_every_step_resumes_with_the_default_kill_point(tiny_model_dir, tmp_path):
    """Issue 16: --checkpoint-every 1 --kill-after-checkpoint 2 with the default boundary+1 failed every time (the kill
    came after checkpoint-3 was written). Now the kill is inside step 3, after checkpoint-2 and before checkpoint-3."""
    spec = RunSpec.build(model=str(tiny_model_dir), mode="lora", steps=4, seq_len=32, resume_checkpoint_every=1,
                         resume_kill_after_checkpoint=2, eval_max_blocks=2)
    record, _ = run(spec, tmp_path)
    assert record["resume"]["status"] == "pass", record["resume"]["checks"]
    checks = {c["name"]: c for c in record["resume"]["checks"]}
    assert checks["checkpoint_selection"]["evidence"].startswith("resume from checkpoint-2")
    assert "inside step 3" in checks["kill_point"]["evidence"]


def test_a_checkpoint_file_changed_after_the_manifest_fails_the_resume_naming_it(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    """Issue 16: a byte flipped in adapter_model.safetensors after the parent verified the manifest was loaded by the
    resumed run, the record still said "sha256 of 8 files verified", and the failure showed only as a loss difference.
    Now the resumed process verifies the files itself right before Trainer loads them and refuses, naming the file."""
    import core.stages.resume

    real_start = core.stages.resume.start_child

    def start_child(name, job_dir, job, launch=core.stages.resume.SINGLE):
        if job.role == "resumed":  # after the parent's own manifest check, before the child loads anything
            weights = Path(job.resume_from) / "adapter_model.safetensors"
            data = bytearray(weights.read_bytes())
            data[-1] ^= 0x01
            weights.write_bytes(bytes(data))
        return real_start(name, job_dir, job, launch)

    monkeypatch.setattr(core.stages.resume, "start_child", start_child)
    spec = RunSpec.build(model=str(tiny_model_dir), mode="lora", steps=4, seq_len=32, resume_checkpoint_every=2,
                         resume_kill_after_checkpoint=1, eval_max_blocks=2)
    record, _ = run(spec, tmp_path)
    checks = {c["name"]: c for c in record["resume"]["checks"]}
    assert checks["manifest"]["status"] == "pass"  # the parent's check came before the change
    assert checks["manifest_at_load"]["status"] == "fail"
    assert checks["manifest_at_load"]["evidence"] == ("the checkpoint changed after its manifest: "
                                                      "adapter_model.safetensors (before load)")
    assert record["resume"]["status"] == "fail" and "loss" not in checks  # nothing changed was loaded or compared
    assert record["verdict"]["stages"]["resume"]["status"] == "fail"


def test_the_resumed_process_verifies_the_checkpoint_before_and_after_loading(lora_run):
    _, record, _ = lora_run
    checks = {c["name"]: c for c in record["resume"]["checks"]}
    files = len(record["resume"]["checkpoint_manifest"])
    assert checks["manifest_at_load"] == {
        "name": "manifest_at_load", "kind": "exact", "tier": "exact", "status": "pass",
        "evidence": f"sha256 of {files} files verified in the resumed process right before loading and after the run"}
