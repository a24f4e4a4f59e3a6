"""The plan as a GPU's three counters will show it (issue 38): for the embedded model's LoRA and full steps and a 1.2B
Llama shape, ``gpuaccept plan --traced`` on a CUDA device gives peak allocated, peak reserved and NVML used, each
with its method; reserved is at least allocated and its slack is explained line by line; the fit is judged on the
predicted NVML used. (What a GPU measured against these predictions: benchmarks/reserved_accuracy.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "benchmarks" / "configs"


def config_file(name: str, tmp_path: Path) -> Path:
    """The embedded model's shape, or the 1.2B Llama shape of the GPU check (llama-1.1b.json with the embedded
    model's 49,152-token vocabulary: 1,170,302,976 parameters)."""
    if name == "smollm2-135m":
        return CONFIGS / "smollm2-135m.json"
    values = json.loads((CONFIGS / "llama-1.1b.json").read_text())
    small = json.loads((CONFIGS / "smollm2-135m.json").read_text())
    values.update({k: small[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id") if k in small})
    path = tmp_path / "llama-1.2b.json"
    path.write_text(json.dumps(values))
    return path


@pytest.mark.parametrize(("name", "mode"), [("smollm2-135m", "lora"), ("smollm2-135m", "full"), ("llama-1.2b", "lora")])
def test_the_plan_gives_allocated_reserved_and_nvml_used_and_explains_the_slack(name, mode, tmp_path):
    from core import api
    from core.spec import RunSpec
    from tui.plantext import format_traced

    spec = RunSpec.build(model=str(config_file(name, tmp_path)), mode=mode, dtype="bf16", batch_size=2, seq_len=256,
                         devices="1x80GiB")
    report = api.plan_report(spec, traced=True)
    memory = report.traced["device_memory"]
    assert memory["reserved_bytes"] >= memory["allocated_bytes"] > 0
    overhead = report.plan.devices[0].lines["overhead"].bytes
    assert memory["nvml_used_bytes"] == memory["reserved_bytes"] + overhead
    assert set(memory["methods"]) == {"allocated", "reserved", "nvml_used"} and all(memory["methods"].values())
    # the slack, line by line: each pool's cached free blocks and the rounding, summing to reserved - requested
    steady = report.traced["reserved"]["steps"][-1]
    assert sum(row["bytes"] for row in memory["slack"]) == steady["peak_reserved_bytes"] - \
        steady["at_peak"]["requested_bytes"]
    assert [row["what"].split(":")[0] for row in memory["slack"]] == [
        "small pool (tensors <= 1 MiB)", "large pool",
        "rounding inside allocated blocks (512 B multiples; large blocks handed out whole when <= 1 MiB would remain)"]
    # step 1 makes the optimizer's states; the steady state holds them from its start
    assert [s["name"] for s in report.traced["reserved"]["steps"]] == ["step 1", "step 2"]
    (fit,) = report.fits
    assert fit.device_bytes == memory["nvml_used_bytes"] and fit.bytes >= fit.tensor_bytes
    text = format_traced(report.traced)
    for words in ("peak allocated", "peak reserved", "NVML used", "free blocks cached", "expandable_segments:True"):
        assert words in text, text
