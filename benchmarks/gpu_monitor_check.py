"""The NVML facts the monitor relies on, checked on a real GPU box; and a short real trace for the tests to replay.

Prints and writes (``--out DIR``: DIR/gpu_monitor_check.json and DIR/nvml_trace.jsonl):

1. per NVML device: v1 "used" vs v2 used + reserved (case M2: v1 counts driver-reserved memory), MIG mode (M6);
2. NVML UUIDs against torch's ``get_device_properties(i).uuid`` for every CUDA device, and the mapping
   ``core.monitor.nvml.cuda_devices`` made from CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER (M1);
3. a child process that allocates 1 GiB on cuda:0 and holds it: NVML's per-process list (is the child's PID there,
   with how many bytes; in a container it is not: M3) and what the backend reports as ours;
4. a 3-second trace of the sampler at 10 Hz following that child, recorded as JSON lines (replayable with
   ``core.monitor.sampler.ReplayBackend.from_jsonl``).

Without an NVIDIA driver it says so and exits 0 (nothing measured, nothing written).
Run on a GPU box: ``python benchmarks/gpu_monitor_check.py --out DIR`` (needs torch with CUDA, nvidia-ml-py, psutil).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HOLDER = """
import sys, time, torch
x = torch.empty(2**30, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
print("ready", flush=True)
time.sleep(float(sys.argv[1]))
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        print(f"no NVIDIA driver here ({exc}): nothing to check, nothing written")
        return 0
    from core.monitor.nvml import NvmlBackend, discover
    from core.monitor.sampler import Sampler

    result: dict = {"driver": _text(pynvml.nvmlSystemGetDriverVersion()), "devices": []}
    for d in discover(pynvml):
        row = {"key": d.key, "uuid": d.uuid, "name": d.name, "mig_enabled": d.mig_enabled, "mig_parent": d.mig_parent,
               "error": d.error}
        if d.error is None:
            v1 = pynvml.nvmlDeviceGetMemoryInfo(d.handle)
            row["v1_used"] = int(v1.used)
            try:
                v2 = pynvml.nvmlDeviceGetMemoryInfo(d.handle, version=pynvml.nvmlMemory_v2)
                row.update(v2_used=int(v2.used), v2_reserved=int(v2.reserved), v2_total=int(v2.total))
            except pynvml.NVMLError as exc:
                row["v2_error"] = str(exc)
        result["devices"].append(row)
        print(row)
    import torch

    result["torch"] = torch.__version__
    result["torch_uuids"] = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    backend = NvmlBackend(pynvml)
    result["mapping"] = [{"cuda": c.index, "nvml_uuid": c.device.uuid, "method": c.method, "verified": c.verified}
                         for c in backend.cuda]
    result["mapping_matches_torch"] = [
        c.device.uuid is not None and c.device.uuid.lower().endswith(u.lower().removeprefix("gpu-"))
        for c, u in zip(backend.cuda, result["torch_uuids"])]
    print("mapping:", result["mapping"], "matches torch:", result["mapping_matches_torch"])

    out = Path(args.out) if args.out else None
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, "6"], stdout=subprocess.PIPE, text=True)
    sampler = Sampler(backend, interval_s=0.1)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        sampler.record(out / "nvml_trace.jsonl")
    sampler.follow({holder.pid})
    sampler.start()
    ready = holder.stdout.readline().strip() == "ready"
    time.sleep(3)
    handle = backend.cuda[0].device.handle if backend.cuda else None
    procs = [{"pid": int(p.pid), "used": p.usedGpuMemory} for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)] \
        if handle is not None else []
    latest = {s.device: s.to_json() for s in sampler.latest()}
    sampler.stop()
    holder.kill()
    holder.wait()
    result["holder"] = {"pid": holder.pid, "ready": ready, "nvml_processes": procs,
                        "holder_pid_listed": any(p["pid"] == holder.pid for p in procs),
                        "backend_cuda0": latest.get("cuda:0"), "peak_ours_cuda0": sampler.peak_ours("cuda:0")}
    print("per-process:", procs, "holder listed:", result["holder"]["holder_pid_listed"],
          "ours peak:", result["holder"]["peak_ours_cuda0"])
    if out is not None:
        (out / "gpu_monitor_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    pynvml.nvmlShutdown()
    return 0


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    raise SystemExit(main())
