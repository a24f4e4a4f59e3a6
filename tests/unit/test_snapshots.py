"""SVG snapshots of every wizard screen at 80x24 and 120x40, stored in snapshots/ at the top of the repository.

Stage screens show constructed, fixed results (no child runs), so the pictures depend only on the code. Update them
after a deliberate change with ``pytest tests/unit/test_snapshots.py --snapshot-update`` and look at the diffs.
"""

from __future__ import annotations

import dataclasses
import datetime
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from pytest_textual_snapshot import SVGImageExtension
from syrupy.location import PyTestLocation
from textual._doc import take_svg_screenshot

from core.methods import METHODS
from core.monitor.sampler import ReplayBackend, constructed_frames
from core.pipeline import AcceptanceRun
from core.spec import RunSpec
from core.stages.childproc import SINGLE, Launch
from core.stages.noise import Family, bound_tensor_rows, pooled_losses, required_tier
from core.stages.probe import DeviceMeasurement, PlanComparison, ProbeResult, ProbeTiming, compare_with_plan
from core.stages.resume import Check, ResumeResult
from core.stages.resumechecks import planned_kill
from core.stages.train import EvalPoint, TrainEvalResult
from tests.paths import REPO
from tests.wizard_helpers import TEST_HOST, GiB
from tui.app import GpuAcceptApp

SIZES = [(80, 24), (120, 40)]


class RepoSVG(SVGImageExtension):
    """Snapshots live in snapshots/ (one SVG per screen and size), not beside the tests."""

    @classmethod
    def dirname(cls, *, test_location: PyTestLocation) -> str:
        return str(REPO / "snapshots" / test_location.basename)


@pytest.fixture
def snap(snapshot, monkeypatch, tiny_model_dir, tmp_path):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("TEXTUAL_THEME", raising=False)
    shutil.copytree(tiny_model_dir, tmp_path / "tiny-llama")
    monkeypatch.chdir(tmp_path)  # the model shows as "tiny-llama", not a temporary path
    snapshot = snapshot.use_extension(RepoSVG)

    def compare(app, size, run_before=None) -> None:
        async def settled(pilot) -> None:
            if run_before is not None:
                await run_before(pilot)
            # a text cursor blinks: a picture must not depend on the half second it was taken in
            from textual.widgets import Input

            for field in pilot.app.screen.query(Input):
                field.cursor_blink = False
            await pilot.pause()

        svg = take_svg_screenshot(app=app, terminal_size=size, run_before=settled)
        assert snapshot == svg

    return compare


def constructed_tracer(spec, ctx, cancelled=None) -> dict:
    """A traced plan made from the analytic one (activations x 0.75, no gradients at the peak): the screen, not torch."""
    from core.plan.traced import TracedPlan, compare, comparison_json

    device = ctx.plan.devices[0]
    parts = {k: device.lines[k].bytes for k in ("weights", "optimizer_states", "temporaries", "kv_cache")}
    parts.update(gradients=0, activations=device.lines["activations"].bytes * 3 // 4)
    traced = TracedPlan(components=parts, peak_bytes=sum(parts.values()), categories={}, method="constructed for a snapshot",
                        seconds=1.5, tensors="fake")
    return comparison_json(traced, compare(device, traced), device.device.name)


def app_for(mode: str = "lora") -> GpuAcceptApp:
    frames = constructed_frames(device="cpu", name="test host", total=64 * GiB, ours=[int(1.5 * GiB)], others=6 * GiB)
    return GpuAcceptApp(runs_root=Path("runs"), backend=ReplayBackend(frames), devices_override=[TEST_HOST],
                        fields={"model": "tiny-llama", "seq_len": 64, "steps": 6, "resume_checkpoint_every": 2,
                                "resume_kill_after_checkpoint": 1}, mode=mode, tracer=constructed_tracer)


async def until(pilot, condition, timeout_s: float = 60) -> None:
    from tests.wizard_helpers import wait_for

    await wait_for(pilot, condition, timeout_s)


def finished_run(app: GpuAcceptApp) -> SimpleNamespace:
    """A run whose stages all ended, with fixed numbers (what the stage screens draw)."""
    from core.prerun import make_plan

    spec = RunSpec.build(mode="lora", model="tiny-llama", seq_len=64, steps=6, resume_checkpoint_every=2,
                         resume_kill_after_checkpoint=1)
    ctx = make_plan(spec, [TEST_HOST])
    plan_dev = ctx.plan.devices[0]
    m = DeviceMeasurement(device="cpu", weights_bytes=plan_dev.lines["weights"].bytes,
                          gradients_bytes=plan_dev.lines["gradients"].bytes,
                          optimizer_states_bytes=plan_dev.lines["optimizer_states"].bytes + 32,
                          peak_bytes=150_000_000, peak_method="peak of live CPU tensor storages: ...",
                          peak_reserved_bytes=None, peak_rss_bytes=600_000_000, rss_after_load_bytes=400_000_000,
                          parameters=ctx.plan.parameters.total, trainable_parameters=ctx.plan.parameters.trainable)
    comparison = compare_with_plan(plan_dev, m)  # as the probe stage compares
    probe = ProbeResult("pass", 3, 0.42, 610.0, [m], {"cpu": {"parameters": m.parameters, "bytes": m.weights_bytes,
                                                               "trainable": m.trainable_parameters}},
                        [comparison], "runs/x/probe/child.log", "3 steps on cpu, 0.42 s/step",
                        timing=ProbeTiming(timed_steps=[3], timed_tracked=False, warmup_excluded=True,
                                           tracked_steps=[1, 2], tracked_step_time_s=1.93))
    losses = [10.83, 10.81, 10.80, 10.79, 10.79, 10.78]
    steps = [{"step": i + 1, "epoch": 0.01 * (i + 1), "learning_rate": 1e-3 * (1 - i / 6), "loss": loss,
              "sample_ids": [i]} for i, loss in enumerate(losses)]
    te = TrainEvalResult("pass", "held-out perplexity after training < before training",
                         "token-weighted perplexity: exp(sum NLL / sum target tokens)", EvalPoint(49232.478, 10.80, 252, 4, 0.1),
                         EvalPoint(49195.247, 10.79, 252, 4, 0.1), 2.5, 614.4, steps, {}, "", "", "perplexity down")
    tier = required_tier("cpu", "fp32", noise="twin", twins=2)  # resume.noise = "twin": the noise measured on the CPU too
    # the two tolerance checks judged by the resume check's own rule, so that their numbers follow from the evidence
    # the record keeps: the losses of steps 3-4 (step 4 one 9.5e-07 off; twin-1 equal to the reference, the nudged
    # twin-2 1.9e-06 off at step 4) and 8 adapter tensors (one 7.1e-06 from the reference, its pairs 9e-06 to 1.3e-05)
    kin = Family.of(2, with_reference=True)
    loss, _ = pooled_losses([(3, losses[2], losses[2]), (4, losses[3] + 9.5e-7, losses[3])],
                            [[losses[2]] * 3, [losses[3], losses[3], losses[3] + 1.9e-6]], kin, tier.loss_multiple)
    prefix = "base_model.model.model.layers.0.self_attn"
    weights = bound_tensor_rows([(f"{prefix}.q_proj.lora_B.weight", 7.1e-06, 1.0, 1.3e-05, 1.1e-05, 0.9e-05),
                                 (f"{prefix}.v_proj.lora_B.weight", 0.0, 1.0, 1.3495e-05, 1.2e-05, 1.0e-05)]
                                + [(f"{prefix}.{m}.lora_A.weight{i}", 0.0, 0.0, 0.0, 0.0, 0.0) for m in ("q_proj", "v_proj")
                                   for i in range(3)], tier.multiple)
    weights = dataclasses.replace(weights, evidence={**(weights.evidence or {}), **kin.evidence()})
    checks = [Check("kill", "pass", "SIGKILL to process group 4242 inside step 4 after its only micro-batch's "
                                    "backward, before its optimizer step; no process of the group is left"),
              Check("kill_point", "pass", "boundary+1: killed inside step 4 after its only micro-batch's backward, "
                                          "before its optimizer step"),
              Check("checkpoint_selection", "pass", "resume from checkpoint-2, the newest complete checkpoint",
                    kind="completeness"),
              Check("checkpoint_complete", "pass", "present: adapter weights, optimizer, scheduler, RNG, trainer state",
                    kind="completeness"),
              Check("learning_rate", "pass", "learning rate equal at 5 steps"),
              Check("sample_ids", "pass", "sample ids equal at 5 steps"),
              Check("loss", "pass", loss.describe(tier, "resumed losses", tier.loss_multiple), kind="tolerance",
                    tier=tier.name, largest_difference=loss.distance, noise=loss.noise, bound=loss.bound,
                    evidence_rows=loss.evidence),
              Check("rng_restored", "pass", "right after restore, generators cpu, numpy, python equal rng_state.pth of "
                                            "checkpoint-2 (sha256)"),
              Check("final_weights", "pass", weights.describe(tier, "tensors of adapter_model.safetensors"),
                    kind="tolerance", tier=tier.name, largest_difference=weights.distance, noise=weights.noise,
                    bound=weights.bound, evidence_rows=weights.evidence)]
    comparison_rows = [{"step": s["step"], "learning_rate": s["learning_rate"], "loss_reference": s["loss"],
                        "loss_resumed": s["loss"] + (9.5e-7 if s["step"] == 4 else 0.0),
                        "difference": 9.5e-7 if s["step"] == 4 else 0.0, "loss_twin": s["loss"]} for s in steps[2:4]]
    resume = ResumeResult("pass", checks, checkpoint_step=2, kill_step=3, killed_pgid=4242, tier=tier,
                          comparison=comparison_rows, manifest={}, extra_steps=5, seconds=12.0,
                          summary=f"killed {planned_kill(spec, short=True)}, resumed from checkpoint-2, compared at "
                                  "steps 3-4: 9 checks passed (cpu-fp32-twin-noise)",
                          kill_at="boundary+1", kill_planned=planned_kill(spec), interrupted_start=0,
                          compared_steps=(3, 4), twin_steps=(1, 4))
    app.state.spec, app.state.ctx = spec, ctx
    run_dir = Path("runs/20261130T000000Z-lora-tiny-llama")
    run = SimpleNamespace(spec=spec, run_dir=run_dir, verdict=None, stopped={}, launch=SINGLE, traced=None,
                          record_path=run_dir / "record.toml",  # nothing is written when the app closes
                          close=lambda: None,
                          results={"plan": ctx.plan, "probe": probe, "train_eval": te, "resume": resume})
    run.current_verdict = lambda: AcceptanceRun.current_verdict(run)  # the run's own rule, over these results
    run.probe_as_recorded = lambda: AcceptanceRun.probe_as_recorded(run)
    return run


def push(screen_name: str):
    async def run_before(pilot) -> None:
        app = pilot.app
        from tui.screens import export, stages

        app.state.run = finished_run(app)
        screen = {"probe": stages.ProbeScreen, "evaluate": stages.EvaluateScreen, "resume": stages.ResumeScreen,
                  "export": export.ExportScreen}[screen_name]()
        await app.push_screen(screen)
        if screen_name == "probe":
            await until(pilot, lambda: bool(screen._bars) and screen.sampler.latest())
            screen.refresh_bars()
        await pilot.pause(0.2)

    return run_before


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_mode_screen(snap, size):
    snap(app_for(), size)


def setup_settled(pilot) -> bool:
    """The Setup screen as it stays: the devices detected and the model and data checked (a busy machine answers
    later; a picture taken before shows "checking…")."""
    screen = pilot.app.screen
    return "looking" not in str(screen.query_one("#detected").content) and screen._checked is not None \
        and screen._checked_spec == screen._draft


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_setup_screen(snap, size):
    async def run_before(pilot) -> None:
        await pilot.press("enter")
        await until(pilot, lambda: setup_settled(pilot))

    snap(app_for(), size, run_before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_setup_screen_with_a_bad_value(snap, size):
    async def run_before(pilot) -> None:
        await pilot.press("enter")
        pilot.app.screen.query_one("#batch_size").value = "0"
        await until(pilot, lambda: setup_settled(pilot))
        await pilot.pause()

    snap(app_for(), size, run_before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_plan_screen(snap, size):
    async def run_before(pilot) -> None:
        await pilot.press("enter", "ctrl+n")
        await until(pilot, lambda: not pilot.app.screen.query_one("#next").disabled)
        await until(pilot, lambda: bool(pilot.app.screen.query(".traced-table")))

    snap(app_for(), size, run_before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_plan_screen_traced_beside_analytic(snap, size):
    async def run_before(pilot) -> None:
        await pilot.press("enter", "ctrl+n")
        await until(pilot, lambda: bool(pilot.app.screen.query(".traced-table")))
        await pilot.pause()  # the table laid out before the body scrolls to its end (a loaded machine took longer)
        body = pilot.app.screen.query_one("#plan-body")
        body.scroll_end(animate=False)
        await until(pilot, lambda: body.max_scroll_y > 0 and body.scroll_y == body.max_scroll_y)
        await pilot.pause()

    snap(app_for(), size, run_before)


def small_host_app(batch: int = 8) -> GpuAcceptApp:
    """The wizard on a host whose capacity lies between the plans of micro-batch 2 and 3 of the tiny model (planned
    here, not invented): micro-batch ``batch`` does not fit, 2 does."""
    from core.plan.devices import DeviceInfo
    from core.prerun import make_plan

    def total(b: int) -> int:
        spec = RunSpec.build(model="tiny-llama", mode="lora", seq_len=64, batch_size=b, steps=6,
                             resume_checkpoint_every=2, resume_kill_after_checkpoint=1)
        return make_plan(spec, [TEST_HOST]).plan.devices[0].total_bytes

    capacity = (total(2) + total(3)) // 2
    host = DeviceInfo("cpu", "cpu", "small host", capacity, "constructed for tests")
    frames = constructed_frames(device="cpu", name="small host", total=capacity, ours=[None], others=0)
    return GpuAcceptApp(runs_root=Path("runs"), backend=ReplayBackend(frames), devices_override=[host], mode="lora",
                        tracer=constructed_tracer,
                        fields={"model": "tiny-llama", "seq_len": 64, "batch_size": batch, "steps": 6,
                                "resume_checkpoint_every": 2, "resume_kill_after_checkpoint": 1})


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_plan_screen_that_does_not_fit(snap, size):
    """Issue 17: a plan that does not fit offers the largest micro-batch that fits (f) and Probe anyway, above the
    fold at 80x24."""
    async def run_before(pilot) -> None:
        await pilot.press("enter", "ctrl+n")
        await until(pilot, lambda: str(pilot.app.screen.query_one("#next").label) == "p: Probe anyway →")
        await until(pilot, lambda: bool(pilot.app.screen.query(".traced-table")))
        await pilot.pause()

    snap(small_host_app(), size, run_before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_setup_screen_with_a_data_file(snap, size):
    """Issue 17: your own data is shown, with its documents and held-out split once read."""
    Path("my.jsonl").write_text("".join(f'{{"text": "document number {i} with some words in it"}}\n'
                                        for i in range(40)))

    async def run_before(pilot) -> None:
        await pilot.press("enter")
        await until(pilot, lambda: setup_settled(pilot))
        pilot.app.screen.query_one("#data").focus()
        await pilot.pause()

    app = app_for()
    app.state.fields["data"] = "my.jsonl"
    snap(app, size, run_before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("screen", ["probe", "evaluate", "resume", "export"])
def test_stage_screens(snap, size, screen):
    snap(app_for(), size, push(screen))


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_help_screen(snap, size):
    async def run_before(pilot) -> None:
        await pilot.press("question_mark")

    snap(app_for(), size, run_before)


def nvml_box_frames():
    """Three frames of a constructed box through the real NVML backend: an H200 in use, a lost GPU, a MIG parent with
    one MIG device (cases M4, M6)."""
    import pynvml

    from core.monitor.nvml import NvmlBackend
    from tests.fake_nvml import FakeGpu, FakeNvml

    busy = FakeGpu("GPU-11111111-2222-3333-4444-555555555555", name="NVIDIA H200", bus="00000000:01:00.0",
                   total=141 * GiB, used=40 * GiB, reserved=512 * 2**20, util=87)
    lost = FakeGpu("GPU-66666666-2222-3333-4444-555555555555", name="NVIDIA H200", bus="00000000:02:00.0",
                   errors={"nvmlDeviceGetMemoryInfo": pynvml.NVMLError_GpuIsLost})
    mig = FakeGpu("MIG-77777777-2222-3333-4444-555555555555", name="NVIDIA H200 MIG 3g.71gb", total=71 * GiB,
                  used=12 * GiB)
    parent = FakeGpu("GPU-88888888-2222-3333-4444-555555555555", name="NVIDIA H200", bus="00000000:03:00.0",
                     total=141 * GiB, mig=[mig], errors={"nvmlDeviceGetUtilizationRates": pynvml.NVMLError_NotSupported})
    backend = NvmlBackend(FakeNvml([busy, lost, parent]), env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    frames = []
    for used in (40, 60, 50):
        busy.used = used * GiB
        frames.append(backend.sample(set()))
    return frames


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_monitor_screen(snap, size):
    from tui.monitor import MonitorApp

    app = MonitorApp(ReplayBackend(nvml_box_frames()), "NVML: 4 device(s); constructed for a snapshot")

    async def run_before(pilot) -> None:
        await until(pilot, lambda: len(pilot.app._bars) == 4 and pilot.app.sampler.peak_used("cuda:0") == 60 * GiB)
        pilot.app.refresh_bars()
        await pilot.pause()

    snap(app, size, run_before)


def two_rank_probe(app: GpuAcceptApp) -> SimpleNamespace:
    """The finished run with a probe at world size 2 (DDP on two CPU ranks): one measurement and one comparison per
    rank, with fixed numbers."""
    from core.plan.devices import DeviceInfo
    from core.prerun import make_plan

    run = finished_run(app)
    spec = RunSpec.build(mode="lora", model="tiny-llama", seq_len=64, steps=6, resume_checkpoint_every=2,
                         resume_kill_after_checkpoint=1, devices="cpu", strategy="ddp", torchrun_nproc_per_node=2)
    ranks = [DeviceInfo(f"cpu:{r}", "cpu", f"host CPU, rank {r} of 2", 32 * GiB, "constructed for tests")
             for r in (0, 1)]
    ctx = make_plan(spec, ranks)
    measurements, comparisons = [], []
    for r, plan_dev in enumerate(ctx.plan.devices):
        m = DeviceMeasurement(device=plan_dev.device.name, weights_bytes=plan_dev.lines["weights"].bytes,
                              gradients_bytes=plan_dev.lines["gradients"].bytes,
                              optimizer_states_bytes=plan_dev.lines["optimizer_states"].bytes,
                              peak_bytes=150_000_000 + r * 1_000_000, peak_method="peak of live CPU tensor storages",
                              peak_reserved_bytes=None, peak_rss_bytes=600_000_000, rss_after_load_bytes=400_000_000,
                              parameters=ctx.plan.parameters.total, trainable_parameters=ctx.plan.parameters.trainable,
                              rank=r, world_size=2, host="test-host", wrapper="DistributedDataParallel")
        measurements.append(m)
        comparisons.append(PlanComparison(
            m.device, plan_dev.total_bytes, m.peak_bytes, 100.0 * (plan_dev.total_bytes - m.peak_bytes) / m.peak_bytes,
            "plan total vs peak", {"weights": (plan_dev.lines["weights"].bytes, m.weights_bytes)}, rank=r))
    run.spec, run.launch = spec, Launch(nproc=2, torchrun_args=["--standalone", "--nproc-per-node=2"],
                                        visible_devices=["cpu:0", "cpu:1"])
    app.state.spec, app.state.ctx = spec, ctx
    run.results = {**run.results, "plan": ctx.plan, "probe": ProbeResult(
        "pass", 3, 0.42, 1220.0, measurements,
        {m.device: {"parameters": m.parameters, "bytes": m.weights_bytes, "trainable": m.trainable_parameters}
         for m in measurements}, comparisons, "runs/x/probe/child.log", "3 steps on 2 ranks")}
    return run


def test_probe_screen_lists_every_rank(snap):
    async def run_before(pilot) -> None:
        from tui.screens import stages

        app = pilot.app
        app.state.run = two_rank_probe(app)
        screen = stages.ProbeScreen()
        await app.push_screen(screen)
        await until(pilot, lambda: bool(screen._bars) and screen.sampler.latest())
        screen.refresh_bars()
        await pilot.pause(0.2)
        rows = [str(screen.query_one("#measured").get_row_at(i)[0]) for i in range(screen.query_one("#measured").row_count)]
        assert [r for r in rows if "tensors vs peak" in r] == ["r0 cpu:0 tensors vs peak", "r1 cpu:1 tensors vs peak"]
        title = str(screen.query_one("#measured-title").content)
        assert "2 ranks under torchrun, wrapped in DistributedDataParallel" in title
        assert "r0 0.14 GiB, r1 0.14 GiB" in title

    snap(app_for(), (80, 24), run_before)


def quiz_record(path: Path) -> Path:
    """A record with fixed numbers (LoRA on two 24 GiB GPUs, the second over its capacity) for the quiz screens."""
    import tomli_w

    comps = {"weights": 540_000_000, "gradients": 3_000_000, "optimizer_states": 6_000_000,
             "activations": 2_400_000_000, "temporaries": 600_000_000, "overhead": 524_288_000, "kv_cache": 0}
    dev = {"label": "test GPU", "capacity_bytes": 24 * GiB, "fits": True, "components": comps,
           "total_bytes": sum(comps.values()), "methods": {k: "constructed" for k in comps}}
    record = {
        "spec": {"mode": "lora", "optimizer": "adamw", "seed": 42, "steps": 30, "hash": "0" * 64},
        "model": {"parameters_total": 134_515_008, "parameters_trainable": 460_800},
        "plan": {"provenance": "estimated", "devices": [dict(dev, name="cuda:0"),
                                                        dict(dev, name="cuda:1", capacity_bytes=3 * GiB, fits=False)]},
        "probe": {"provenance": "measured", "devices": [{"device": "cuda:0", "peak_bytes": 3_900_000_000,
                                                         "peak_reserved_bytes": 4_400_000_000}]},
        "evaluation": {"provenance": "measured", "status": "pass", "criterion": "after < before",
                       "before": {"perplexity": 21.482, "tokens": 4064}, "after": {"perplexity": 18.907, "tokens": 4064}},
        "resume": {"provenance": "measured", "status": "pass", "checkpoint_step": 20,
                   "kill_planned": "inside step 21, after its first micro-batch",
                   "tier": {"name": "cuda-fp32-twin-noise", "method": "twin", "multiple": 4.0,
                            "why": "within 4 x the distance of a twin run from the reference"},
                   "checks": [{"name": n, "status": "pass"} for n in ("kill", "world_size", "loss", "final_weights")]},
    }
    path.write_text(tomli_w.dumps(record))
    return path


@pytest.mark.parametrize("stage", ["question", "answered", "score"])
def test_quiz_screen(snap, stage, tmp_path):
    from tui.screens.quiz import QuizApp

    async def run_before(pilot) -> None:
        await pilot.pause()
        if stage == "question":
            return
        screen = pilot.app.screen
        await pilot.press(str((screen.questions[0].answer + 1) % 4 + 1))  # a wrong answer: the ✗ and the ✓ shown
        await pilot.pause()
        if stage == "score":
            for q in screen.questions[1:]:
                await pilot.press("n", str(q.answer + 1))
            await pilot.press("n")
            await pilot.pause()

    snap(QuizApp(quiz_record(tmp_path / "record.toml"), operator="Grace"), (80, 24), run_before)


async def test_an_export_error_goes_when_what_it_asked_for_is_given(snap):  # snap: cwd, tiny-llama
    """Issue 51: "name the operator who signs off" stayed on screen after the name was typed."""
    from textual.widgets import Input

    from tui.screens.export import ExportScreen

    app = app_for()
    async with app.run_test(size=(80, 24)) as pilot:
        app.state.run = finished_run(app)
        await app.push_screen(ExportScreen())
        await pilot.pause()
        screen = app.screen
        assert screen.signoff() is None
        error = screen.query_one("#export-error")
        assert str(error.content) == "name the operator who signs off"
        screen.query_one("#operator", Input).value = "Ada"
        await pilot.pause()
        assert str(error.content) == ""
        assert screen.signoff() is None and str(error.content) == "choose a decision: accept or reject"


async def test_the_export_screen_opens_the_quiz_on_the_written_record(snap, tmp_path):  # snap: cwd, tiny-llama
    """After the record is written, Quiz → opens the quiz on it; a record it cannot quiz is said on the export screen."""
    from tui.screens.export import ExportScreen
    from tui.screens.quiz import QuizScreen

    app = app_for()
    async with app.run_test(size=(80, 24)) as pilot:
        app.state.run = finished_run(app)
        await app.push_screen(ExportScreen())
        await pilot.pause()
        assert app.screen.query_one("#quiz").disabled  # nothing written yet
        bad = tmp_path / "bad.toml"
        bad.write_text('plan = { provenance = "not_run" }\n')
        app.state.record_path = bad
        app.screen.query_one("#quiz").disabled = False
        app.screen.query_one("#quiz").press()
        await pilot.pause()
        assert isinstance(app.screen, ExportScreen)
        assert "no quiz: this record holds no plan" in str(app.screen.query_one("#export-error").content)
        app.state.record_path = quiz_record(tmp_path / "record.toml")
        app.screen.query_one("#quiz").press()
        await pilot.pause()
        assert isinstance(app.screen, QuizScreen) and len(app.screen.questions) == 6
        await pilot.press("1", "n")
        app.screen.query_one("#close").press()
        await pilot.pause()
        assert isinstance(app.screen, ExportScreen)  # Close returns to the export screen, not out of the wizard


def command_form(tmp: Path) -> dict:
    """Command mode's form on a script in the snapshot's folder (no path of this machine in the picture)."""
    script = tmp / "train.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    return {"train": "./train.sh --output_dir {out} --data {train_data}", "resume": "{command} --resume {checkpoint}",
            "metrics": "metrics.jsonl", "checkpoint_files": "model.safetensors,optimizer.pt", "eval": "perplexity"}


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_command_setup_screen(snap, size, tmp_path):
    async def run_before(pilot) -> None:
        await pilot.press(str(len([m for m in METHODS.values() if m.runs]) + 1), "enter")  # your own command: after the methods
        await pilot.pause()

    app = app_for()
    app.state.command_fields = command_form(tmp_path)
    snap(app, size, run_before)


def finished_command_run(spec) -> SimpleNamespace:
    """A command run whose stages all ended, with fixed numbers (what the run screen draws)."""
    from core.command.evaluate import CommandEvaluation
    from core.command.pipeline import CommandPlan, CommandRun
    from core.command.probe import CommandProbe, DeviceUse
    from core.command.reports import StepRecord
    from core.command.resume import CommandResume
    from core.command.resumechecks import compare_steps
    from core.criteria import AcceptCriteria

    device = DeviceUse("cpu", 0, 612 * 2**20, "the sampled RSS of the job's processes on the host (outside)",
                       64 * GiB, "constructed for tests", True, sampled_bytes=612 * 2**20)
    probe = CommandProbe("pass", "exit 0 after 6.2 s, 6 steps; measured peak cpu 0.60 GiB of 64.00", "outside only",
                         0, 6.2, 6, None, 0.5, None, [device], {}, "metrics.jsonl in the run's output folder",
                         ["checkpoint-2", "checkpoint-4", "checkpoint-6"], 612 * 2**20, "runs/x/reference/command.log",
                         ["./train.sh"])
    plan = CommandPlan("not_applicable", "no plan: measured from outside: the command reported no transformers "
                                         "Trainer", reason="measured from outside")
    ev = CommandEvaluation("pass", "perplexity lower after training", "perplexity", "token-weighted perplexity",
                           False, {"value": 48993.2}, {"value": 48772.9}, "checkpoint-6", 6, "tiny-llama",
                           "by construction: the command trained on {train_data}",
                           summary="perplexity 4.899e+04 -> 4.877e+04 (better: lower is better)")
    tier = required_tier("cpu", "fp32")
    checks = [Check("checkpoints", "pass", "the uninterrupted run wrote 3 checkpoints (steps 2, 4, 6)"),
              Check("kill", "pass", "SIGKILL to 1 process(es) (pids 4242) and 1 process group(s); no process of the "
                                    "job is left"),
              Check("kill_point", "pass", "killed when its metrics showed step 3: after checkpoint 2, before 4"),
              Check("checkpoint_selection", "pass", "resume from checkpoint-2, the newest complete checkpoint",
                    kind="completeness"),
              Check("checkpoint_complete", "pass", "present: weights.pt, optimizer.pt", kind="completeness"),
              Check("manifest", "pass", "sha256 of 2 files taken right after the kill"),
              Check("safe_loading", "pass", "optimizer.pt, weights.pt load with weights_only=True"),
              Check("manifest_after", "pass", "after the resumed run, the sha256 of the 2 files still match")]
    # the step checks as the resume check makes them (their evidence kept: the record's verdict recomputes them)
    ran = [StepRecord(step=s, loss=3.0 - 0.1 * s, learning_rate=0.1, sample_ids=[s]) for s in range(1, 7)]
    step_checks, rows = compare_steps(ran, ran[:3], ran[2:], 2, tier, [])
    checks += step_checks + [Check("final_checkpoint", "pass", "checkpoint-6 of both runs: every tensor bit-identical")]
    resume = CommandResume("pass", "killed at step 3 after checkpoint 2, resumed from it, compared up to step 6: "
                                   f"{len(checks)} checks passed (cpu-fp32-exact)", checks, 2, 4, 3, 6, tier, rows)
    run = SimpleNamespace(spec=spec, run_dir=Path("runs/20261203T000000Z-command-train.sh"), verdict=None, stopped={},
                          record_path=Path("runs/x/record.toml"), close=lambda: None, reference=None,
                          started=datetime.datetime(2026, 12, 3, tzinfo=datetime.UTC), criteria=AcceptCriteria(),
                          results={"probe": probe, "plan": plan, "train_eval": ev, "resume": resume})
    run.current_verdict = lambda: CommandRun.current_verdict(run)
    return run


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("screen", ["run", "export"])
def test_command_run_and_export_screens(snap, size, tmp_path, screen):
    async def run_before(pilot) -> None:
        from core.commandspec import CommandSpec
        from tui.screens.command import CommandRunScreen, raw_values
        from tui.screens.export import ExportScreen

        app = pilot.app
        app.state.mode = "command"
        app.state.command_spec = CommandSpec.from_dict(raw_values(command_form(tmp_path))[0])
        app.state.run = finished_command_run(app.state.command_spec)
        await app.push_screen(CommandRunScreen() if screen == "run" else ExportScreen())
        await pilot.pause(0.3)

    snap(app_for(), size, run_before)


def runs_with_records(root: Path) -> Path:
    """A runs folder with two committed records (LoRA, then full fine-tuning: two setups), the LoRA one the newer."""
    import os

    from tests.records import path_of

    for i, name in enumerate(("full", "lora")):
        folder = root / "runs" / f"2026120{i + 1}T000000Z-{name}"
        folder.mkdir(parents=True)
        shutil.copyfile(path_of(name), folder / "record.toml")
        os.utime(folder / "record.toml", (1_700_000_000 + i, 1_700_000_000 + i))
    return root / "runs"


def test_compare_screen(snap, tmp_path):
    """Export's Compare…: the runs folder's records, the two newest picked, marked not comparable (two setups)."""
    async def run_before(pilot) -> None:
        from tui.screens.compare import CompareScreen

        await pilot.app.push_screen(CompareScreen(runs_with_records(Path.cwd())))
        await pilot.pause()

    snap(app_for(), (80, 24), run_before)


async def test_the_export_screens_compare_button_opens_this_run_beside_the_others(tmp_path):
    """The record just written is the run compared (the last column: what changed); picking a record off leaves one,
    and the screen asks for two."""
    from tui.screens.compare import CompareScreen
    from tui.screens.export import ExportScreen

    runs = runs_with_records(tmp_path)
    app = GpuAcceptApp(runs_root=runs)
    async with app.run_test(size=(80, 24)) as pilot:
        current = runs / "20261201T000000Z-full" / "record.toml"
        app.state.record_path = current
        await app.push_screen(ExportScreen())
        await pilot.pause()
        button = app.screen.query_one("#compare")
        assert button.region.right <= 80  # five buttons fit 80 columns
        button.press()
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, CompareScreen) and screen.order[-1] == str(current)
        text = str(screen.comparison_text())
        assert "NOT COMPARABLE: the specs differ" in text and "* mode" in text and "lora | full" in text
        screen.query_one("#records").deselect(str(current))
        await pilot.pause()
        assert "pick two or more records to compare (2 in" in str(screen.comparison_text())
        await pilot.press("escape")
        assert isinstance(app.screen, ExportScreen)


async def test_the_written_records_path_is_in_view_after_write_in_command_mode(snap, tmp_path):  # snap: cwd
    """Issue 51: after Write record in command mode the record's path was below the visible area at 80×24."""
    from core.commandspec import CommandSpec
    from tui.screens.command import raw_values
    from tui.screens.export import ExportScreen

    app = app_for()
    async with app.run_test(size=(80, 24)) as pilot:
        app.state.mode = "command"
        app.state.command_spec = CommandSpec.from_dict(raw_values(command_form(tmp_path))[0])
        app.state.run = finished_command_run(app.state.command_spec)
        await app.push_screen(ExportScreen())
        await pilot.pause(0.3)
        screen = app.screen
        screen._show_written(tmp_path / "runs" / "x" / "record.toml", {"decision": "accept", "operator": "Ada"},
                             "unsigned: no key given")
        for _ in range(5):
            await pilot.pause()
        body, written = screen.query_one("#export-body"), screen.query_one("#written")
        assert "record written, UNSIGNED:" in str(written.content)
        top, bottom = body.scroll_offset.y, body.scroll_offset.y + body.scrollable_content_region.height
        assert top <= written.virtual_region.y and written.virtual_region.y + 1 <= bottom, (top, bottom,
                                                                                             written.virtual_region)


async def test_command_modes_waits_count_their_seconds_and_the_terms_footer_names_its_own_keys(snap, tmp_path):
    """Issue 51 (the walk after the fixes): command mode's reference run and evaluation showed no elapsed time; the
    Terms overlay's footer offered the screen's keys below it (Enter did nothing)."""
    from core.commandspec import CommandSpec
    from tui.screens.command import CommandRunScreen, raw_values
    from tui.screens.dialogs import HelpScreen

    app = app_for()
    async with app.run_test(size=(80, 24)) as pilot:
        app.state.mode = "command"
        app.state.command_spec = CommandSpec.from_dict(raw_values(command_form(tmp_path))[0])
        app.state.run = finished_command_run(app.state.command_spec)
        screen = CommandRunScreen()
        await app.push_screen(screen)
        await pilot.pause(0.3)
        app.state.running = "probe"
        screen._say("reference: process 1234 (log x)", waiting=True)
        await pilot.pause(1.3)
        assert str(screen.query_one("#status").content).startswith("reference: process 1234 (log x) · 1 s")
        app.state.running = None
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        shown = [b.binding.key for b in app.screen.active_bindings.values() if b.binding.show and b.enabled]
        assert shown == ["escape"], shown
