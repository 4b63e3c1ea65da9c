"""A tiny DDP job for the distributed tests: run under torchrun (or trainguard run), gloo on CPU.

usage: _train.py --out OUT [--ckpt DIR] [--steps N] [--every K] [--async] [--nan-at RANK:STEP]
                 [--sigterm-at RANK:STEP] [--hold-save STEP]

Each rank appends ``step loss.hex()`` to OUT/losses-rank<r>.txt and, when it finishes, writes
OUT/final-rank<r>.pt (model and optimizer state). With --ckpt the loop is trainguard's resumable
loop (DistributedSampler in the TrainState, a save every K steps). --nan-at puts a NaN into
that rank's batch at that step; --sigterm-at sends SIGTERM to that rank alone during that step.
--hold-save S holds the save of step S open (OUT/saving-rank<r> says it is) until this rank got
SIGTERM: a test then signals the launcher while a save is in flight.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import trainguard as tg
from trainguard.resilience import _engine


def _at(text: str | None) -> tuple[int, int]:
    if not text:
        return -1, -1
    rank, step = text.split(":")
    return int(rank), int(step)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt", type=Path)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--nan-at")
    p.add_argument("--sigterm-at")
    p.add_argument("--hold-save", type=int, default=-1)
    a = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        train(a)
    finally:
        # After train() returned: a DDP model still alive here would make the gloo group's
        # destructor wait at exit for a peer that is gone.
        dist.destroy_process_group()


def train(a: argparse.Namespace) -> None:
    rank = dist.get_rank()
    a.out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.25),
                                torch.nn.Linear(16, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(48, 6, generator=g), torch.randn(48, 1, generator=g))
    sampler = DistributedSampler(data, shuffle=True, seed=3)  # 6 batches per rank and epoch
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    torch.manual_seed(100 + rank)  # each rank its own dropout stream
    state = tg.TrainState(model=ddp, optimizer=opt, scheduler=sched, loader=loader, sampler=sampler)

    loop = None
    if a.ckpt is not None:
        manager = tg.CheckpointManager(a.ckpt, every_steps=a.every, async_save=a.async_save)
        if a.hold_save >= 0:
            _hold(manager, a.hold_save, a.out / f"saving-rank{rank}", lambda: loop is not None and loop._signal)
        loop = manager.resume(state, total_steps=a.steps)
        steps = iter(loop)
    else:
        manager = None
        steps = iter(range(a.steps))
    nan_rank, nan_step = _at(a.nan_at)
    term_rank, term_step = _at(a.sigterm_at)
    it = iter(state.loader)
    try:
        for step in steps:
            try:
                x, y = next(it)
            except StopIteration:
                state.epoch += 1
                sampler.set_epoch(state.epoch)
                it = iter(state.loader)
                x, y = next(it)
            if rank == nan_rank and step == nan_step:
                x[1, 3] = float("nan")  # the planted NaN
            loss = torch.nn.functional.mse_loss(state.model(x), y)
            opt.zero_grad()
            loss.backward()
            if rank == term_rank and step == term_step:
                os.kill(os.getpid(), signal.SIGTERM)  # only this rank is told; every rank must stop together
            opt.step()
            sched.step()
            with open(a.out / f"losses-rank{rank}.txt", "a") as f:
                f.write(f"{step} {loss.item().hex()}\n")
            if a.hold_save >= 0 and step == a.hold_save:
                _wait(lambda: loop._signal)  # the signal arrives while the save of this step is held
    finally:
        if manager is not None:
            manager.close()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, a.out / f"final-rank{rank}.pt")


def _wait(condition, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("no SIGTERM came")
        time.sleep(0.01)


def _hold(manager, step: int, marker: Path, signalled) -> None:
    """Hold this rank's tensor write of checkpoint ``step`` until the rank got SIGTERM."""
    save_tensors = _engine.save_tensors

    def held(tensors, directory, group):
        if f"{step:08d}" in directory.name:  # the temporary directory of that step
            marker.touch()
            _wait(signalled)
        return save_tensors(tensors, directory, group)

    _engine.save_tensors = held


if __name__ == "__main__":
    main()
