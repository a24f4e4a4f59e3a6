"""What the device monitor costs, as ratios in one run (this machine's absolute speed varies).

1. CPU cost of the sampler at 10 Hz: a fresh process runs ``Sampler`` for SECONDS and reports its own CPU time
   (user + system, ``resource.getrusage``) over the wall time, as a percentage of one core (target under 5 %):
   - the host backend following a live process tree (what the wizard does on a machine without a GPU);
   - the NVML backend over a constructed 8-GPU NVML layer with a probe on one device (our code's share of an NVML
     read; the driver's own time per call is not in it: no GPU here).
2. Effect on a probe step (target under 2 %): a child process runs training steps of a small Llama (full
   fine-tuning, fp32, CPU) and reports each step's time, once with the parent sampling it at 10 Hz (host backend,
   following the child, as the probe screen does) and once without, alternated PAIRS times; the ratio of the median
   step times.

Run: ``.venv/bin/python benchmarks/monitor_cost.py`` (writes benchmarks/results/monitor_cost.json).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SECONDS = 10.0
PAIRS = 5
STEPS = 40

SAMPLER_COST = """
import json, resource, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from core.monitor.sampler import HostBackend, Sampler
kind, seconds = sys.argv[2], float(sys.argv[3])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
if kind == "host":
    backend = HostBackend()
else:
    from core.monitor.nvml import NvmlBackend
    from tests.fake_nvml import FakeGpu, FakeNvml
    gpus = [FakeGpu(f"GPU-{i:08d}-0000-0000-0000-000000000000", bus=f"00000000:{i + 1:02x}:00.0", used=2**30,
                    procs=[(child.pid, 2**30)] if i == 0 else []) for i in range(8)]
    backend = NvmlBackend(FakeNvml(gpus), env={})
sampler = Sampler(backend, interval_s=0.1)
sampler.follow({child.pid})
before = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
sampler.start()
time.sleep(seconds)
sampler.stop()
wall = time.perf_counter() - t0
after = resource.getrusage(resource.RUSAGE_SELF)
child.kill()
cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
samples = len(sampler.history(sampler.latest()[0].device))
print(json.dumps({"cpu_s": cpu, "wall_s": wall, "samples": samples}))
"""

STEPPER = """
import json, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
torch.set_num_threads(1)
config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, 2048, (4, 128))
times = []
for step in range(int(sys.argv[1])):
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
print(json.dumps(times[3:]))
"""


def sampler_cost(kind: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SAMPLER_COST, str(ROOT), kind, str(SECONDS)], check=True,
                         capture_output=True, text=True, cwd=ROOT).stdout
    r = json.loads(out)
    r["percent_of_one_core"] = 100.0 * r["cpu_s"] / r["wall_s"]
    r["rate_hz"] = r["samples"] / r["wall_s"]
    return r


def steps(with_sampler: bool) -> list[float]:
    from core.monitor.sampler import HostBackend, Sampler

    child = subprocess.Popen([sys.executable, "-c", STEPPER, str(STEPS)], stdout=subprocess.PIPE, text=True)
    sampler = None
    if with_sampler:
        sampler = Sampler(HostBackend(), interval_s=0.1)
        sampler.follow({child.pid})
        sampler.start()
    out, _ = child.communicate()
    if sampler is not None:
        sampler.stop()
    return json.loads(out)


def main() -> None:
    result = {"sampler_host": sampler_cost("host"), "sampler_nvml_constructed_8_gpus": sampler_cost("nvml")}
    with_s, without = [], []
    for _ in range(PAIRS):  # alternated, so a slow moment hits both alike
        without += steps(False)
        with_s += steps(True)
    result["probe_step"] = {
        "steps_each": len(without),
        "median_s_without_sampler": statistics.median(without),
        "median_s_with_sampler": statistics.median(with_s),
        "ratio_with_over_without": statistics.median(with_s) / statistics.median(without),
    }
    result["targets_met"] = {
        "host_sampler_under_5pct_core": result["sampler_host"]["percent_of_one_core"] < 5.0,
        "nvml_sampler_under_5pct_core": result["sampler_nvml_constructed_8_gpus"]["percent_of_one_core"] < 5.0,
        "probe_step_effect_under_2pct": result["probe_step"]["ratio_with_over_without"] < 1.02,
    }
    out = ROOT / "benchmarks" / "results" / "monitor_cost.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    h, n, p = result["sampler_host"], result["sampler_nvml_constructed_8_gpus"], result["probe_step"]
    print(f"sampler at 10 Hz: host {h['percent_of_one_core']:.2f} % of a core ({h['rate_hz']:.1f} Hz), NVML over a "
          f"constructed 8-GPU layer {n['percent_of_one_core']:.2f} % ({n['rate_hz']:.1f} Hz)")
    print(f"probe step with/without the sampler: {p['ratio_with_over_without']:.3f} "
          f"({p['median_s_with_sampler'] * 1000:.1f} vs {p['median_s_without_sampler'] * 1000:.1f} ms)")
    print(f"targets met: {result['targets_met']}")


if __name__ == "__main__":
    main()
