"""Issue 8: several ranks under torchrun on the CPU (gloo, world size 2): the probe's per-rank ledgers against the
plan's per-device numbers, training and the kill-and-resume check under DDP, FSDP's sharding measured, a different
world size at resume refused, two nodes' ledgers merged on node 0."""

from __future__ import annotations

import socket
import tomllib
from pathlib import Path

import pytest

from core.errors import SpecError, StageError
from core.protocol.events import Ledger, Ledgers, LinkCheck, ProbeStep, Started
from core.protocol.job import worker_job
from core.spec import RunSpec
from core.stages.childproc import (
    SINGLE,
    Launch,
    check_exit,
    group_alive,
    launch_options,
    start_child,
    visible_for,
    watch,
)


def _spec(tiny_model_dir, **kw) -> RunSpec:
    base = dict(model=str(tiny_model_dir), steps=6, seq_len=32, batch_size=2, probe_steps=2, devices="cpu",
                strategy="ddp", torchrun_nproc_per_node=2, resume_checkpoint_every=2, resume_kill_after_checkpoint=1,
                eval_max_blocks=16, learning_rate=5e-3)
    return RunSpec.build(**{**base, **kw})


def _stages(run, *names):
    """Run the named stages of an AcceptanceRun in order, draining their events; return the last result."""
    result = None
    for name in names:
        gen = getattr(run, f"{name}_stage")()
        try:
            while True:
                next(gen)
        except StopIteration as stop:
            result = stop.value
    return result


@pytest.fixture(scope="module")
def ddp_run(tiny_model_dir, tmp_path_factory):
    """LoRA (dropout 0.1, so the random generators advance) under DDP at world size 2: every stage, and the record."""
    from core.pipeline import AcceptanceRun

    spec = _spec(tiny_model_dir, mode="lora", lora_dropout=0.1)
    run = AcceptanceRun(spec, tmp_path_factory.mktemp("runs"), traced={"status": "not_run", "reason": "test"})
    _stages(run, "plan", "probe", "train_eval", "resume")
    path = run.write_record()
    run.close()
    return run, tomllib.loads(path.read_text()), path


def test_ddp_probe_reports_each_rank_against_its_planned_device(ddp_run):
    run, record, _ = ddp_run
    probe = record["probe"]
    assert probe["status"] == "pass" and probe["problems"] == []
    assert [(d["device"], d["rank"], d["world_size"]) for d in probe["devices"]] == [("cpu:0", 0, 2), ("cpu:1", 1, 2)]
    plan = {d["name"]: d for d in record["plan"]["devices"]}
    assert set(plan) == {"cpu:0", "cpu:1"}  # the plan is per rank too, each a share of the host
    for d in probe["devices"]:
        assert d["wrapper"] == "DistributedDataParallel"
        # DDP keeps a full replica on every rank: the planned weights, not divided
        assert d["weights_bytes"] == plan[d["device"]]["components"]["weights"]
    rows = {(r["device"], r["rank"]): r for r in probe["plan_comparison"]}
    assert set(rows) == {("cpu:0", 0), ("cpu:1", 1)}
    for (name, rank), row in rows.items():  # the plan's tensors: its fit's bytes without the overhead line
        assert row["planned_bytes"] == plan[name]["fit_bytes"] - plan[name]["components"]["overhead"]
        assert row["measured_bytes"] == probe["devices"][rank]["peak_bytes"]
    assert record["spec"]["torchrun"]["nproc_per_node"] == 2
    # the links between the two ranks, in the record as measured, and in the stage's summary
    links = probe["links"]
    assert (links["provenance"], links["members"], links["names"]) == ("measured", "rank",
                                                                      ["rank 0 (cpu:0)", "rank 1 (cpu:1)"])
    assert [c["op"] for c in links["collectives"]] == ["all_reduce", "all_gather"] and len(links["pairs"]) == 2
    assert "links over gloo (4 MiB): all-reduce" in run.results["probe"].summary


def test_ddp_training_merges_the_ranks_steps(ddp_run):
    run, record, _ = ddp_run
    te = run.results["train_eval"]
    assert te.status == "pass"
    assert [s["step"] for s in te.steps] == list(range(1, 7))
    for s in te.steps:
        assert len(s["rank_losses"]) == 2
        assert s["loss"] == pytest.approx(sum(s["rank_losses"]) / 2)
        assert len(s["sample_ids"]) == 2 * 2  # micro-batch 2 on each of 2 ranks
        assert {k.split("@")[1] for k in s["rng"]} == {"rank0", "rank1"}
    first = te.steps[0]["sample_ids"]
    assert len(set(first)) == 4  # the ranks train on different samples (DistributedSampler)
    # micro-batch 2 x 32 tokens x 6 steps on each of 2 ranks
    assert te.tokens_per_s == pytest.approx(2 * 32 * 6 * 2 / te.training_time_s)


def test_the_resume_check_passes_under_ddp(ddp_run):
    run, record, path = ddp_run
    resume = record["resume"]
    assert resume["status"] == "pass", [c for c in resume["checks"] if c["status"] != "pass"]
    checks = {c["name"]: c for c in resume["checks"]}
    assert checks["world_size"]["status"] == "pass" and "written by 2 process(es)" in checks["world_size"]["evidence"]
    assert "all 2 ranks" in checks["kill_point"]["evidence"]
    assert "rng_state_0..1.pth" in checks["rng_restored"]["evidence"]
    assert "the generators advanced" in checks["rng_continues"]["evidence"]
    assert checks["loss"]["evidence"].endswith("identical")
    ckpt = Path(run.run_dir) / "resume-interrupted" / "output" / "checkpoint-2"
    assert sorted(p.name for p in ckpt.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth"]
    from core.record.verify import verify

    assert verify(path).exit_code == 3  # unsigned but every verdict follows from the record, per rank


def test_a_different_world_size_at_resume_is_refused(ddp_run, tmp_path):
    from core.stages.resume import run_resume_check

    run, _, _ = ddp_run
    te = run.results["train_eval"]
    gen = run_resume_check(run.spec, run.model_path, tmp_path, "cpu", te, launch=run.launch,
                           resume_launch=SINGLE)
    try:
        while True:
            next(gen)
    except StopIteration as stop:
        result = stop.value
    checks = {c.name: c for c in result.checks}
    assert result.status == "fail"
    assert checks["world_size"].status == "fail"
    assert "written by 2 process(es)" in checks["world_size"].evidence and "would run 1" in checks["world_size"].evidence
    assert not (tmp_path / "resume-resumed").exists()  # refused before the resumed run started


def test_fsdp_on_the_cpu_shards_as_planned_and_refuses_to_train(tiny_model_dir, tmp_path):
    """Trainer cannot run FSDP on the CPU (accelerate enables it only on accelerators); the probe shards with torch's
    FSDP2 itself, and each rank's weights, gradients and optimizer states are the plan's zero3 numbers (÷ 2)."""
    from core.events import RunFinished
    from core.pipeline import run_pipeline

    spec = _spec(tiny_model_dir, mode="full", strategy="fsdp")
    events = list(run_pipeline(spec, runs_root=tmp_path))
    assert isinstance(events[-1], RunFinished)
    record = tomllib.loads(Path(events[-1].record_path).read_text())
    plan = {d["name"]: d["components"] for d in record["plan"]["devices"]}
    assert record["plan"]["strategy"] == "zero3"
    probe = record["probe"]
    assert probe["status"] == "pass"
    for d in probe["devices"]:
        assert d["wrapper"].startswith("FSDPLlamaForCausalLM (torch FSDP2 fully_shard")
        c = plan[d["device"]]
        assert d["weights_bytes"] == c["weights"] < record["model"]["parameters_total"] * 4  # a shard, as planned
        assert d["gradients_bytes"] == c["gradients"]
        # AdamW's two moments of the shard, + one step counter per parameter tensor (not in the plan)
        assert 0 <= d["optimizer_states_bytes"] - c["optimizer_states"] <= 4 * 64
    # the plan's zero3 total (the shard, the root unit and two layers gathered) is what each rank's peak was
    assert all(abs(row["error_pct"]) < 2.0 for row in probe["plan_comparison"]), probe["plan_comparison"]
    assert all(p["bytes"] == plan[name]["weights"] for name, p in probe["placement"].items())  # the shard's bytes
    assert record["verdict"]["stages"]["evaluation"]["status"] == "not_run"
    assert "Trainer cannot train with FSDP on the CPU" in record["verdict"]["stages"]["evaluation"]["evidence"]
    assert record["verdict"]["status"] == "fail"


def test_fsdp_that_ran_as_ddp_fails_the_probe_and_verify(ddp_run, tmp_path):
    from core.record.verify import verify
    from core.stages.probe import wrapper_problem

    assert wrapper_problem("ddp", "DistributedDataParallel") is None
    assert wrapper_problem("zero3", "FSDPPeftModelForCausalLM (torch FSDP2 ...)") is None
    assert "falls back to DDP" in wrapper_problem("zero3", "DistributedDataParallel")
    assert "wrapped in LlamaForCausalLM" in wrapper_problem("ddp", "LlamaForCausalLM")
    # a DDP record edited to claim zero3: the wrapper no longer follows, and verify says so (exit 6)
    _, _, path = ddp_run
    text = path.read_text().replace('strategy = "ddp"', 'strategy = "zero3"', 1)
    import hashlib
    import json

    rec = tomllib.loads(text)
    spec = {k: v for k, v in rec["spec"].items() if k != "hash"}
    new_hash = hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    text = text.replace(rec["spec"]["hash"], new_hash)
    edited = tmp_path / "record.toml"
    edited.write_text(text)
    result = verify(edited)
    assert result.exit_code == 6, (result.schema, result.verdicts)
    assert any("zero3" in v or "probe" in v for v in result.verdicts)


def test_two_nodes_ledgers_are_merged_on_node_0(tiny_model_dir, tmp_path):
    """Two torchrun launches on this machine as two nodes (c10d rendezvous on localhost, one rank each)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = _spec(tiny_model_dir, mode="full", torchrun_nproc_per_node=1, torchrun_nnodes=2,
                 torchrun_rdzv_endpoint=f"127.0.0.1:{port}", torchrun_rdzv_id="test-nodes")
    launch = launch_options(spec, ["cpu:0"])
    assert launch.torchrun_args is not None and launch.torchrun_args[:2] == ["--nnodes=2", "--nproc-per-node=1"]
    assert launch.torchrun  # one process per node, but several nodes: under torchrun
    job = worker_job(spec, "probe", tiny_model_dir, "cpu", ["cpu:0"])
    nodes = [start_child("probe", tmp_path / f"node{i}", job, launch) for i in (0, 1)]
    events = []
    for child in nodes:
        events.append(list(watch(child)))
        check_exit(child)
    gathered = [e for node in events for e in node if isinstance(e, Ledgers)]
    assert len(gathered) == 1  # rank 0 gathers; it is on one of the two nodes
    ledgers = gathered[0].ledgers
    assert [(x.global_rank, x.world_size) for x in ledgers] == [(0, 2), (1, 2)]
    assert sorted(x.node_rank for x in ledgers) == [0, 1]
    assert all(x.wrapper == "DistributedDataParallel" for x in ledgers)
    # the links between the nodes: one member per node, both directions measured
    (links,) = [e for node in events for e in node if isinstance(e, LinkCheck)]
    assert links.members == "node" and [n.split(" (")[0] for n in links.names] == ["node 0", "node 1"]
    assert sorted((p["from"], p["to"]) for p in links.pairs) == [(0, 1), (1, 0)]


def test_the_probe_under_torchrun_leaves_no_process(tiny_model_dir, tmp_path):
    spec = _spec(tiny_model_dir, mode="full")
    names = ["cpu:0", "cpu:1"]
    child = start_child("probe", tmp_path / "probe", worker_job(spec, "probe", tiny_model_dir, "cpu", names),
                        launch_options(spec, names))
    events = list(watch(child))
    check_exit(child)
    ledgers = {e.rank: e for e in events if isinstance(e, Ledger)}
    assert sorted(ledgers) == [0, 1]
    # the links between the two ranks (core/child/links.py), written once, by rank 0, in nccl-tests' units
    (links,) = [e for e in events if isinstance(e, LinkCheck)]
    assert (links.rank, links.backend, links.members, links.bytes) == (0, "gloo", "rank", 4 * 2**20)
    assert links.names == ["rank 0 (cpu:0)", "rank 1 (cpu:1)"]
    reduce, gather = links.collectives
    assert (reduce["op"], gather["op"], reduce["ranks"]) == ("all_reduce", "all_gather", 2)
    assert reduce["algbw_gbps"] == pytest.approx(links.bytes / reduce["seconds"] / 1e9)
    assert reduce["busbw_gbps"] == pytest.approx(reduce["algbw_gbps"])  # 2(n-1)/n = 1 at n = 2
    assert gather["busbw_gbps"] == pytest.approx(gather["algbw_gbps"] / 2)  # (n-1)/n
    assert sorted((p["from"], p["to"]) for p in links.pairs) == [(0, 1), (1, 0)]
    assert all(p["busbw_gbps"] == pytest.approx(links.bytes / p["seconds"] / 1e9) for p in links.pairs)
    assert all(0 < p["best_seconds"] <= p["seconds"] and p["best_busbw_gbps"] >= p["busbw_gbps"] for p in links.pairs)
    assert (tmp_path / "probe" / "events.rank1.jsonl").is_file()  # rank 1 never writes into rank 0's file
    for ledger in ledgers.values():
        assert ledger.optimizer_states_bytes >= 2 * ledger.weights_bytes  # AdamW: 2 moments, not sharded
    assert not group_alive(child.proc.pid)  # torchrun and both ranks are gone


# ------------------------------------------------------------------------------------------------ settings, offline
@pytest.mark.parametrize(("kw", "field", "words"), [
    (dict(devices="cpu", strategy="ddp"), "strategy", "--nproc 2"),
    (dict(devices="cpu", torchrun_nproc_per_node=2), "torchrun.nproc_per_node", "data-parallel strategy"),
    (dict(devices="0,1", strategy="ddp", torchrun_nproc_per_node=3), "torchrun.nproc_per_node", "one process per CUDA"),
    (dict(devices="cpu", strategy="ddp", torchrun_nproc_per_node=2, torchrun_nnodes=2), "torchrun.rdzv_endpoint",
     "host:port"),
    (dict(devices="cpu", strategy="ddp", torchrun_nproc_per_node=2, torchrun_rdzv_endpoint="h:1"),
     "torchrun.rdzv_endpoint", "nnodes above 1"),
    (dict(devices="cpu", strategy="ddp", torchrun_nproc_per_node=-1), "torchrun.nproc_per_node", "0 (one per device)"),
    (dict(devices="cpu", strategy="ddp", torchrun_nproc_per_node=2, torchrun_rdzv_backend="etcd"),
     "torchrun.rdzv_backend", "c10d"),
])
def test_bad_torchrun_settings_are_named(kw, field, words):
    with pytest.raises(SpecError) as info:
        RunSpec.build(mode="full", **kw)
    assert info.value.field == field and words in info.value.message


def test_world_size_and_launch_options():
    cpu = RunSpec.build(mode="lora", devices="cpu", strategy="ddp", torchrun_nproc_per_node=2)
    assert (cpu.local_world_size(2), cpu.world_size(2)) == (2, 2)
    assert launch_options(cpu, ["cpu:0", "cpu:1"]).torchrun_args == ["--standalone", "--nproc-per-node=2"]
    gpus = RunSpec.build(mode="full", devices="2,3", strategy="zero3")
    assert gpus.world_size(2) == 2  # one per CUDA device
    nodes = RunSpec.build(mode="full", devices="0,1", strategy="ddp", torchrun_nnodes=4,
                          torchrun_rdzv_endpoint="node0.cluster:29500")
    assert nodes.world_size(2) == 8
    assert launch_options(nodes, ["cuda:0", "cuda:1"]).torchrun_args == [
        "--nnodes=4", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0.cluster:29500",
        "--rdzv-id=gpuaccept"]
    single = RunSpec.build(mode="lora", devices="cpu")
    assert launch_options(single, ["cpu"]) == Launch(nproc=1, torchrun_args=None, visible_devices=None) == SINGLE
    assert not SINGLE.torchrun and SINGLE.names("cpu") == ["cpu"]
    assert visible_for(["cuda:2", "cuda:3"], None) == "2,3"
    assert visible_for(["cuda:0", "cuda:2"], "4,5,6") == "4,6"  # composed with the parent's own restriction
    with pytest.raises(StageError, match="cuda:3 not visible"):
        visible_for(["cuda:3"], "4,5")


def test_zero3_across_nodes_divides_by_every_rank(tiny_model_dir):
    """The plan's divisor is the world size (every node's ranks), not this node's devices."""
    from core.prerun import make_plan

    one = make_plan(RunSpec.build(model=str(tiny_model_dir), mode="full", devices="cpu", strategy="zero3",
                                  torchrun_nproc_per_node=2)).plan
    two = make_plan(RunSpec.build(model=str(tiny_model_dir), mode="full", devices="cpu", strategy="zero3",
                                  torchrun_nproc_per_node=2, torchrun_nnodes=2,
                                  torchrun_rdzv_endpoint="127.0.0.1:29500")).plan
    w1, w2 = (p.devices[0].lines["weights"].bytes for p in (one, two))
    assert len(one.devices) == len(two.devices) == 2
    assert w2 == -(-w1 * 2 // 4) and "N=4" in two.devices[0].lines["weights"].method


def test_merge_rank_steps():
    from core.protocol.events import parse_event
    from core.stages.train import merge_rank_steps

    single = [{"kind": "step", "t": 1.0, "step": 1, "epoch": 0.5, "learning_rate": 1e-3, "loss": 2.0,
               "sample_ids": [1], "rng": {"cpu": "a"}}]
    # a single process's step is recorded as it came (without the line's kind and time)
    assert merge_rank_steps([parse_event(e) for e in single]) == [
        {k: v for k, v in single[0].items() if k not in ("kind", "t")}]
    events = [
        {"kind": "step", "step": 1, "rank": 1, "loss": 4.0, "sample_ids": [2], "rng": {"cpu": "b"}, "epoch": 0.5,
         "learning_rate": 1e-3},
        {"kind": "step", "step": 1, "rank": 0, "loss": 2.0, "sample_ids": [1], "rng": {"cpu": "a"}, "epoch": 0.5,
         "learning_rate": 1e-3},
        {"kind": "evaluation", "rank": 0, "when": "before", "perplexity": 9.0, "mean_nll": 2.2, "nll_sum": 22.0,
         "tokens": 10, "blocks": 1, "seconds": 0.1, "metric": "m"},
    ]
    (merged,) = merge_rank_steps([parse_event(e) for e in events])
    assert merged["loss"] == 3.0 and merged["rank_losses"] == [2.0, 4.0]
    assert merged["sample_ids"] == [1, 2] and merged["rng"] == {"cpu@rank0": "a", "cpu@rank1": "b"}


def test_a_kill_mid_run_ends_every_rank_at_once(tiny_model_dir, tmp_path):
    """torchrun starts each rank in a session of its own: killing torchrun's group alone left the ranks running."""
    import time

    from core.stages.childproc import child_groups, kill_group

    spec = _spec(tiny_model_dir, mode="full", probe_steps=200)
    names = ["cpu:0", "cpu:1"]
    child = start_child("probe", tmp_path / "probe", worker_job(spec, "probe", tiny_model_dir, "cpu", names),
                        launch_options(spec, names))
    seen: set[int] = set()
    for _event in watch(child, stop_when=lambda e: isinstance(e, ProbeStep) and seen.add(e.rank) is None
                       and len(seen) == 2):
        pass
    pids = sorted(e.pid for e in child.events if isinstance(e, Started))
    assert len(pids) == 2 and len(child_groups(child)) == 3  # torchrun's group and one per rank
    kill_group(child)
    time.sleep(0.2)
    def running(pid: int) -> bool:  # a killed rank may linger as a zombie until init reaps it: not running
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] not in "ZX"
        except (FileNotFoundError, ProcessLookupError):
            return False

    assert [pid for pid in pids if running(pid)] == []


def test_verify_wants_each_rank_once_at_the_spec_world_size(ddp_run, tmp_path):
    import copy

    import tomli_w

    from core.record.verify import verify

    _, record, _ = ddp_run
    for edit, words in [
        (lambda r: r["probe"]["devices"].__setitem__(1, copy.deepcopy(r["probe"]["devices"][0])), "must appear once"),
        (lambda r: r["probe"]["devices"][1].__setitem__("world_size", 4), "world size"),
        (lambda r: r["probe"].__setitem__("problems", ["rank 1: out of memory"]), "probe.problems"),
        (lambda r: r["probe"]["devices"][0].__setitem__("wrapper", "DistributedDataParallelXYZ"), "wrapped in"),
    ]:
        rec = copy.deepcopy(record)
        edit(rec)
        path = tmp_path / "record.toml"
        path.write_text(tomli_w.dumps(rec))
        result = verify(path)
        assert result.exit_code == 6 and any(words in v for v in result.verdicts), (words, result.verdicts)
