"""A resumable training run: stop it any way you like, start it again, and it continues exactly.

    python examples/resume/train.py --run runs/resume-demo --steps 300

Press Ctrl-C (or send SIGTERM, as a cluster scheduler does before preemption): the step in flight
finishes, a checkpoint is written, and the process exits with 130 (143 for SIGTERM). Kill it
with ``kill -9`` instead and the next start falls back to the last checkpoint written every
``--every`` steps. Either way, run the same command again: it restores the newest valid
checkpoint (model, optimizer, schedule, RNG, the data loader's place in the epoch) and goes on.
``trainguard ckpt list runs/resume-demo`` shows what is on disk.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg


def build(seed: int = 0) -> tg.TrainState:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 20, generator=g)
    y = (x[:, :5].sum(dim=1, keepdim=True) > 0).float()  # a learnable rule
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, num_workers=2)
    return tg.TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="runs/resume-demo", help="run directory; checkpoints go to RUN/checkpoints")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=50, help="save every N steps")
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep per step (to have time to kill it)")
    args = p.parse_args()

    state = build()
    ckpt = tg.CheckpointManager(f"{args.run}/checkpoints", keep=3, every_steps=args.every, async_save=args.async_save)
    loop = ckpt.resume(state, total_steps=args.steps)
    print(f"resumed from step {loop.restored_step}" if loop.restored_step is not None else "starting from scratch")

    batches = None
    for step in loop:
        if batches is None:
            batches = iter(state.loader)
        try:
            x, y = next(batches)
        except StopIteration:  # end of an epoch: the next iter() starts the following one
            state.epoch += 1
            batches = iter(state.loader)
            x, y = next(batches)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(state.model(x), y)
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.scheduler.step()
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  epoch {state.epoch}  loss {loss.item():.4f}", flush=True)
        if args.step_delay:
            time.sleep(args.step_delay)
    last = ckpt.latest()
    print(f"done: {args.steps} steps; last checkpoint {last.name if last else None}")


if __name__ == "__main__":
    main()
