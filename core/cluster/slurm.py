"""Slurm's conventions for a several-node run: ``srun`` starts one ``gpuaccept run --scheduler slurm`` on each node of
the step, and each reads where it is from the variables srun sets for its task (https://slurm.schedmd.com/srun.html,
"OUTPUT ENVIRONMENT VARIABLES"). gpuaccept starts each node's ranks itself through torchrun, so srun runs one task per
node; the rendezvous is torchrun's c10d on the step's first node, the job id shared by every node.

No Slurm daemon is needed to read them: the tests set the variables a two-node ``srun`` sets.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from core.errors import SpecError

#: Where the rendezvous listens on the first node when MASTER_PORT is not set: torchrun's own default port for
#: ``--master-port`` (torch/distributed/run.py), which c10d's endpoint takes too when it is given without one.
DEFAULT_PORT = 29500
FIELD = "torchrun.scheduler"


@dataclass(frozen=True)
class SlurmStep:
    """Where this task of a Slurm step runs, from srun's variables.

    Attributes:
        job_id: ``SLURM_JOB_ID``.
        step_id: ``SLURM_STEP_ID`` ("" when srun did not set it).
        nodelist: the step's nodes in Slurm's compressed form (``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``).
        nnodes: nodes of the step (``SLURM_STEP_NUM_NODES``, else ``SLURM_JOB_NUM_NODES`` / ``SLURM_NNODES``).
        node_rank: this node's index in the step, 0-based (``SLURM_NODEID``).
        tasks: tasks srun started in the step (``SLURM_STEP_NUM_TASKS``, else ``SLURM_NTASKS``).
        host: the first node of ``nodelist``: where the rendezvous listens.
        port: ``MASTER_PORT`` when set, else :data:`DEFAULT_PORT`.
    """

    job_id: str
    step_id: str
    nodelist: str
    nnodes: int
    node_rank: int
    tasks: int
    host: str
    port: int

    @property
    def rdzv_endpoint(self) -> str:
        """``host:port`` of the c10d rendezvous, on the step's first node."""
        return f"{self.host}:{self.port}"

    @property
    def rdzv_id(self) -> str:
        """The id every node of this step shares: ``slurm-<job>[-<step>]``."""
        return f"slurm-{self.job_id}" + (f"-{self.step_id}" if self.step_id else "")

    def torchrun_table(self) -> dict[str, object]:
        """The ``[torchrun]`` keys this step sets: nnodes, rdzv_endpoint, rdzv_id."""
        return {"nnodes": self.nnodes, "rdzv_endpoint": self.rdzv_endpoint, "rdzv_id": self.rdzv_id}


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist, as ``scontrol show hostnames`` would list it first.

    A hostlist is comma-separated items; each item is text with bracketed ranges (``gpu[01-04,07]``,
    ``rack[1-2]-node[01-08]``); a range keeps its zero padding. The first host takes the first item and, in each bracket,
    the first number of its first range.

    Raises:
        SpecError: an empty list or an unclosed bracket.
    """
    item, depth = "", 0
    for char in nodelist.strip():
        if char == "," and depth == 0:
            break
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            break
        item += char
    if not item or depth != 0:
        raise SpecError(FIELD, f"slurm: the node list {nodelist!r} is not a Slurm hostlist (node[01-04],other)")
    return re.sub(r"\[([^\],\-]*)[^\]]*\]", r"\1", item)


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            if not value.isdigit():
                raise SpecError(FIELD, f"slurm: {name}={value!r} is not a count")
            return int(value)
    return None


def slurm_step(environ: Mapping[str, str]) -> SlurmStep:
    """This task's place in its Slurm step, from the variables srun sets.

    Raises:
        SpecError: (field ``torchrun.scheduler``) not under Slurm (no ``SLURM_JOB_ID`` or no node list), a count that
            is not a number, or more than one task per node (gpuaccept starts the node's ranks itself: srun
            ``--ntasks-per-node=1``).
    """
    job_id = environ.get("SLURM_JOB_ID", "").strip()
    nodelist = (environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                or environ.get("SLURM_NODELIST") or "").strip()
    if not job_id or not nodelist:
        raise SpecError(FIELD, "slurm: SLURM_JOB_ID and SLURM_JOB_NODELIST are not set, so this is not a task of a "
                               "Slurm job: start it with srun (srun --ntasks-per-node=1 gpuaccept run --scheduler "
                               "slurm ...), or give --nnodes and --rdzv-endpoint yourself")
    nnodes = _int(environ, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or 1
    tasks = _int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") or nnodes
    if tasks != nnodes:
        raise SpecError(FIELD, f"slurm: srun started {tasks} tasks on {nnodes} node(s); gpuaccept starts each node's "
                               "ranks itself (torchrun), so it runs as one task per node: srun --ntasks-per-node=1 "
                               f"--nodes={nnodes}")
    port = _int(environ, "MASTER_PORT") or DEFAULT_PORT
    return SlurmStep(job_id=job_id, step_id=environ.get("SLURM_STEP_ID", "").strip(), nodelist=nodelist,
                     nnodes=nnodes, node_rank=_int(environ, "SLURM_NODEID") or 0, tasks=tasks,
                     host=first_host(nodelist), port=port)


def resolve(torchrun: Mapping[str, object], environ: Mapping[str, str]) -> dict[str, object]:
    """The ``[torchrun]`` table with what Slurm says filled in: ``nnodes``, ``rdzv_endpoint`` and ``rdzv_id`` from the
    step unless given (an endpoint or id given is kept: another port, or an address on the fast network).

    Raises:
        SpecError: see :func:`slurm_step`; ``torchrun.nnodes`` given and not the step's node count.
    """
    step = slurm_step(environ)
    given = torchrun.get("nnodes")
    if given is not None and given != step.nnodes:
        raise SpecError("torchrun.nnodes", f"{given} nodes were given, but the Slurm step runs on {step.nnodes} "
                                           f"({step.nodelist}): leave --nnodes out under --scheduler slurm, or "
                                           f"srun --nodes={given}")
    return {**step.torchrun_table(), **torchrun}
