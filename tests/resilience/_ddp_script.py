"""Two gloo ranks train a DDP model under the resumable loop (driven by test_distributed.py).

usage: _ddp_script.py first|second ROOT PORT TOTAL SIGTERM_AT

``first``: each rank trains TOTAL steps uninterrupted (ROOT/ref-ckpt, output ROOT/ref), then
trains again from scratch in ROOT/ckpt with asynchronous saves until rank 1 alone gets SIGTERM
during step SIGTERM_AT: both ranks save and stop (ROOT/out/preempted-rank<r>.txt says how).
``second``: new processes resume from ROOT/ckpt and finish (output ROOT/out). Each run appends
``step loss.hex()`` per step to <output>/losses-rank<r>.txt and writes <output>/final-rank<r>.pt.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainguard.resilience import CheckpointManager, Preempted, TrainState

WORLD = 2


def train(rank: int, ckpt: Path, out: Path, total: int, *, async_save: bool, sigterm_at: int = -1) -> None:
    torch.manual_seed(0)  # the same initial model everywhere
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(48, 6, generator=g), torch.randn(48, 1, generator=g))
    sampler = DistributedSampler(data, num_replicas=WORLD, rank=rank, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    torch.manual_seed(100 + rank)  # each rank its own dropout stream
    state = TrainState(model=ddp, optimizer=opt, scheduler=sched, loader=loader)
    manager = CheckpointManager(ckpt, every_steps=2, async_save=async_save)
    loop = manager.resume(state, total_steps=total)
    sampler.set_epoch(state.epoch)
    out.mkdir(parents=True, exist_ok=True)
    try:
        run(rank, state, loop, sampler, out, sigterm_at)
    except Preempted as exc:
        (out / f"preempted-rank{rank}.txt").write_text(f"{exc.code} {exc.step}")
        manager.close()
        return
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, out / f"final-rank{rank}.pt")
    manager.close()


def run(rank: int, state: TrainState, loop: Any, sampler: DistributedSampler, out: Path, sigterm_at: int) -> None:
    it = None
    for step in loop:
        if it is None:
            it = iter(state.loader)
        try:
            x, y = next(it)
        except StopIteration:
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            it = iter(state.loader)
            x, y = next(it)
        loss = torch.nn.functional.mse_loss(state.model(x), y)
        state.optimizer.zero_grad()
        loss.backward()
        if step == sigterm_at and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # only this rank is told; every rank must stop together
        state.optimizer.step()
        state.scheduler.step()
        with open(out / f"losses-rank{rank}.txt", "a") as f:
            f.write(f"{step} {loss.item().hex()}\n")


def worker(rank: int, phase: str, root: str, port: int, total: int, sigterm_at: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        base = Path(root)
        if phase == "first":
            train(rank, base / "ref-ckpt", base / "ref", total, async_save=False)
            train(rank, base / "ckpt", base / "out", total, async_save=True, sigterm_at=sigterm_at)
        else:
            train(rank, base / "ckpt", base / "out", total, async_save=False)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    phase, root, port, total, at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    mp.start_processes(worker, args=(phase, root, port, total, at), nprocs=WORLD, start_method="fork")  # the parent ran no torch op: safe to fork, no re-import
