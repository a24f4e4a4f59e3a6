"""DoRA, a LoRA variant (core/methods/dora.py): its plan against the tensors the probe measures in real Trainer steps on
this CPU, its parameters against peft's model, and what it refuses.

The model: the tiny Llama widened to hidden 256 and MLP 1,024 (the embedded tokenizer's 49,152-token vocabulary), so
that DoRA's own terms are large beside the logits: with every linear layer adapted, the working set of down_proj's
weight norm (eye(1,024), B·A, s·B·A and W + s·B·A: 7.3 MB) decides the step's peak; with q and v adapted at 2 x 8
tokens, the loss's gradient at the start of backward does, over DoRA's saved outputs.
"""

from __future__ import annotations

import pytest

from core.errors import SpecError
from core.spec import RunSpec

#: (targets, micro-batch, sequence, the moment the plan puts the peak in)
CASES = [
    ("all-linear", 1, 8, "a LoRA variant's working set in the last layer's forward"),
    ("q_proj,v_proj", 2, 8, "the loss's gradient, at the start of backward"),
]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    from tests.conftest import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("wide-llama"), hidden=256, intermediate=1024)


def _spec(model, mode: str, targets: str, b: int, s: int) -> RunSpec:
    return RunSpec.build(mode=mode, model=str(model), devices="cpu", batch_size=b, seq_len=s, lora_targets=targets,
                         lora_r=4, probe_steps=2, steps=4, resume_checkpoint_every=2, resume_kill_after_checkpoint=1)


@pytest.mark.parametrize(("targets", "b", "s", "at"), CASES, ids=[c[0] for c in CASES])
def test_the_dora_plan_is_the_probes_measured_tensors(wide_model, tmp_path, targets, b, s, at):
    """The plan's tensors (its total without the runtime's overhead line) within 1 % of the probe's peak of live
    tensors over two real steps (measured: +0.003 % and +0.008 %); and DoRA's own terms are what moves it: its plan
    is above LoRA's by as much as the probe is (within 2 %)."""
    from core.pipeline import AcceptanceRun

    measured, planned = {}, {}
    for mode in ("lora", "dora"):
        run = AcceptanceRun(_spec(wide_model, mode, targets, b, s), tmp_path / mode,
                            traced={"status": "not_run", "reason": "the probe is the reference here"})
        for _ in run.probe_stage():
            pass
        run.close()
        assert run.results["probe"].status.value == "pass"
        device = run.ctx.plan.devices[0]
        measured[mode] = run.results["probe"].devices[0].peak_bytes
        planned[mode] = device.total_bytes - device.lines["overhead"].bytes
        if mode == "dora":
            assert device.peak_phase.at == at
    assert planned["dora"] == pytest.approx(measured["dora"], rel=0.01)
    assert planned["dora"] - planned["lora"] == pytest.approx(measured["dora"] - measured["lora"], rel=0.02)
    assert measured["dora"] > measured["lora"]


def test_the_magnitude_vectors_are_the_trainable_parameters_peft_adds(wide_model):
    """peft's ``use_dora`` adds one trained magnitude per output feature of every adapted layer: the plan's counts
    (from the meta model peft builds) equal the model the child loads, and exceed LoRA's by q's and v's widths."""
    from core.child.measure import parameter_placement
    from core.child.recipe import build_model
    from core.prerun import make_plan

    spec = _spec(wide_model, "dora", "q_proj,v_proj", 1, 8)
    model, _ = build_model(spec, str(wide_model), "cpu")
    placed = parameter_placement(model)["cpu"]
    dora = make_plan(spec).plan.parameters
    lora = make_plan(_spec(wide_model, "lora", "q_proj,v_proj", 1, 8)).plan.parameters
    assert (placed["parameters"], placed["trainable"]) == (dora.total, dora.trainable)
    q_out, v_out, layers = 256, 128, 2  # 4 heads of 64; 2 KV heads of 64
    assert dora.trainable - lora.trainable == layers * (q_out + v_out)


@pytest.mark.parametrize(("raw", "field", "says"), [
    ({"dtype": "bf16"}, "dtype", "fp32 in this version"),
    ({"gradient_checkpointing": True}, "gradient_checkpointing", "without gradient checkpointing"),
    ({"strategy": "ddp", "devices": "2x24GiB"}, "strategy", "one process"),
    ({"mode": "qlora"}, "lora.variant", "name two variants"),
])
def test_what_dora_does_not_run_in_this_version_is_refused_by_name(raw, field, says):
    """Refused before a run, by name; planned all the same (a torchtune DoRA recipe trains in bf16 with activation
    checkpointing), except two variants at once, which is no spec."""
    mode = raw.pop("mode", "lora")
    if mode != "lora":
        with pytest.raises(SpecError, match=says) as caught:
            RunSpec.from_dict({"mode": mode, "lora": {"variant": "dora"}, **raw})
        assert caught.value.field == field
        return
    spec = RunSpec.from_dict({"mode": mode, "lora": {"variant": "dora"}, **raw})  # it plans
    with pytest.raises(SpecError, match=says) as caught:
        spec.method.check_run(spec)
    assert caught.value.field == field


def test_dora_is_a_labelled_variant_stored_as_its_own_mode():
    spec = RunSpec.from_dict({"lora": {"variant": "dora"}})
    assert spec.mode == "dora" and spec.method.variant and "LoRA variant" in spec.method.label
    assert spec.to_dict()["mode"] == "dora" and "variant" not in spec.to_dict()["lora"]


def test_a_trainers_dora_adapters_are_planned_as_dora(tmp_path):
    """Command mode: a Trainer whose peft config says use_dora is planned as DoRA, not passed off as LoRA; over a
    4-bit base it is not planned, and says why."""
    from core.command.plan import spec_from_run
    from tests.unit.test_command_spec import BATCHES, trainer

    peft = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
            "options": {"use_dora": True, "use_rslora": False}}
    ran = spec_from_run(trainer(peft=peft, trainable_parameters=100), BATCHES, tmp_path / "config.json", 5)
    assert ran.spec is not None and ran.spec.mode == "dora", ran.reason
    four_bit = trainer(peft=peft, trainable_parameters=100, quantization={"load_in_4bit": True})
    ran = spec_from_run(four_bit, BATCHES, tmp_path / "config4.json", 5)
    assert ran.spec is None and "dora over a 4-bit base" in ran.reason


async def test_the_wizard_offers_dora_by_its_key_and_plans_its_own_terms(tiny_model_dir, tmp_path):
    """Mode screen: key 5 is DoRA (labelled a LoRA variant); Setup says so; the Plan's activations line names DoRA's
    terms (the plan screen reads what the plan says, nothing of its own)."""
    from tests.wizard_helpers import make_app, wait_for
    from tui.screens.plan import PlanScreen
    from tui.screens.setup import SetupScreen

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("5", "enter")
        assert isinstance(app.screen, SetupScreen) and app.state.mode == "dora"
        assert "Setup (dora)" in str(app.screen.query_one(".title").content)
        await pilot.press("ctrl+n")
        assert isinstance(app.screen, PlanScreen)
        await wait_for(pilot, lambda: not app.screen.query_one("#next").disabled, 60)
        plan = app.state.ctx.plan
        assert "DoRA (LoRA variant): per adapted layer" in plan.devices[0].lines["activations"].method
