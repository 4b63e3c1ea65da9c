"""Two gloo ranks train a small DDP model under trainguard.record (run by test_true_origin_frameworks).

DDP's gradient buckets are views of uninitialised memory (``empty`` then ``as_strided``): the
recorder must see them as unknown, never as NaN evidence. Usage: python _ddp_origin.py LOGDIR PORT
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def worker(rank: int, world: int, logdir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import trainguard as tg

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    with tg.check_numerics(), tg.record(logdir):  # record writes LOGDIR/rank-K
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
            loss = nn.functional.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, sys.argv[1], int(sys.argv[2])), nprocs=2, join=True)
