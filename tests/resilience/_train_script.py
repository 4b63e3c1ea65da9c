"""A small resumable training run, driven by the subprocess tests (killed, preempted, resumed).

Appends ``pid step loss.hex()`` per step to OUT/losses.txt and ``pid first_step`` to
OUT/starts.txt; a run that completes writes the final model and optimizer state to OUT/final.pt.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainguard.resilience import CheckpointManager, TrainState


def build(loader_kind: str, workers: int) -> TrainState:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.8)
    g = torch.Generator().manual_seed(42)
    data = TensorDataset(torch.randn(60, 8, generator=g), torch.randn(60, 1, generator=g))
    if loader_kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(data, batch_size=8, shuffle=True, num_workers=workers)
    else:
        loader = DataLoader(data, batch_size=8, shuffle=True, num_workers=workers)
    return TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--total", type=int, default=30)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--loader", choices=["plain", "stateful"], default="plain")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--sigterm-at", type=int, default=-1, help="send ourselves SIGTERM in the middle of this step")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    state = build(args.loader, args.workers)
    ckpt = CheckpointManager(args.ckpt, keep=2, every_steps=args.every, async_save=args.async_save)
    loop = ckpt.resume(state, total_steps=args.total)
    log = os.open(out / "losses.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    with open(out / "starts.txt", "a") as f:
        f.write(f"{os.getpid()} {loop.start_step}\n")
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
        loss = torch.nn.functional.mse_loss(state.model(x), y)
        state.optimizer.zero_grad()
        loss.backward()
        if step == args.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-step; the loop saves when the step ends
        state.optimizer.step()
        state.scheduler.step()
        os.write(log, f"{os.getpid()} {step} {loss.item().hex()}\n".encode())
    torch.save({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
                "scheduler": state.scheduler.state_dict()}, out / "final.pt")


if __name__ == "__main__":
    main()
