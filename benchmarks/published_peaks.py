"""gpuaccept's plan of the trainers' own configs against the peaks their authors published for them.

Rows: benchmarks/published/ROWS.toml (LitGPT's config_hub table, torchtune's README ladder, its LoRA and QLoRA
tutorials), each a config taken unchanged (benchmarks/published/MANIFEST.toml), the tool's own command-line overrides
applied over it as the tool merges them, and gpuaccept's flags for what the file cannot state (the GPU, a length the
data decides). Each is imported and planned as ``gpuaccept plan their.yaml`` does, offline (the models' config.json
from tests/data/models and benchmarks/published/models, laid out as a Hub cache).

What is compared: the statistic each source printed, read in its code (research notes in
benchmarks/published/NOTES.md and the rows' comments): ``max_memory_allocated`` and ``peak_memory_active`` against
the analytic plan's peak of tensors (its total without the CUDA-context line, which no torch counter holds); a
``peak_memory_reserved`` against the traced plan's reserved where the traced plan can step the config, else against
the analytic peak of tensors (a lower bound of reserved: said so in the row). Units as published (GB = 1e9 B, GiB =
2^30 B). The error is ``plan / published - 1``. Targets over the counted rows: median |error| <= 5 %, none beyond
15 %; a row left out says why. For a ladder (each technique on top of the previous row) the step-to-step differences
are shown measured and planned.

Run: ``.venv/bin/python benchmarks/published_peaks.py [--traced]`` (writes benchmarks/results/published_peaks.json and
prints the table that is in benchmarks/README.md). ``--traced`` traces the reserved rows' configs on fake tensors
(minutes for a 7B model on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PUBLISHED = ROOT / "benchmarks" / "published"
TARGET_MEDIAN, TARGET_LARGEST = 0.05, 0.15
UNITS = {"GB": 10**9, "GiB": 2**30}


@dataclasses.dataclass
class Result:
    id: str
    source: str
    statistic: str
    published_bytes: int
    unit: str
    value: float
    counted: bool
    why: str = ""
    planned_bytes: int | None = None
    compared_with: str = ""
    error: float | None = None
    failure: str = ""
    group: str = ""
    step: str = ""
    settings: str = ""


def with_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``data`` with each dotted key of ``overrides`` set, as torchtune's CLI merges ``key=value`` over a config."""
    import copy

    out = copy.deepcopy(data)
    for dotted, value in overrides.items():
        node = out
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def plan_row(row: dict[str, Any], traced: bool) -> tuple[int, str, str]:
    """(planned bytes, what they are, the settings in a line) for one row."""
    import yaml

    from core.importers import build_spec
    from core.prerun import make_plan

    source = PUBLISHED / "configs" / row["config"]
    data = yaml.safe_load(source.read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / source.name
        path.write_text(yaml.safe_dump(with_overrides(data, row.get("set", {}))), encoding="utf-8")
        spec = build_spec(path, **row.get("flags", {}))
        made = make_plan(spec)
    device = made.plan.devices[0]
    tensors = device.total_bytes - device.lines["overhead"].bytes
    settings = (f"{spec.mode} {spec.dtype}/{spec.precision} b{spec.batch_size}x{spec.seq_len} {spec.padding}, "
                f"{spec.optimizer}, loss {spec.loss}" + (", ckpt" if spec.gradient_checkpointing else "")
                + (", compile" if spec.compile else "") + (", in-bwd" if spec.optimizer_in_backward else "")
                + (", offload" if spec.activation_offloading else "") + f", {spec.strategy} x{len(made.plan.devices)}")
    if row["statistic"] == "peak_memory_reserved":
        if traced:
            reserved = traced_reserved(spec, made)
            if reserved is not None:
                return reserved, "traced reserved", settings
        return tensors, "analytic tensors (reserved not traced: a lower bound)", settings
    return tensors, "analytic tensors", settings


def traced_reserved(spec: Any, made: Any) -> int | None:
    """The traced plan's peak reserved for ``spec`` (the steady-state step replayed through the caching allocator),
    or None where the traced plan cannot step it."""
    from core.plan.traced import untraceable_reason
    from core.plan.tracer import trace_against

    if untraceable_reason(made.plan, spec) is not None:
        return None
    traced, _ = trace_against(spec, made.config, made.plan)
    return None if traced.reserved is None else int(traced.reserved.peak_reserved)


def run(traced: bool) -> list[Result]:
    from tests.hub import hub_cache

    rows = tomllib.loads((PUBLISHED / "ROWS.toml").read_text(encoding="utf-8"))["row"]
    cache = hub_cache(Path(tempfile.mkdtemp(prefix="hub-")), ROOT / "tests" / "data" / "models", PUBLISHED / "models")
    os.environ.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_CACHE = str(cache)  # read once, when it was imported
    results = []
    for row in rows:
        r = Result(row["id"], row["source"], row["statistic"], int(round(row["value"] * UNITS[row["unit"]])),
                   row["unit"], row["value"], row.get("counted", True), row.get("why", ""),
                   group=row.get("group", ""), step=row.get("step", ""))
        try:
            r.planned_bytes, r.compared_with, r.settings = plan_row(row, traced)
            r.error = r.planned_bytes / r.published_bytes - 1
        except Exception as exc:  # a row that does not plan is a result, not a crash of the benchmark
            r.failure = f"{type(exc).__name__}: {exc}"
            r.counted = False
        results.append(r)
    return results


def summary(results: list[Result]) -> dict[str, Any]:
    counted = [abs(r.error) for r in results if r.counted and r.error is not None]
    worst = max((r for r in results if r.counted and r.error is not None), key=lambda r: abs(r.error or 0),
                default=None)
    return {"rows": len(results), "counted": len(counted),
            "median_abs_error": statistics.median(counted) if counted else None,
            "largest_abs_error": max(counted) if counted else None, "largest": worst.id if worst else None,
            "beyond_15_percent": [r.id for r in results if r.counted and r.error is not None and abs(r.error) > 0.15],
            "failed": [r.id for r in results if r.failure],
            "targets_met": bool(counted) and statistics.median(counted) <= TARGET_MEDIAN
            and max(counted) <= TARGET_LARGEST}


def table(results: list[Result]) -> str:
    lines = ["| row | statistic | published | planned | error | compared with |", "|---|---|---|---|---|---|"]
    for r in results:
        scale = UNITS[r.unit]
        planned = "-" if r.planned_bytes is None else f"{r.planned_bytes / scale:.2f} {r.unit}"
        error = "-" if r.error is None else f"{r.error:+.1%}" + ("" if r.counted else " (not counted)")
        what = r.failure or r.compared_with + (f"; {r.why}" if r.why else "")
        lines.append(f"| {r.id} | {r.statistic} | {r.value:g} {r.unit} | {planned} | {error} | {what} |")
    return "\n".join(lines)


def ladders(results: list[Result]) -> str:
    """Each ladder's step-to-step differences, measured and planned."""
    out = []
    groups = sorted({r.group for r in results if r.group})
    for group in groups:
        rows = [r for r in results if r.group == group and r.planned_bytes is not None]
        out += [f"\n{group}: each step against the previous row", "| step | measured change | planned change |",
                "|---|---|---|"]
        for before, after in zip(rows, rows[1:]):
            scale = UNITS[after.unit]
            out.append(f"| {after.step} | {(after.published_bytes - before.published_bytes) / scale:+.2f} {after.unit} "
                       f"| {((after.planned_bytes or 0) - (before.planned_bytes or 0)) / scale:+.2f} {after.unit} |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traced", action="store_true", help="trace the reserved rows' configs (slow)")
    args = parser.parse_args()
    results = run(args.traced)
    s = summary(results)
    print(table(results))
    print(ladders(results))
    print(f"\ncounted {s['counted']} of {s['rows']}: median |error| {s['median_abs_error']:.1%}, largest "
          f"{s['largest_abs_error']:.1%} ({s['largest']}); beyond 15 %: {', '.join(s['beyond_15_percent']) or 'none'}; "
          f"targets met: {s['targets_met']}; not planned: {', '.join(s['failed']) or 'none'}")
    out = ROOT / "benchmarks" / "results" / "published_peaks.json"
    out.write_text(json.dumps({"summary": s, "rows": [dataclasses.asdict(r) for r in results]}, indent=1) + "\n",
                   encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
