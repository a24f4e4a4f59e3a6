"""Issue 39: two nodes as two hosts. Two network namespaces on this machine joined by a veth pair, each with its own
address and, through a UTS namespace, its own hostname, each running its own ``gpuaccept run`` (CPU ranks over gloo)
that meet at torchrun's c10d rendezvous on node0's address: rank 0's node records both nodes' ranks and the links
between them, and the resume check loses node1 (every process of its run SIGKILLed between checkpoints), restarts both
nodes from the last checkpoint and passes on each; with node1's side of the link slowed by tc, node1 is named and
``min_busbw_gbps`` fails. In command mode the user's own launcher line runs on both, and its resume check loses node1
the same way.

Needs root and iproute2 (``ip netns``, ``tc``), as CI has; skipped, with the reason, where namespaces cannot be made.
The kernel here has no ``netem`` qdisc ("Specified qdisc kind is unknown"), so the link is slowed with ``tbf``, tc's
token-bucket rate limit, on node1's egress: the same bandwidth cap netem's ``rate`` would set.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

SUBNET = "10.231.7"
#: LoRA at the smallest size that runs every stage's path on two nodes
RUN = ["run", "--headless", "--mode", "lora", "--strategy", "ddp", "--devices", "cpu", "--nproc", "1", "--nnodes", "2",
       "--steps", "3", "--checkpoint-every", "1", "--kill-after-checkpoint", "1", "--seq-len", "32", "--batch-size", "1", "--eval-max-blocks", "2",
       "--probe-steps", "3", "--learning-rate", "5e-3"]


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def hosts():
    """Two hosts, ``node0`` (SUBNET.1) and ``node1`` (SUBNET.2): their namespace names."""
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "tc", "unshare")):
        pytest.skip("two hosts need root and iproute2 (ip netns, tc) and unshare")
    names = [f"ga{os.getpid()}n{i}" for i in (0, 1)]
    added = {n: _ip("netns", "add", n) for n in names}
    made = [n for n, done in added.items() if done.returncode == 0]
    try:
        if len(made) < 2:
            why = next(done.stderr.strip() for done in added.values() if done.returncode)
            pytest.skip(f"network namespaces cannot be made here: {why}")
        link = _ip("link", "add", "eth1", "netns", names[0], "type", "veth", "peer", "name", "eth1", "netns", names[1])
        assert link.returncode == 0, link.stderr
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{SUBNET}.{i + 1} node{i}\n" for i in (0, 1))
        for i, ns in enumerate(names):
            for args in (("addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth1"), ("link", "set", "lo", "up"),
                         ("link", "set", "eth1", "up")):
                done = _ip("-n", ns, *args)
                assert done.returncode == 0, done.stderr
            folder = Path("/etc/netns") / ns  # `ip netns exec` mounts it over /etc: the hosts resolve their names
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(hosts_file)
        yield names
    finally:
        for ns in made:
            _ip("netns", "del", ns)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def run_nodes(hosts: list[str], runs: Path, model: Path, port: int, *extra: str) -> list[dict]:
    """``gpuaccept run`` on both hosts at once, meeting at node0's address; every node's record, rank 0's first."""
    args = [*RUN, "--model", str(model), "--rdzv-endpoint", f"{SUBNET}.1:{port}", "--rdzv-id", f"test-{port}", *extra]
    records = start_nodes(hosts, runs, args)
    return sorted(records, key=lambda r: -len(r["probe"]["devices"]))


def start_nodes(hosts: list[str], runs: Path, args: list[str]) -> list[dict]:
    """``gpuaccept ARGS`` on both hosts at once, each with its own runs folder; every node's record, node0's first."""
    import shlex

    exe = Path(sys.executable).parent / "gpuaccept"
    procs = []
    for i, ns in enumerate(hosts):
        line = shlex.join([str(exe), *args, "--runs-dir", str(runs / f"node{i}")])
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                                       f"hostname node{i} && exec {line}"], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=420)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    paths = sorted(runs.glob("node*/*/record.toml"))
    assert len(paths) == 2, "\n".join(o[-2000:] for o in outputs)
    return [{**tomllib.loads(path.read_text()), "path": path} for path in paths]


def test_two_hosts_meet_and_rank_0_records_both_nodes_and_their_links(hosts, tmp_path, tiny_model_dir):
    first, other = run_nodes(hosts, tmp_path, tiny_model_dir, 29510)
    probe = first["probe"]
    assert probe["status"] == "pass", probe["problems"]
    assert sorted((d["host"], d["rank"]) for d in probe["devices"])[0][0] == "node0"
    assert {d["host"] for d in probe["devices"]} == {"node0", "node1"}  # rank 0's node holds every node's ranks
    assert [d["host"] for d in other["probe"]["devices"]] != [d["host"] for d in probe["devices"]]
    links = probe["links"]
    assert links["members"] == "node" and sorted(n.split(" (")[1] for n in links["names"]) == ["node0)", "node1)"]
    assert len(links["pairs"]) == 2 and all(p["busbw_gbps"] > 0 for p in links["pairs"])
    assert links["slow"] == []  # an even link: neither direction below half the other
    # losing a node: node1's every process SIGKILLed inside step 2, node0's rank failing without it, both restarted
    # from checkpoint-1 and equal to the uninterrupted run at step 2
    checks = {r["probe"]["devices"][0]["host"]: {c["name"]: c for c in r["resume"]["checks"]} for r in (first, other)}
    assert first["resume"]["status"] == other["resume"]["status"] == "pass", checks
    assert checks["node1"]["kill"]["evidence"].startswith("node loss, this node: SIGKILL to process groups ")
    survived = checks["node0"]["kill"]["evidence"]
    assert survived.startswith("node loss: every process of node 1 (node1)'s run SIGKILLed inside step 2, after "
                               "micro-batch 1 of 1"), survived
    assert "this node's ranks 0 ended on their own" in survived and survived.endswith("no process of this node's run "
                                                                                      "is left")
    assert checks["node0"]["kill_point"]["evidence"].startswith("node 1 (node1): boundary+1: killed inside step 2")
    for host, rank in (("node0", 0), ("node1", 1)):  # each node resumed its own ranks from its own checkpoint
        assert f"RNG state of rank {rank} (rng_state_{rank}.pth)" in checks[host]["checkpoint_complete"]["evidence"]
        assert checks[host]["loss"]["evidence"] == "1 resumed losses: bit-identical"
    # the cluster record, beside rank 0's node record: every node's record inside it, by sha256, and verified
    from core.record.cluster import sha256
    from core.record.verify import record_problems

    assert not (other["path"].parent / "cluster.toml").exists()
    cluster = tomllib.loads((first["path"].parent / "cluster.toml").read_text())
    assert cluster["kind"] == "cluster" and len(cluster["nodes"]) == 2
    assert {n["sha256"] for n in cluster["nodes"]} == {sha256(r["path"].read_text()) for r in (first, other)}
    assert [n["holds_rank_0"] for n in cluster["nodes"]].count(True) == 1
    assert sorted((d["host"], d["rank"]) for d in cluster["devices"]) == [
        (d["host"], d["rank"]) for d in sorted(probe["devices"], key=lambda d: (d["host"], d["rank"]))]
    assert all(d["fits"] is True and d["planned_bytes"] > 0 for d in cluster["devices"])
    assert record_problems(cluster) == ([], [])
    from core.record.verify import EXIT_UNSIGNED, verify

    assert verify(first["path"].parent / "cluster.toml").exit_code == EXIT_UNSIGNED  # consistent, not yet signed
    assert cluster["verdict"]["status"] == ("pass" if {first["verdict"]["status"], other["verdict"]["status"]} ==
                                            {"pass"} else "fail")
    # a node's record edited inside it: its hash no longer holds, and its own numbers no longer give its verdict
    edited = cluster["nodes"][1]["record"].replace('status = "pass"', 'status = "fail"', 1)
    cluster["nodes"][1]["record"] = edited
    _, verdicts = record_problems(cluster)
    assert any("its record's sha256 is" in v for v in verdicts), verdicts


def test_a_slowed_link_names_its_node_and_fails_min_busbw(hosts, tmp_path, tiny_model_dir):
    # node1's egress capped at 200 Mbit/s = 0.025 GB/s; unslowed the veth carried 0.4 to 1.6 GB/s here under load
    cap = subprocess.run(["ip", "netns", "exec", hosts[1], "tc", "qdisc", "add", "dev", "eth1", "root", "tbf", "rate",
                          "200mbit", "burst", "32kbit", "latency", "400ms"], capture_output=True, text=True)
    assert cap.returncode == 0, cap.stderr
    try:
        first, other = run_nodes(hosts, tmp_path, tiny_model_dir, 29520, "--min-busbw-gbps", "0.1",
                                  "--no-resume-check")
    finally:
        subprocess.run(["ip", "netns", "exec", hosts[1], "tc", "qdisc", "del", "dev", "eth1", "root"])
    probe = first["probe"]
    (slow,) = probe["links"]["slow"]
    assert "(node1): every link out of it is slow" in slow
    worst = min(probe["links"]["pairs"], key=lambda p: p["busbw_gbps"])
    assert probe["links"]["names"][worst["from"]].endswith("(node1)") and worst["busbw_gbps"] < 0.03
    assert probe["status"] == "fail"
    rows = [r for r in first["verdict"]["stages"]["probe"]["criteria"] if r["criterion"] == "min_busbw_gbps"]
    missed = [r for r in rows if r["met"] is False]
    assert any("(node1) ->" in r["on"] for r in missed), rows
    # the other node's own ranks passed, but it stops with the cluster, saying which node stopped it and why
    assert other["probe"]["status"] == "pass"
    evidence = other["verdict"]["stages"]["evaluation"]["evidence"]
    assert evidence.startswith("not run: another node stopped, so this one stops too: ")
    assert "its probe failed: the links between ranks: min_busbw_gbps 0.1" in evidence


def test_your_own_launcher_line_runs_on_both_hosts_loses_one_and_they_share_one_cluster_record(hosts, tmp_path,
                                                                                                tiny_model_dir):
    """Command mode across nodes: the user's own torchrun line (Trainer + PEFT LoRA, examples/train_hf.py, saving on
    each node), its own rendezvous on node0, run by each host's gpuaccept told only the node count and that endpoint;
    each node measures its own rank and evaluates its weights, the resume check loses node1 and both resume, and node0
    writes the cluster record of both. Without save_on_each_node node1 has no checkpoint of its own to resume from:
    tests/unit/test_command_nodeloss.py."""
    from core.record.verify import record_problems

    hf = Path(__file__).resolve().parents[2] / "examples" / "train_hf.py"
    endpoint = f"{SUBNET}.1:29540"
    line = (f"{sys.executable} -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d "
            f"--rdzv-endpoint {endpoint} --rdzv-id cmd {hf} --model {tiny_model_dir} --out {{out}} --text "
            "{train_data} --max_steps 6 --save_steps 2 --learning_rate 0.2 --save_on_each_node")
    first, other = start_nodes(hosts, tmp_path, ["run", "--headless", "--command", line, "--nnodes", "2",
                                                 "--rdzv-endpoint", endpoint, "--eval-max-blocks", "4"])
    assert first["kind"] == other["kind"] == "command"
    stages = [{k: v["status"] for k, v in r["verdict"]["stages"].items()} for r in (first, other)]
    assert stages[0]["probe"] == stages[1]["probe"] == "pass", stages
    assert [d["rank"] for d in first["probe"]["devices"]] == [0] and [d["rank"] for d in other["probe"]["devices"]] == [1]
    assert first["ran"]["world_size"] == 2 and first["evaluation"]["after"]["value"] > 0  # node0 holds the weights
    for r in (first, other):  # each node's plan holds its own rank (world size 2 over 2 nodes), compared with it
        assert len(r["plan"]["devices"]) == 1 and len(r["plan"]["comparison"]) == 1, r["plan"]
        assert r["plan"]["comparison"][0]["measured_bytes"] == r["probe"]["devices"][0]["peak_rss_bytes"]
    # save_on_each_node: each node holds the weights and evaluates them
    assert other["evaluation"]["after"]["value"] == first["evaluation"]["after"]["value"]
    # the resume check loses node1 (not the rendezvous host's): killed after step 3, node0's rank failing without it,
    # both restarted from their own checkpoint-2 and equal to the uninterrupted run up to step 6
    checks = [{c["name"]: c for c in r["resume"]["checks"]} for r in (first, other)]
    assert first["resume"]["status"] == other["resume"]["status"] == "pass", checks
    assert checks[1]["kill"]["evidence"].startswith("node loss, this node: SIGKILL to ")
    assert checks[1]["kill_point"]["evidence"] == "this node's every rank (1) held after step 3: after checkpoint 2, " \
                                                  "before 4"
    assert checks[0]["kill"]["evidence"].startswith("node loss: every process of node1 (pid ")
    assert "SIGKILLed after step 3 (its ranks 1 held there); this node's ranks 0 " in checks[0]["kill"]["evidence"]
    for rank, node in enumerate(checks):
        assert node["checkpoint_complete"]["evidence"].endswith(
                f"trainer state (trainer_state.json), RNG state of rank {rank} (rng_state_{rank}.pth)")
        assert node["loss"]["evidence"] == "4 resumed losses (every rank): bit-identical"
        assert node["final_weights"]["evidence"].endswith("bit-identical")
    cluster = tomllib.loads((first["path"].parent / "cluster.toml").read_text())
    assert [(d["host"], d["rank"]) for d in cluster["devices"]] == [("node0", 0), ("node1", 1)]
    assert all(d["measured_peak_bytes"] > 0 for d in cluster["devices"])
    assert record_problems(cluster) == ([], [])
