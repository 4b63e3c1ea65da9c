"""Two gloo ranks share one CheckpointManager directory (driven by test_lock.py).

usage: _lock_script.py held|free CKPT OUT PORT

Each rank saves step 1 and step 2, restores, and deletes nothing; it writes OUT/rank<r>.json:
what each call gave (``ok`` or the CheckpointError's text) and whether its manager held the
directory's lock. ``held``: another process owns CKPT, so every call must fail, on every rank,
naming that owner; ``free``: nobody does, and only rank 0 takes the lock.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainguard import CheckpointError
from trainguard.resilience import CheckpointManager, TrainState

WORLD = 2


def attempt(fn) -> str:
    try:
        fn()
        return "ok"
    except CheckpointError as exc:
        return str(exc)


def worker(rank: int, ckpt: str, out: str, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        state = TrainState(model=torch.nn.Linear(3, 2))
        manager = CheckpointManager(ckpt)
        result = {"save": attempt(lambda: manager.save(state, step=1)),
                  "restore": attempt(lambda: manager.restore(state)),
                  "save2": attempt(lambda: manager.save(state, step=2)),
                  "held": manager._lock.held, "pid": os.getpid()}
        manager.close()
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    ckpt, out, port = sys.argv[2], sys.argv[3], int(sys.argv[4])
    mp.start_processes(worker, args=(ckpt, out, port), nprocs=WORLD, start_method="fork")  # no torch op ran here
