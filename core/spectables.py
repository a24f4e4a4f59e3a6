"""The spec's sub-tables, each a frozen dataclass whose fields are declared settings (core/settings.py): ``[lora]``,
``[qlora]``, ``[galore]``, ``[resume]`` (the kill-and-resume check: where it kills, how many twins measure the noise)
and ``[torchrun]`` (processes, nodes, the rendezvous), with their values' ``Literal`` types and the checks each table
makes of itself against the run (:meth:`ResumeSettings.check_against`, :meth:`TorchrunSettings.check_against`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from core import killpoints
from core.devicespec import (
    is_cpu,
)
from core.errors import SpecError
from core.methods import lora_variants
from core.methods.lora import QuantType
from core.settings import (
    setting,
)

#: The dtype LoRA's adapters are kept in: fp32 (peft's ``autocast_adapter_dtype``) or the base model's
AdapterDtype = Literal["fp32", "model"]


#: how many twin runs the recipe's twin tier runs by default (``resume.twins``; core/stages/noise.py). They branch from
#: the checkpoint the interrupted run starts from, so the reference, never loaded, is no member of the noise family:
#: 3 twins give 2 independent contrasts (3 pairs). With 2 (one pair: one draw of the noise) 5 of 100 correct resumes
#: failed a loss check under the test jitter (benchmarks/README.md, "resume false fails"): a ratio of two noise
#: norms over 2-3 points, F(2, 2)-tailed.
TWINS = 3


#: command mode's default (``command.resume_twins``): its twins run the whole command from step 0 as the reference
#: did, which is then one of the family: 2 twins give the same 2 contrasts
COMMAND_TWINS = 2


@dataclass(frozen=True)
class LoraSettings:
    """Low-rank adapter settings (Hu et al. 2021, arXiv 2106.09685): W + (alpha / r) * B @ A on each target module."""

    variant: str = setting("lora", choices=lora_variants,
                           help="LoRA or a variant of it: the same as --mode <variant>, which is what the spec "
                                "stores; give it with --mode lora (the default) or the same variant")
    r: int = setting(8, help="LoRA rank r", label="LoRA rank r", form_order=180)
    alpha: int = setting(16, help="LoRA alpha: the adapters' output is scaled by alpha / r", label="LoRA alpha",
                         form_order=190)
    dropout: float = setting(0.0, help="dropout on the adapters' input (0: none)")
    targets: tuple[str, ...] = setting(
        ("q_proj", "v_proj"), label="LoRA targets", form_order=200,
        help="comma-separated module names, e.g. q_proj,v_proj, or all-linear (peft: every linear layer but the LM "
             "head); lm_head adapts the output head")
    modules_to_save: tuple[str, ...] = setting(
        (), help="modules trained in full beside the adapters, e.g. embed_tokens,lm_head (peft's modules_to_save: a "
                 "trained copy of each, the original kept)")
    dtype: AdapterDtype = setting(
        "fp32", help="the adapters' dtype: fp32 (peft's autocast_adapter_dtype, the default) or model (the base's: "
                     "torchtune's and LitGPT's LoRA, TRL's over a quantised base)")


@dataclass(frozen=True)
class QloraSettings:
    """How mode ``qlora`` stores the frozen base (transformers' ``BitsAndBytesConfig(load_in_4bit=True, ...)``; QLoRA:
    Dettmers et al. 2023, arXiv 2305.14314). Every linear layer of the decoder is stored in 4 bits (blocks of 64 with
    an absmax each); embeddings, norms and the LM head are not. The compute dtype (``bnb_4bit_compute_dtype``) is the
    spec's ``dtype``.

    Attributes:
        quant_type: ``nf4`` or ``fp4`` (``bnb_4bit_quant_type``).
        double_quant: quantise the absmax constants as well (``bnb_4bit_use_double_quant``): 1 B per block of 64
            plus an fp32 absmax per 256 blocks, instead of 4 B per block.
        bitsandbytes: the bitsandbytes version the run uses, ``installed`` or ``MAJOR.MINOR.PATCH``: what a 4-bit
            layer keeps for backward depends on it (core/plan/quant.py :func:`keeps_4bit_input`).
    """

    quant_type: QuantType = setting("nf4", flag="--quant-type", label="4-bit data type", form_order=210,
                                    help="qlora: the 4-bit data type of the base (bnb_4bit_quant_type; default nf4)")
    double_quant: bool = setting(True, label="Double quant", form_order=220,
                                 help="qlora: quantise the per-block absmax constants too (bnb_4bit_use_double_quant; "
                                      "default on)")
    bitsandbytes: str = setting("installed", metavar="VERSION",
                                help="qlora: the bitsandbytes version the training runs with (installed: the one "
                                     "beside gpuaccept; a trainer's own environment may pin another): before 0.43.2 "
                                     "each 4-bit layer kept its input for backward")


@dataclass(frozen=True)
class GaloreSettings:
    """GaLore's settings (optimizer ``galore_adamw``; core/optim/galore.py): the rank of the gradients' projection and
    the matrices projected (module names or parts of them, ``all-linear``: every decoder linear weight)."""

    rank: int = setting(128, help="galore_adamw: the rank the targeted gradients are projected to (default 128)")
    targets: tuple[str, ...] = setting(("all-linear",), help="galore_adamw: the matrices projected, module names or "
                                                             "parts of them (mlp, self_attn), or all-linear")


#: Where the interrupted run of the resume check starts (:attr:`ResumeSettings.interrupted_from`).
InterruptedFrom = Literal["checkpoint", "start"]


INTERRUPTED_FROM: tuple[InterruptedFrom, ...] = get_args(InterruptedFrom)


#: How the resume check knows the run-to-run noise its tolerance checks are bounded by (core/stages/noise.py):
#: ``auto`` measures it with a twin run where kernels are not bit-exact (CUDA; the test jitter), and asks for bit-exact
#: agreement on the CPU, whose kernels are deterministic for a fixed thread count; ``twin`` always runs the twin;
#: ``off`` never does and asks for bit-exact agreement everywhere.
NoiseMethod = Literal["auto", "twin", "off"]


#: the most twin runs ``resume.twins`` may ask for (each is a training run from the branch point to the last compared
#: step)
MAX_TWINS = 8


NOISE_METHODS: tuple[NoiseMethod, ...] = get_args(NoiseMethod)


#: Where the SIGKILL of the resume check lands: the kill points, with what each means, are
#: :data:`core.killpoints.KILL_POINTS` (their one home)
KillAt = killpoints.KillAt


KILL_POINTS = killpoints.KILL_POINTS


@dataclass(frozen=True)
class ResumeSettings:
    """Kill-and-resume check settings.

    Attributes:
        check: run the check at all (training modes only).
        checkpoint_every: optimizer steps between Trainer checkpoints.
        kill_after_checkpoint: the interrupted run is killed after this checkpoint (1-based) and before the next one
            has been written completely.
        kill_at: where the SIGKILL lands, one of :data:`KILL_POINTS` (default ``boundary+1``: mid-accumulation, where
            a crash usually falls, during a forward or backward).
        compare_steps: optimizer steps after checkpoint c that the resumed run trains and compares with the
            uninterrupted run; 0 (the default) is one checkpoint interval (or up to the last step, if nearer). Its
            end must be a checkpoint of the uninterrupted run (a multiple of ``checkpoint_every``, or the last step),
            where the final weights and optimizer states are compared.
        interrupted_from: where the interrupted run starts, one of :data:`INTERRUPTED_FROM`: ``checkpoint`` (a copy
            of the uninterrupted run's checkpoint before c: the run to the kill is itself a resume) or ``start``
            (step 0: the check before issue 16, which costs about a whole training run).
        noise: how the noise that bounds the loss, weights and optimizer states is known, one of
            :data:`NOISE_METHODS` (``auto``: twin runs on CUDA or under the test jitter, bit-exact on the CPU).
        twins: how many twin runs measure it (:data:`TWINS` by default; 2 to
            :data:`MAX_TWINS`).
    """

    check: bool = setting(True, flag="--resume-check", command_key="resume_check",
                          help="run the kill-and-resume check (training modes; --no-resume-check skips it)")
    checkpoint_every: int = setting(10, mode_default=True, label="Checkpoint every", form_order=140,
                                    help="optimizer steps between checkpoints")
    kill_after_checkpoint: int = setting(
        2, mode_default=True, label="Kill after ckpt #", form_order=150, command_key="kill_after_checkpoint",
        help="the interrupted run is killed after this checkpoint (1-based), before the next one is written")
    kill_at: KillAt = setting(killpoints.DEFAULT_KILL_AT, help=killpoints.CLI_HELP, label="Kill point",
                              form_order=160)
    compare_steps: int = setting(0, label="Compare steps", form_kind="autoint", form_order=170,
                                 help="steps after the checkpoint resumed from that the resumed run trains and "
                                      "compares with the uninterrupted run (default 0: one checkpoint interval)")
    interrupted_from: InterruptedFrom = setting(
        "checkpoint", help="the interrupted run starts from a copy of the uninterrupted run's checkpoint before the "
                           "one resumed from (default), or from step 0")
    noise: NoiseMethod = setting(
        "auto", flag="--resume-noise", command_key="resume_noise",
        help="how the run-to-run noise that bounds the loss, weights and optimizer states is known: auto (default: a "
             "twin run measures it on CUDA; bit-exact on the CPU), twin (always run the twin), off (bit-exact "
             "required)")
    twins: int = setting(
        TWINS, flag="--resume-twins", command_key="resume_twins",
        help=f"how many twin runs measure the noise where a twin tier runs them (default {TWINS}, at least 2: their "
             "spread is the noise; every one after the first is nudged by one ulp, so it is never 0)")

    def kill_checkpoint_step(self) -> int:
        """Global step of the checkpoint the interrupted run resumes from."""
        return self.checkpoint_every * self.kill_after_checkpoint

    def kill_step(self) -> int:
        """The optimizer step k the kill is placed by (:func:`core.killpoints.kill_step`, which says why every kill
        point lands after checkpoint c is complete and before the next is)."""
        return killpoints.kill_step(self.kill_at, self.kill_checkpoint_step(), self.checkpoint_every)

    def interrupted_start(self) -> int:
        """The step the interrupted run starts from: the checkpoint before c (c - checkpoint_every) of the
        uninterrupted run, or 0 when c is the first checkpoint or ``interrupted_from = "start"``."""
        if self.interrupted_from == "start":
            return 0
        return self.kill_checkpoint_step() - self.checkpoint_every

    def compared_until(self, steps: int) -> int:
        """The last step the resumed run trains and compares (:attr:`compare_steps` after c; ``steps``: the run's)."""
        c = self.kill_checkpoint_step()
        if self.compare_steps == 0:
            return min(c + self.checkpoint_every, steps)
        return c + self.compare_steps

    def last_step_needed(self) -> int:
        """The last optimizer step the interrupted run must reach (``boundary+1`` is inside step k+1)."""
        return killpoints.last_step_needed(self.kill_at, self.kill_step())

    def describe(self, short: bool = False) -> str:
        """The kill point in words, with its step numbers (``short``: without what is on disk at that moment)."""
        return killpoints.describe(self.kill_at, self.kill_step(), self.kill_checkpoint_step(), short)

    def check_against(self, steps: int) -> None:
        """These settings (training with the check on) in a run of ``steps`` optimizer steps: intervals, the kill
        point, where the interrupted run starts, the compared steps, and a kill that lands before the end of the run.

        Raises:
            SpecError: naming the first invalid ``resume.*`` key and what to change.
        """
        if self.checkpoint_every < 1:
            raise SpecError("resume.checkpoint_every", f"must be at least 1 (got {self.checkpoint_every})")
        if self.kill_after_checkpoint < 1:
            raise SpecError("resume.kill_after_checkpoint", f"must be at least 1 (got {self.kill_after_checkpoint})")
        if self.kill_at not in KILL_POINTS:
            raise SpecError("resume.kill_at", f"{self.kill_at!r} is not a kill point; choose one of "
                                              f"{', '.join(KILL_POINTS)}")
        if self.interrupted_from not in INTERRUPTED_FROM:
            raise SpecError("resume.interrupted_from", f"{self.interrupted_from!r}: choose checkpoint (a copy of the "
                                                       "checkpoint before the kill) or start (step 0)")
        if self.noise not in NOISE_METHODS:
            raise SpecError("resume.noise", f"{self.noise!r}: choose auto (a twin run measures the noise where kernels "
                                            "are not bit-exact), twin (always) or off (bit-exact required)")
        if not 2 <= self.twins <= MAX_TWINS:
            raise SpecError("resume.twins", f"{self.twins}: give 2 to {MAX_TWINS} twin runs (two at least: their spread "
                                            "is the noise)")
        self._check_compare_steps(steps)
        last = self.last_step_needed()
        if not killpoints.fits_in_run(self.kill_at, last, steps):
            raise SpecError(
                "resume.kill_after_checkpoint",
                f"the kill ({self.kill_at}) would come at step {last}, not before the end of the run at step "
                f"{steps}: raise steps above {last} or lower checkpoint_every / kill_after_checkpoint",
            )

    def _check_compare_steps(self, steps: int) -> None:
        """``resume.compare_steps`` is 0 or ends at a checkpoint of the uninterrupted run within the run."""
        if self.compare_steps < 0:
            raise SpecError("resume.compare_steps", f"must be 0 (one checkpoint interval) or more (got "
                                                    f"{self.compare_steps})")
        if self.compare_steps == 0:
            return
        c, end = self.kill_checkpoint_step(), self.compared_until(steps)
        if end > steps:
            raise SpecError("resume.compare_steps", f"{self.compare_steps} steps after checkpoint-{c} end at step {end}, "
                                                    f"past the last step {steps}; at most {steps - c}")
        if end % self.checkpoint_every and end != steps:
            raise SpecError("resume.compare_steps", f"the comparison would end at step {end}, where the uninterrupted "
                                                    f"run keeps no checkpoint to compare weights with; give a multiple "
                                                    f"of checkpoint_every ({self.checkpoint_every}) or "
                                                    f"{steps - c} (to the last step)")

#: torchrun's rendezvous backends gpuaccept passes through (torch.distributed.elastic; c10d needs no etcd).
RdzvBackend = Literal["c10d", "static"]


RDZV_BACKENDS: tuple[RdzvBackend, ...] = get_args(RdzvBackend)


#: Where the nodes of a several-node run learn the rendezvous: given by hand (none), or the scheduler's variables
#: (slurm: srun's SLURM_*, core/cluster/slurm.py).
JobScheduler = Literal["none", "slurm"]


JOB_SCHEDULERS: tuple[JobScheduler, ...] = get_args(JobScheduler)


#: Strategies that run one process per rank under torchrun (the others run in one process).
TORCHRUN_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


@dataclass(frozen=True)
class TorchrunSettings:
    """How torchrun (``torch.distributed.run``) starts the ranks of strategies ddp / zero*: see
    https://pytorch.org/docs/stable/elastic/run.html.

    Attributes:
        nproc_per_node: processes on this node; 0 = one per CUDA device named by ``devices`` (1 on the CPU). On the
            CPU, N >= 2 starts N ranks over gloo (each a full process sharing the host's memory), so the whole
            several-rank path runs without a GPU.
        nnodes: nodes taking part; above 1, the same spec is run on every node with the same ``rdzv_endpoint`` and
            ``rdzv_id`` (torchrun's ``--nnodes --rdzv-backend --rdzv-endpoint --rdzv-id``; one node runs
            ``--standalone``).
        rdzv_endpoint: ``host:port`` every node reaches (required when ``nnodes`` > 1).
        rdzv_id: the job id all nodes share.
        rdzv_backend: ``c10d`` (default) or ``static``.
        scheduler: ``slurm``: ``nnodes``, ``rdzv_endpoint`` and ``rdzv_id`` are read from the variables srun sets
            (core/cluster/slurm.py) when the spec is built, and the record keeps the values read; ``none``: given.
    """

    nproc_per_node: int = setting(0, flag="--nproc", label="Ranks per node", form_kind="autoint", form_order=250,
                                  help="torchrun processes on this node (ddp, zero3): default one per CUDA device; on "
                                       "the CPU N >= 2 gloo ranks")
    nnodes: int = setting(1, command_key="nnodes",
                          help="nodes of a several-node run: run the same spec on every node with the same "
                               "--rdzv-endpoint")
    rdzv_endpoint: str = setting("", command_key="rdzv_endpoint", help="host:port every node reaches (--nnodes > 1)")
    rdzv_id: str = setting("gpuaccept", command_key="rdzv_id", help="job id shared by every node (default gpuaccept)")
    rdzv_backend: RdzvBackend = setting("c10d", help="torchrun's rendezvous backend (default c10d)")
    scheduler: JobScheduler = setting("none", help="slurm: nnodes, the rendezvous endpoint (the step's first node, "
                                                "MASTER_PORT or 29500) and id from srun's SLURM_* variables; run one "
                                                "task per node (srun --ntasks-per-node=1)")

    def args(self, nproc: int) -> list[str]:
        """torchrun's arguments for ``nproc`` processes on this node: ``--standalone`` on one node, the rendezvous
        options otherwise."""
        if self.nnodes == 1:
            return ["--standalone", f"--nproc-per-node={nproc}"]
        return [f"--nnodes={self.nnodes}", f"--nproc-per-node={nproc}", f"--rdzv-backend={self.rdzv_backend}",
                f"--rdzv-endpoint={self.rdzv_endpoint}", f"--rdzv-id={self.rdzv_id}"]

    def check_against(self, count: int | None, strategy: str, devices: str) -> None:
        """These settings for a run spread by ``strategy`` over ``devices`` (``count`` of them; None: not known yet):
        processes per node, nodes, the scheduler and the rendezvous.

        Raises:
            SpecError: naming the first invalid ``torchrun.*`` key and what to change.
        """
        if self.nproc_per_node < 0:
            raise SpecError("torchrun.nproc_per_node", f"must be 0 (one per device) or more (got {self.nproc_per_node})")
        if self.nnodes < 1:
            raise SpecError("torchrun.nnodes", f"must be at least 1 (got {self.nnodes})")
        several = self.nproc_per_node > 1 or self.nnodes > 1
        if several and strategy not in TORCHRUN_STRATEGIES:
            raise SpecError("torchrun.nproc_per_node" if self.nproc_per_node > 1 else "torchrun.nnodes",
                            f"several processes need a data-parallel strategy (ddp, or zero3 = fsdp); strategy "
                            f"{strategy} runs in one process: set strategy = \"ddp\" or nproc_per_node = 0")
        if count is not None and not is_cpu(devices) and self.nproc_per_node not in (0, count):
            raise SpecError("torchrun.nproc_per_node",
                            f"{self.nproc_per_node} processes for the {count} devices of devices = {devices!r}: "
                            "one process per CUDA device; set nproc_per_node = 0 (one per device) or name that many "
                            "devices")
        if self.scheduler not in JOB_SCHEDULERS:
            raise SpecError("torchrun.scheduler", f"{self.scheduler!r}: choose one of {', '.join(JOB_SCHEDULERS)}")
        if self.rdzv_backend not in RDZV_BACKENDS:
            raise SpecError("torchrun.rdzv_backend", f"{self.rdzv_backend!r}: choose one of {', '.join(RDZV_BACKENDS)}")
        if self.nnodes > 1:
            if not re.fullmatch(r"[A-Za-z0-9_.\-\[\]:]+:\d+", self.rdzv_endpoint):
                raise SpecError("torchrun.rdzv_endpoint",
                                f"{self.rdzv_endpoint!r}: {self.nnodes} nodes need a rendezvous host:port every node reaches, "
                                "e.g. node0.cluster:29500")
            if not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.rdzv_id):
                raise SpecError("torchrun.rdzv_id", f"{self.rdzv_id!r}: letters, digits, '.', '_' and '-' only")
        elif self.rdzv_endpoint:
            raise SpecError("torchrun.rdzv_endpoint", "a rendezvous is for several nodes; set nnodes above 1 or "
                                                      "leave rdzv_endpoint empty (one node runs --standalone)")
