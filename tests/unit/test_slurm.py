"""Slurm's conventions read into torchrun's rendezvous (core/cluster/slurm.py), with the variables a two-node srun
sets for each of its tasks: no Slurm daemon is needed."""
from __future__ import annotations

import pytest

from core.cluster.slurm import first_host, slurm_step
from core.errors import SpecError
from core.spec import RunSpec
from core.stages.childproc import launch_options
from tests.paths import REPO as ROOT

#: What `srun --nodes=2 --ntasks-per-node=1` sets on its task of node 1 (the variables read; a real dump holds more).
TWO_NODE_TASK = {
    "SLURM_JOB_ID": "200505", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gnode[10,20]",
    "SLURM_STEP_NODELIST": "gnode[10,20]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "1",
    "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURMD_NODENAME": "gnode20", "SLURM_TASKS_PER_NODE": "1(x2)",
}


@pytest.mark.parametrize(("nodelist", "first"), [
    ("gnode[10,20,25,37]", "gnode10"), ("gpu-[001-004],cpu-[1-2]", "gpu-001"), ("rack[1-2]-node[01-08]", "rack1-node01"),
    ("node7", "node7"), ("a,b", "a"), ("n[3]", "n3"), ("x[05-07,09]y", "x05y"),
])
def test_the_first_host_of_a_hostlist(nodelist, first):
    assert first_host(nodelist) == first


def test_a_broken_hostlist_is_named():
    with pytest.raises(SpecError, match="not a Slurm hostlist"):
        first_host("gnode[10-12")


def test_a_two_node_step_sets_the_rendezvous(monkeypatch):
    step = slurm_step(TWO_NODE_TASK)
    assert (step.nnodes, step.node_rank, step.host, step.port) == (2, 1, "gnode10", 29500)
    for name, value in TWO_NODE_TASK.items():
        monkeypatch.setenv(name, value)
    spec = RunSpec.build(mode="full", devices="cpu", strategy="ddp", torchrun_nproc_per_node=2,
                         torchrun_scheduler="slurm")
    t = spec.torchrun
    assert (t.nnodes, t.rdzv_endpoint, t.rdzv_id, t.scheduler) == (2, "gnode10:29500", "slurm-200505-0", "slurm")
    assert spec.world_size(2) == 4  # two ranks on each of the two nodes
    assert launch_options(spec, ["cpu:0", "cpu:1"]).torchrun_args == [
        "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=gnode10:29500",
        "--rdzv-id=slurm-200505-0"]
    # the record keeps what was read, so the spec rebuilt from it (verify) needs no Slurm
    assert RunSpec.from_dict(spec.to_dict()).torchrun == t


def test_master_port_and_a_given_endpoint_are_kept(monkeypatch):
    for name, value in {**TWO_NODE_TASK, "MASTER_PORT": "31000"}.items():
        monkeypatch.setenv(name, value)
    assert RunSpec.build(mode="full", devices="cpu", strategy="ddp", torchrun_nproc_per_node=2,
                         torchrun_scheduler="slurm").torchrun.rdzv_endpoint == "gnode10:31000"
    given = RunSpec.build(mode="full", devices="cpu", strategy="ddp", torchrun_nproc_per_node=2,
                          torchrun_scheduler="slurm", torchrun_rdzv_endpoint="10.1.0.10:29600")
    assert given.torchrun.rdzv_endpoint == "10.1.0.10:29600"  # an address on the fast network, given, wins


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"SLURM_STEP_NUM_TASKS": "16", "SLURM_NTASKS": "16"}, "torchrun.scheduler", "--ntasks-per-node=1"),
    ({"SLURM_JOB_ID": ""}, "torchrun.scheduler", "not a task of a Slurm job"),
    ({"SLURM_NODEID": "one"}, "torchrun.scheduler", "SLURM_NODEID='one' is not a count"),
])
def test_what_cannot_run_under_slurm_is_named(monkeypatch, change, field, words):
    for name, value in {**TWO_NODE_TASK, **change}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SpecError) as info:
        RunSpec.build(mode="full", devices="cpu", strategy="ddp", torchrun_nproc_per_node=2,
                      torchrun_scheduler="slurm")
    assert info.value.field == field and words in info.value.message


def test_nodes_given_against_the_step_are_refused(monkeypatch):
    for name, value in TWO_NODE_TASK.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SpecError) as info:
        RunSpec.build(mode="full", devices="cpu", strategy="ddp", torchrun_nproc_per_node=2,
                      torchrun_scheduler="slurm", torchrun_nnodes=4)
    assert info.value.field == "torchrun.nnodes" and "runs on 2" in info.value.message


def _run_args(argv: list[str]):
    from tui.flags import build_parser, spec_from_args

    args = build_parser().parse_args(argv)
    assert args.command == "run"
    return spec_from_args(args)


def test_the_sbatch_example_builds_its_spec_under_a_two_node_step(monkeypatch):
    """examples/slurm/accept.sbatch's gpuaccept line, as srun runs it on node 1 of a two-node step."""
    import os
    import shlex

    text = (ROOT / "examples" / "slurm" / "accept.sbatch").read_text().replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.startswith("srun "))
    for name, value in TWO_NODE_TASK.items():
        monkeypatch.setenv(name, value)
    argv = shlex.split(os.path.expandvars(line))
    spec = _run_args(argv[argv.index(".venv/bin/gpuaccept") + 1:])
    t = spec.torchrun
    assert (spec.strategy, spec.resume.check, t.nnodes, t.rdzv_endpoint) == ("ddp", True, 2, "gnode10:29500")
    assert "--ntasks-per-node=1" in argv[:argv.index(".venv/bin/gpuaccept")]


def test_the_kubernetes_example_builds_its_spec():
    """examples/kubernetes/accept-job.yaml: every pod's command, its rendezvous on pod 0 through the headless Service."""
    import yaml

    service, job = yaml.safe_load_all((ROOT / "examples" / "kubernetes" / "accept-job.yaml").read_text())
    assert service["spec"]["clusterIP"] == "None" and job["spec"]["completionMode"] == "Indexed"
    pod = job["spec"]["template"]["spec"]
    spec = _run_args(pod["containers"][0]["command"][1:])
    t = spec.torchrun
    assert t.nnodes == job["spec"]["completions"] == 2
    host = f"{job['metadata']['name']}-0.{pod['subdomain']}"  # an indexed Job's pod 0, by the Service's name
    assert t.rdzv_endpoint == f"{host}:{service['spec']['ports'][0]['port']}"
