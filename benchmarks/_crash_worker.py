"""One training process of the crash campaign (benchmarks/crash_campaign.py); killed at random.

Dropout, Adam, a StepLR schedule and a shuffled loader, checkpointed by trainguard in the step
or the epoch form, synchronously or in the background. Appends to OUT:

* ``losses.txt``: ``pid step loss.hex()`` per step;
* ``starts.txt``: ``pid restored_step`` when the loop starts (``-`` when nothing was restored);
* ``commits.txt``: ``pid step`` each time a checkpoint is committed (written after the rename);
* ``warnings.txt``: every warning the restore gave;
* ``final.pt``: the final state, when the run completes.
"""

from __future__ import annotations

import argparse
import os
import random
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainguard.resilience import CheckpointManager, TrainState

BATCHES_PER_EPOCH = 6


def _append(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


class LoggedManager(CheckpointManager):
    """Notes every committed checkpoint, from whichever thread commits it."""

    out: Path

    def _commit(self, job):
        info = super()._commit(job)
        _append(self.out / "commits.txt", f"{os.getpid()} {job.step}")
        return info


def build(workers: int) -> TrainState:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.8)
    g = torch.Generator().manual_seed(42)
    n = 8 * BATCHES_PER_EPOCH
    data = TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))
    loader = DataLoader(data, batch_size=8, shuffle=True, num_workers=workers)
    return TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader)


def step_once(state: TrainState, x, y, log: Path, step: int) -> None:
    loss = torch.nn.functional.mse_loss(state.model(x), y)
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()
    _append(log, f"{os.getpid()} {step} {loss.item().hex()}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--form", choices=["step", "epoch"], default="step")
    p.add_argument("--total", type=int, default=30, help="steps (step form) or epochs (epoch form)")
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--async-save", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = build(args.workers)
    ckpt = LoggedManager(args.ckpt, keep=args.keep, every_steps=args.every, async_save=args.async_save)
    ckpt.out = out
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop = ckpt.resume(state, **({"total_steps": args.total} if args.form == "step" else {"epochs": args.total}))
    for w in caught:
        _append(out / "warnings.txt", f"{os.getpid()} {w.message}")
    restored = "-" if loop.restored_step is None else str(loop.restored_step)
    _append(out / "starts.txt", f"{os.getpid()} {restored}")
    log = out / "losses.txt"
    if args.form == "step":
        it = None
        for step in loop:
            if it is None:
                it = iter(state.loader)
            try:
                x, y = next(it)
            except StopIteration:
                state.epoch += 1
                it = iter(state.loader)
                x, y = next(it)
            step_once(state, x, y, log, step)
            state.scheduler.step()
    else:
        for _epoch in loop:
            for x, y in state.loader:
                step_once(state, x, y, log, state.step)
                loop.step()
            state.scheduler.step()
    ckpt.close()
    torch.save({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
                "scheduler": state.scheduler.state_dict(), "step": state.step}, out / "final.pt")


if __name__ == "__main__":
    main()
