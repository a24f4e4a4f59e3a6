"""Issue 22 on real runs of the tiny model: the pipeline judged by agreed criteria (met and missed, stage by stage),
``gpuaccept run --headless --json``, ``gpuaccept verify DIR`` over the runs, and ``gpuaccept diff`` of two records of
one setup judged by other criteria (comparable) and of two different setups (not comparable).

The rules one by one, and verify catching a tampered threshold or value: tests/unit/test_criteria.py."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from core.record.verify import recompute_verdicts
from tui.cli import main

#: met by the tiny model's run (lora_run's spec: 2.6 % of host memory, perplexity ~49,600 -> ~49,590, 1.6 % accuracy,
#: the plan within 0.01 % of the peak) but for two: min_improvement (it improves by ~0.08 %) and the plan's error
STRICT = dict(accept_max_perplexity=1e9, accept_min_improvement=0.5, accept_min_accuracy=0.001,
              accept_max_device_share=0.5, accept_max_step_time_s=600.0, accept_min_tokens_per_s=1.0,
              accept_resume_tier="exact", accept_max_plan_error_pct=0.0,
              # the links between ranks: one process has none, so these two are written as not judged, with why
              accept_min_busbw_gbps=0.001, accept_max_step_time_spread=10.0)


@pytest.fixture(scope="module")
def strict_run(tiny_model_dir, tmp_path_factory):
    from core.events import RunFinished
    from core.pipeline import run_pipeline
    from core.spec import RunSpec
    from tests.records import LORA

    runs = tmp_path_factory.mktemp("strict-runs")
    events = list(run_pipeline(RunSpec.build(model=str(tiny_model_dir), **LORA, **STRICT), runs_root=runs))
    assert isinstance(events[-1], RunFinished)
    path = Path(events[-1].record_path)
    return path, tomllib.loads(path.read_text())


def rows(rec: dict, stage: str) -> dict[str, dict]:
    return {r["criterion"]: r for r in rec["verdict"]["stages"][stage]["criteria"]}


def test_each_stage_names_the_criteria_it_was_judged_by_met_and_missed(strict_run, lora_run):
    _, rec = strict_run
    stages = {k: v["status"] for k, v in rec["verdict"]["stages"].items()}
    assert stages == {"plan": "fail", "probe": "pass", "evaluation": "fail", "resume": "pass"}, stages
    assert rec["verdict"]["status"] == "fail"
    plan = rows(rec, "plan")["max_plan_error_pct"]
    assert plan["met"] is False and plan["value"] > 0 and plan["on"] == "cpu"
    assert "max_plan_error_pct 0 on cpu" in rec["verdict"]["stages"]["plan"]["evidence"]
    probe = rows(rec, "probe")
    assert {k: r.get("met") for k, r in probe.items()} == {"max_device_share": True, "max_step_time_s": True,
                                                          "min_tokens_per_s": True, "min_busbw_gbps": None,
                                                          "max_step_time_spread": None}
    assert probe["min_busbw_gbps"]["why"] == "not measured: one rank, no link between ranks"
    assert probe["max_step_time_spread"]["why"] == "one rank: no spread"
    assert probe["max_step_time_s"]["value"] == rec["probe"]["step_time_s"]
    ev = rows(rec, "evaluation")
    assert {k: r["met"] for k, r in ev.items()} == {"min_improvement": False, "max_perplexity": True,
                                                   "min_accuracy": True}
    assert ev["min_accuracy"]["value"] == rec["evaluation"]["after"]["accuracy"] > 0.001
    assert "min_improvement 0.5" in rec["evaluation"]["criterion"] or "50 %" in rec["evaluation"]["criterion"]
    assert rows(rec, "resume")["resume_tier"] == {"criterion": "resume_tier", "threshold": "exact",
                                                  "value": "cpu-fp32-exact", "met": True,
                                                  "on": "the resumed steps' losses"}
    assert rec["accept"]["max_device_share"] == 0.5 and rec["accept"]["not_set"] == []
    assert recompute_verdicts(rec) == []  # verify recomputes every row from the record's numbers


def test_a_probe_above_its_agreed_share_fails_and_the_json_summary_says_so(tiny_model_dir, tmp_path, capsys):
    """``run --headless --json``: the event lines go to stderr, stdout is one JSON object. The inference probe uses
    more than 0.01 % of host memory: it fails by the headroom criterion, and nothing after it runs."""
    code = main(["run", "--headless", "--json", "--runs-dir", str(tmp_path / "runs"), "--model", str(tiny_model_dir),
                 "--mode", "inference", "--seq-len", "32", "--batch-size", "2", "--eval-max-blocks", "4",
                 "--max-device-share", "0.0001"])
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert code == 1 and "[probe] fail" in err and "verdict: fail" in err
    assert summary["schema"] == "gpuaccept.run/1" and summary["verdict"] == "fail"
    assert summary["stages"]["probe"]["status"] == "fail"
    (share,) = summary["stages"]["probe"]["criteria"]
    assert share["criterion"] == "max_device_share" and share["met"] is False and share["value"] > 0.0001
    assert "above 0.01 % of its capacity (accept.max_device_share)" in summary["stages"]["probe"]["evidence"]
    assert summary["stages"]["evaluation"]["status"] == "not_run"
    (device,) = summary["devices"]
    assert device["device"] == "cpu" and device["peak_rss_bytes"] > 0 and device["capacity_bytes"] > 0
    rec = tomllib.loads(Path(summary["record"]).read_text())
    assert recompute_verdicts(rec) == [] and summary["spec_hash"] == rec["spec"]["hash"]


def test_verify_a_folder_lists_every_record_with_its_box_verdict_and_signature(strict_run, lora_run, capsys):
    path, _ = strict_run
    runs = path.parent.parent
    code = main(["verify", str(runs)])
    out = capsys.readouterr().out
    assert code == 3  # consistent, unsigned
    lines = out.splitlines()
    assert lines[0].split() == ["record", "box", "verdict", "signature", "verify"]
    assert f"{path.parent.name}/record.toml" in lines[1] and " fail " in lines[1] and "unsigned (consistent)" in lines[1]
    assert main(["verify", "--json", str(runs)]) == 3
    table = json.loads(capsys.readouterr().out)
    assert table["schema"] == "gpuaccept.verify-folder/1" and [r["verdict"] for r in table["records"]] == ["fail"]


def test_diff_of_one_setup_judged_by_other_criteria_is_comparable(strict_run, lora_run, capsys):
    """The same spec (the criteria are not part of it): comparable; the criteria that differ are listed, and the
    verdicts they changed (plan and evaluation pass by default, fail by the strict criteria), with the numbers side
    by side."""
    path, strict = strict_run
    default = Path(lora_run[1]["run_dir"]) / "record.toml"
    assert strict["spec"]["hash"] == lora_run[1]["spec"]["hash"]
    code = main(["diff", str(default), str(path)])
    out = capsys.readouterr().out
    assert code == 0 and f"comparable: the same spec (hash {strict['spec']['hash'][:12]})" in out
    assert "* max_device_share" in out and "1 | 0.5 (-0.5, -50.0 %)" in out
    assert "* evaluation" in out and "pass | fail" in out
    assert main(["diff", "--json", str(default), str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    by = {(r["section"], r["name"]): r for r in data["rows"]}
    assert data["comparable"] is True
    assert by[("verdict", "overall")]["values"] == ["pass", "fail"]
    assert by[("memory", "cpu measured peak")]["values"][0] == lora_run[1]["probe"]["devices"][0]["peak_bytes"]
    step = by[("speed", "step time")]
    assert step["values"] == [lora_run[1]["probe"]["step_time_s"], strict["probe"]["step_time_s"]]
    assert step["changes"][0]["by"] == pytest.approx(step["values"][1] - step["values"][0])


def test_diff_of_two_setups_is_marked_not_comparable(strict_run, lora_run, tmp_path, capsys):
    from tests.records import path_of

    path, _ = strict_run
    code = main(["diff", str(path), str(path_of("inference"))])
    out = capsys.readouterr().out
    assert code == 1 and "NOT COMPARABLE: the specs differ (" in out and "mode" in out.split("\n")[2]
    assert "* mode" in out and "lora | inference" in out
    # one setting changed: the committed LoRA record of the same spec, made on a tiny model at another path
    fresh = Path(lora_run[1]["run_dir"]) / "record.toml"
    assert main(["diff", str(path_of("lora")), str(fresh)]) == 1
    out = capsys.readouterr().out
    assert "NOT COMPARABLE: the specs differ (model)" in out
    from core.record.diff import compare

    spec_rows = [r.name for r in compare([path_of("lora"), fresh]).rows if r.section == "spec" and r.differs]
    assert spec_rows == ["hash", "model"] and "* model" in out
    # a file that is no record is refused by name
    other = tmp_path / "notes.toml"
    other.write_text("x = 1\n")
    assert main(["diff", str(path), str(other)]) == 2
    assert "is not a gpuaccept acceptance record" in capsys.readouterr().err
