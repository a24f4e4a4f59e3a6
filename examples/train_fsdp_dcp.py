"""A PyTorch training script that shards its model with FSDP2 (``fully_shard``) and checkpoints with
``torch.distributed.checkpoint`` (DCP), as torchtitan-style jobs do: it resumes at another world size (DCP reshards
on load), which gpuaccept's resume check accepts for it and refuses for Trainer's per-rank checkpoints (issue 39).

It trains a small MLP regressor on synthetic data: the global batch of step s is drawn from a generator seeded by
``(seed, s)``, and each rank takes its equal share of it, so the global batch does not depend on the world size (the
global batch must divide by the world size). Under ``torchrun`` the ranks use gloo on the CPU, NCCL on CUDA.

Every ``--save_every`` steps it writes ``OUT/checkpoint-<step>/``: the DCP shards (``__<rank>_0.distcp``), its
``.metadata`` (written last, by rank 0: a checkpoint without it is incomplete) and ``train_state.json`` (the step).
Rank 0 appends ``{"step", "loss", "learning_rate"}`` to ``OUT/metrics.jsonl`` after each step. Nothing here knows
about gpuaccept.

Usage::

    torchrun --nproc-per-node 2 examples/train_fsdp_dcp.py --out OUT --steps 6 --save_every 2
    torchrun --nproc-per-node 1 examples/train_fsdp_dcp.py --out OUT2 --steps 6 --save_every 2 \\
        --resume OUT/checkpoint-2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="where checkpoints and metrics.jsonl go")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save_every", type=int, default=2)
    p.add_argument("--global_batch", type=int, default=8)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--learning_rate", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", help="a checkpoint-<step> folder this script wrote, at any world size")
    p.add_argument("--step_seconds", type=float, default=0.0, help="sleep after each step (a slower job, for tests)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global_batch {args.global_batch} does not divide by the world size {world}")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, args.width), torch.nn.GELU(), torch.nn.Linear(args.width, 4))
    mesh = init_device_mesh(device.type, (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    def scale(step: int) -> float:  # a linear decay to half the learning rate at the last step
        return 1.0 - step / (2 * args.steps)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, scale)
    out = Path(args.out)
    start = 0
    model_state = optim_state = None  # the last checkpoint's state dicts (freed before the group is destroyed)
    if args.resume:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=args.resume)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(json.loads((Path(args.resume) / "train_state.json").read_text())["step"])
        scheduler.last_epoch = start  # LambdaLR's state is its step count
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * scale(start)
    for step in range(start + 1, args.steps + 1):
        generator = torch.Generator().manual_seed(args.seed * 100_003 + step)
        x = torch.randn(args.global_batch, 16, generator=generator)
        y = torch.randn(args.global_batch, 4, generator=generator)
        share = args.global_batch // world
        xs, ys = x[rank * share:(rank + 1) * share].to(device), y[rank * share:(rank + 1) * share].to(device)
        loss = torch.nn.functional.mse_loss(model(xs), ys)  # this rank's mean; FSDP averages the gradients
        loss.backward()
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "loss": float(total) / world, "learning_rate": lr}) + "\n")
        time.sleep(args.step_seconds)
        if step % args.save_every == 0 or step == args.steps:
            folder = out / f"checkpoint-{step}"
            model_state, optim_state = get_state_dict(model, optimizer)
            if rank == 0:
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "train_state.json").write_text(json.dumps({"step": step}))
            dist.barrier()
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    # everything that holds the process group (FSDP's state, the mesh) freed while the interpreter is alive: a gloo
    # group left to the interpreter's teardown can abort it there ("terminate called without an active exception",
    # once in 12 runs on a loaded 2-core machine; pytorch/pytorch#179291)
    del model, optimizer, scheduler, mesh, model_state, optim_state
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
