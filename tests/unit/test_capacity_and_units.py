"""Issue 34, "Numbers that disagree or have no unit": one rule for the capacity a plan is judged by, said the same way
everywhere with its time of reading; the plan peak and its tensors named apart; every number with its unit; the plan
bar's legend complete; the CPU's overhead not called a CUDA context; inference's perplexity not "before training"; a
fit search that does not move with the micro-batch; recommendations that leave headroom."""

from __future__ import annotations

import dataclasses
import json
import re
from types import SimpleNamespace

import pytest

from core.models import load_config, resolve_model
from core.plan.devices import DeviceInfo, judged_capacity
from core.plan.memory import component_label, plan_memory
from core.plan.search import headroom_rule, headroom_text, largest_fitting
from core.spec import RunSpec

GiB = 2**30
TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=512)


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY), encoding="utf-8")
    return load_config(resolve_model(str(path)))


def _host(capacity: int = 20 * GiB, total: int = 24 * GiB, read_at: float | None = 1_700_000_000.0) -> DeviceInfo:
    return DeviceInfo("cpu", "cpu", "host CPU", capacity, "available host memory (psutil)", total, read_at)


# ------------------------------------------------------------------------------------------ 1. one capacity rule
def test_the_host_capacity_is_the_available_memory_read_once_with_its_total_and_time(monkeypatch):
    from core.monitor import hostmem
    from core.plan import devices

    monkeypatch.setattr(hostmem, "host_memory", lambda: hostmem.HostMemory(
        int(23.54 * GiB), int(22.87 * GiB), "available host memory (psutil)"))
    host = devices.host_capacity()
    assert (host.capacity_bytes, host.total_bytes) == (int(22.87 * GiB), int(23.54 * GiB))
    assert host.capacity_kind == "available" and host.read_at is not None
    clock = re.escape(devices._clock(host.read_at))
    # the one wording: 2 decimals, which quantity, when it was read (two readings of available memory differ)
    assert re.fullmatch(rf"22\.87 GiB \(available host memory \(psutil\), read at {clock}\)", host.capacity_text())
    assert re.fullmatch(rf"22\.87 GiB available \(read at {clock}\)", host.capacity_short())
    # a GPU's total does not move: no time
    gpu = DeviceInfo("cuda:0", "cuda", "H200", 140 * GiB, "torch.cuda total memory", 140 * GiB)
    assert gpu.capacity_text() == "140.00 GiB (torch.cuda total memory)"
    # CPU ranks: the bar's "cpu" is their shares together
    ranks = [dataclasses.replace(host, name=f"cpu:{r}", capacity_bytes=host.capacity_bytes // 2,
                                 capacity_source=f"{host.capacity_source} / 2 ranks sharing it") for r in range(2)]
    assert judged_capacity(ranks, "cpu").startswith("22.87 GiB available when planned (")


def test_the_cli_plan_says_the_capacity_as_the_screens_do(monkeypatch, tmp_path, capsys):
    from core.plan import devices
    from tui.cli import main

    host = _host(int(19.8 * GiB))
    monkeypatch.setattr(devices, "host_capacity", lambda: host)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    assert main(["plan", "--model", str(path), "--devices", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"cpu host CPU: capacity {host.capacity_text()}" in out
    assert "19.80 GiB (available host memory (psutil), read at " in out


# ------------------------------------------------------------------------------- 2. plan peak vs planned tensors
def test_the_plan_line_and_diff_name_the_peak_and_its_tensors_apart(config):
    from core.prerun import plan_summary
    from core.record.diff import compare, format_comparison
    from core.stages.probe import DeviceMeasurement, compare_with_plan
    from tests.records import path_of

    plan = plan_memory(RunSpec.build(mode="lora"), config, [_host()])
    d = plan.devices[0]
    overhead = d.lines["overhead"].bytes
    m = DeviceMeasurement("cpu", 0, 0, 0, peak_bytes=d.total_bytes, peak_method="live tensors", peak_reserved_bytes=None,
                          peak_rss_bytes=0, rss_after_load_bytes=0, parameters=0, trainable_parameters=0)
    tensors = compare_with_plan(d, m).planned_bytes  # what `gpuaccept diff` shows as "planned tensors"
    line = plan_summary(plan)
    assert tensors == d.total_bytes - overhead
    assert (f"cpu: plan peak {d.total_bytes / GiB:.2f} GiB (tensors {tensors / GiB:.2f} GiB + runtime overhead "
            f"{overhead / GiB:.2f} GiB) of 20.00 GiB (available host memory (psutil), read at ") in line
    # the committed records: the two rows, each its own quantity, in 2 decimals as the [plan] line
    rows = {r.name: r for r in compare([path_of("lora"), path_of("full")]).rows if r.section == "memory"}
    import tomllib

    lora = tomllib.loads(path_of("lora").read_text())
    assert rows["cpu plan peak"].values[0] == lora["plan"]["devices"][0]["fit_bytes"]
    assert rows["cpu planned tensors"].values[0] == lora["probe"]["plan_comparison"][0]["planned_bytes"]
    assert rows["cpu plan peak"].values[0] - rows["cpu planned tensors"].values[0] == \
        lora["plan"]["devices"][0]["components"]["overhead"]
    text = format_comparison(compare([path_of("lora"), path_of("full")]))
    peak = lora["plan"]["devices"][0]["fit_bytes"]
    assert re.search(rf"cpu plan peak +{peak / GiB:.2f} GiB \|", text), text
    assert "planned tensors: that peak without the overhead line" in text


# ----------------------------------------------------------------------------------------- 3. every number a unit
async def test_the_live_bar_gives_every_number_its_unit_and_the_judged_capacity_beside_the_total():
    from textual.app import App

    from tui.widgets.bars import LiveBar

    class One(App):
        def compose(self):
            yield LiveBar("cpu host")

    async with One().run_test(size=(140, 10)) as pilot:
        bar = pilot.app.query_one(LiveBar)
        bar.show(ours=int(0.27 * GiB), others=int(5.28 * GiB), total=int(23.54 * GiB), peak=int(0.27 * GiB),
                 judged="22.87 GiB available when planned (14:02:11)")
        await pilot.pause()
        line = bar.render().plain.splitlines()[1]
    assert line == ("■ probe 0.27 GiB (peak 0.27 GiB) ■ others 5.28 GiB of 23.54 GiB total (22.87 GiB available when "
                    "planned (14:02:11))"), line


# ---------------------------------------------------------------------------- 4. the legend lists every component
def test_the_plan_bar_legend_names_gradients_in_full_fine_tuning_though_not_alive_at_the_peak(config):
    from tui.widgets.bars import PlanBar

    d = plan_memory(RunSpec.build(mode="full"), config, [_host()]).devices[0]
    alive = d.peak_phase.components
    assert d.lines["gradients"].bytes > 0 and alive.get("gradients", 0) == 0  # the case the user saw
    bar = PlanBar(alive, d.device.capacity_bytes, lines={k: x.bytes for k, x in d.lines.items()}, kind="cpu")
    items = {short: note for _, short, note in bar.legend_items(80)}
    assert items["G"] == "0 at peak"
    assert set(items) == {"W", "G", "OPT", "ACT", "TMP", "RT"}  # every non-zero line of the table (no KV: training)
    legend = bar.render().plain.splitlines()[1]
    assert "■ G " in legend and "G 0 at peak" in legend and "CTX" not in legend


# ------------------------------------------------------------------------------- 5. the CPU has no CUDA context
def test_the_overhead_line_is_the_runtime_on_the_cpu_and_the_cuda_context_on_a_gpu(config):
    from tui.widgets.bars import short_name

    assert (short_name("overhead", "cpu"), component_label("overhead", "cpu")) == ("RT", "runtime overhead")
    assert (short_name("overhead", "cuda"), component_label("overhead", "cuda")) == ("CTX", "CUDA context")
    plan = plan_memory(RunSpec.build(mode="lora"), config, [_host()])
    assert "overhead" in plan.to_json()["devices"][0]["components"]  # the record's key is unchanged
    assert "on the CPU, which has no CUDA context, the process's runtime" in plan.convention


# ------------------------------------------------------------------------------ 6. inference has no training
def test_diff_calls_an_inference_records_perplexity_held_out_not_before_training():
    from core.record.diff import compare
    from tests.records import path_of

    names = [r.name for r in compare([path_of("inference"), path_of("inference")]).rows if r.section == "quality"]
    assert "held-out perplexity" in names and "before training" not in names
    mixed = [r.name for r in compare([path_of("inference"), path_of("lora")]).rows if r.section == "quality"]
    assert "held-out, not fine-tuned" in mixed and "before training" not in mixed
    training = [r.name for r in compare([path_of("lora"), path_of("full")]).rows if r.section == "quality"]
    assert "before training" in training


def test_two_long_values_that_differ_never_read_the_same_in_diff():
    """Issue 51: `diff` marked a row different (*) whose two values, cut at 40 characters, read the same."""
    from core.record.diff import Comparison, Row, format_comparison

    a = "python train.py --model m --out o --lr 1e-3 --steps 100 --warmup 10"
    b = a.replace("--warmup 10", "--warmup 20")
    text = format_comparison(Comparison(["A", "B"], ["a.toml", "b.toml"], True, "", [Row("spec", "command.train", [a, b])]))
    (line,) = [ln for ln in text.splitlines() if "command.train" in ln]
    left, right = line.split(" | ")
    assert line.startswith("*") and left.split()[-1] != right.split()[-1], line
    assert "--warmup 10" in left and "--warmup 20" in right and len(right.split("command.train")[-1]) <= 41
    # an empty value beside an absent one (the walk: `* alloc_conf  | -`): each reads as what it is
    text = format_comparison(Comparison(["A", "B"], ["a.toml", "b.toml"], True, "", [Row("spec", "alloc_conf",
                                                                                         ["", None])]))
    (line,) = [ln for ln in text.splitlines() if "alloc_conf" in ln]
    assert line.split("alloc_conf", 1)[1].split() == ['""', "|", "-"], line


# ----------------------------------------------------------------------- 7. a search that does not move with b
def test_the_largest_micro_batch_does_not_depend_on_the_micro_batch_being_tried(config):
    host = [_host(2 * GiB)]
    found = {b: largest_fitting(RunSpec.build(mode="full", batch_size=b), config, host, "batch_size")[0]
             for b in (1, 3, 4, 64, 95, 1000)}
    assert len({(r.value, r.recommended) for r in found.values()}) == 1, found
    value = found[4].value
    at = {b: plan_memory(RunSpec.build(mode="full", batch_size=b), config, host).devices[0].total_bytes
          for b in (value, value + 1)}
    assert at[value] <= 2 * GiB < at[value + 1]


def test_the_plan_screen_replans_against_the_capacity_it_read_once():
    from tui.screens.plan import PlanScreen, _devices_key

    read = [_host()]
    screen = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(devices_override=None)))
    spec = RunSpec.build(mode="lora", devices="cpu")
    assert PlanScreen._devices_for(screen, spec) is None  # the first plan reads them
    screen._devices_read = (_devices_key(spec), read)
    for change in ({"batch_size": 8}, {"batch_size": 2}, {"seq_len": 256}):  # b B s S: the same reading
        assert PlanScreen._devices_for(screen, dataclasses.replace(spec, **change)) is read
    assert PlanScreen._devices_for(screen, dataclasses.replace(spec, devices="auto")) is None  # other devices: read


# --------------------------------------------------------------------------- 8. a recommendation with headroom
def test_the_recommendation_leaves_the_headroom_and_a_small_headroom_is_never_0_00(config):
    host = [_host(2 * GiB)]
    (row,) = largest_fitting(RunSpec.build(mode="full"), config, host, "batch_size")
    assert headroom_rule(RunSpec.build())[0] == 0.95
    plan_at = {b: plan_memory(RunSpec.build(mode="full", batch_size=b), config, host).devices[0].total_bytes
               for b in (row.recommended, row.recommended + 1)}
    assert plan_at[row.recommended] <= 0.95 * 2 * GiB < plan_at[row.recommended + 1]
    assert row.recommended_headroom_bytes >= 0.05 * 2 * GiB and row.recommended < row.value
    strict = RunSpec.build(mode="full", accept_max_device_share=0.8)
    (tight,) = largest_fitting(strict, config, host, "batch_size")
    assert tight.share == 0.8 and "max_device_share 0.8" in tight.rule and tight.recommended < row.recommended
    assert headroom_text(12 * 2**20) == "12.0 MiB" and headroom_text(int(0.004 * GiB)) == "4.1 MiB"
    assert headroom_text(3 * 2**30) == "3.00 GiB" and headroom_text(700) == "0.7 KiB" and headroom_text(50) == "50 B"


def test_plan_max_batch_prints_the_recommendation_with_its_headroom(tmp_path, capsys):
    from tui.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    assert main(["plan", "--model", str(path), "--mode", "full", "--devices", "2GiB", "--max-batch"]) == 0
    out = capsys.readouterr().out
    head, first, second = out.split("largest micro-batch that fits, leaving the headroom")[1].splitlines()[:3]
    assert "5 % of the capacity kept free" in head
    assert re.match(r"  cuda:0: \d+ \(plan \d+\.\d\d GiB of 2\.00 GiB \(given: 2GiB\); headroom 0\.\d\d GiB\)$", first), first
    # the one that fits at all leaves under 0.1 GiB here: said in MiB (or KiB), never "0.00 GiB"
    assert re.match(r"    the largest that fits at all: \d+ \(plan 2\.00 GiB, headroom \d+\.\d (MiB|KiB); batch_size = \d+ "
                    r"does not fit\)$", second), second
    assert "headroom 0.00 GiB" not in out
