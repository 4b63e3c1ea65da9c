"""Two gloo ranks train a DDP model under the guard; only rank 1's data holds a poisoned batch
(driven by test_guard_distributed.py).

usage: _ddp_guard_script.py ROOT PORT [POISON]

POISON: ``overflow`` (default: 1e20 in a whole batch, which ``x.pow(2)`` overflows), or ``data``: a
two-class cross-entropy with one NaN sample in that batch (a corrupt record, as in pytorch/examples'
ddp-tutorial-series data set) and one sample labelled 2 in the batch ten steps later (an index out of
range). One job for both: each spawns two ranks.

Each rank writes ROOT/out-rank<r>.json: the steps handed out, the guard's events, whether the
parameters are finite, and a digest of them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import trainguard as tg  # noqa: E402
from tests.guard.conftest import BS, PolyNet  # noqa: E402

WORLD = 2
POISON_STEP = 25
INDEX_STEP = 35


def main(rank: int, root: Path, port: int, poison: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        ddp = DistributedDataParallel(PolyNet())
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(10 + rank)  # each rank its own data
        x, y = torch.randn(60 * BS, 4, generator=g), torch.randn(60 * BS, 1, generator=g)
        label = (y[:, 0] > 0).long()  # data: a two-class label per sample, for cross_entropy
        if rank == 1 and poison == "data":
            x[POISON_STEP * BS + 2, 1] = float("nan")
            label[INDEX_STEP * BS + 2] = 2  # a label out of range for two classes
        elif rank == 1:
            x[POISON_STEP * BS:(POISON_STEP + 1) * BS] = 1e20
        data = TensorDataset(x, y, label) if poison == "data" else TensorDataset(x, y)
        state = tg.TrainState(model=ddp, optimizer=opt, loader=DataLoader(data, batch_size=BS))
        guard = tg.Guard(root / "run", snapshot_every=10)
        loop = tg.CheckpointManager(root / "ckpt", every_steps=10).resume(state, total_steps=40, guard=guard)
        seen = []
        for step, (xb, yb, *lb) in loop.batches():
            seen.append(step)
            out = ddp(xb)
            loss = (torch.nn.functional.cross_entropy(torch.cat([-out, out], 1), lb[0]) if lb
                    else torch.nn.functional.mse_loss(out, yb))
            opt.zero_grad()
            loss.backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
        out = {"seen": seen, "events": guard.events, "finite": bool(torch.isfinite(flat).all()),
               "digest": flat.double().sum().item(), "step": state.step}
        (root / f"out-rank{rank}.json").write_text(json.dumps(out, default=str))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    poison = sys.argv[3] if len(sys.argv) > 3 else "overflow"
    mp.spawn(main, args=(Path(sys.argv[1]), int(sys.argv[2]), poison), nprocs=WORLD, join=True)
