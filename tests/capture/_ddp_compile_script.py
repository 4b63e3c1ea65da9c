"""nanoGPT's train.py wraps its compiled model in DDP (``model = torch.compile(model)`` then
``DDP(model)``). A one-rank gloo group here, in a process of its own (a crash must fail the test,
not the test worker).

    python _ddp_compile_script.py LOGDIR record|check_numerics [python|native]
"""

import math
import sys

import torch
import torch.distributed as dist
from torch import nn

import trainguard as tg


def main(logdir: str, how: str, backend: str = "auto") -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(torch.compile(nn.Sequential(nn.Linear(8, 16), nn.ReLU(),
                                                                            nn.Linear(16, 3))))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    ctx = tg.record(logdir, buffer=-1, backend=backend) if how == "record" else tg.check_numerics(logdir)
    losses = []
    try:
        with ctx as rec:
            print("backend", rec.backend, flush=True)
            for step in range(3):
                opt.zero_grad()
                out = model(x * (math.inf if step == 2 and how == "check_numerics" else 1.0))
                loss = nn.functional.cross_entropy(out, y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
    except tg.NonFiniteError as e:
        print("NonFiniteError:", str(e).splitlines()[0], flush=True)
    print("losses", losses, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
