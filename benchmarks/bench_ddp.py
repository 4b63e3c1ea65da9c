"""Recorder overhead on a distributed job: DistributedDataParallel on gloo ranks, plain against
``full_health`` on each backend and ``detect_anomaly``.

Every rank runs the same configurations in the same (rotated) order each round, since each
step's backward all-reduces the gradients with the other ranks; a step's time is the slowest
rank's (what the job waits for). A cell is the median over rounds of the paired ratio (the
configuration's median step over plain's in the same round), with its range. The recorder
sees DDP's bucket all-reduces in backward as ops (``c10d.allreduce_``); before the native core
learnt collectives, ``backend="auto"`` recorded a distributed job with the dispatch mode.

    python benchmarks/bench_ddp.py                         # MLP and transformer block, 2 ranks
    python benchmarks/bench_ddp.py --models mlp --rounds 3 --steps 5
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_recorder as b  # noqa: E402 - the models and the step loop, as for one process

CONFIGS = ["plain", "native:full_health", "python:full_health", "detect_anomaly"]


def _mlp():
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    y = torch.randint(0, 10, (256,))
    return model, torch.randn(256, 784), lambda out: torch.nn.functional.cross_entropy(out, y)


def _transformer():
    model = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True,
                                             norm_first=True, dropout=0.0)
    return model, torch.randn(8, 128, 256), lambda out: out.pow(2).mean()


# bench_recorder's MLP and transformer block (its transformer batch halved per rank), called
# through DistributedDataParallel.
MODELS = {"mlp": _mlp, "transformer": _transformer}


def _worker(rank: int, world: int, port: int, models: list[str], rounds: int, steps: int, out) -> None:
    torch.set_num_threads(1)  # one core per rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from torch.nn.parallel import DistributedDataParallel

    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            torch.manual_seed(rank)
            model, x, loss_of = MODELS[name]()
            ddp = DistributedDataParallel(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def loss_fn(ddp=ddp, x=x, loss_of=loss_of):
                return loss_of(ddp(x))
            b.run_steps(opt, loss_fn, 3)
            per = {c: [] for c in CONFIGS}
            for r in range(rounds):
                order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
                for c in order:
                    dist.barrier()
                    with b.context(c, tmp):
                        b.warm_up(opt, loss_fn, 0.0)
                        dist.barrier()
                        times = b.run_steps(opt, loss_fn, steps)
                    per[c].append(times)
            result[name] = per
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        out.put(gathered)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,transformer")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args.ranks, port, models, args.rounds, args.steps, q), nprocs=args.ranks,
                       start_method="spawn")
    gathered = q.get()
    table = {}
    print(f"DDP on {args.ranks} gloo ranks (1 thread each), {args.rounds} rounds x {args.steps} steps; "
          "ratio to plain, median [range] over rounds")
    print(f"{'model':<12}" + "".join(f"{c:>28}" for c in CONFIGS))
    for name in models:
        ratios = {c: [] for c in CONFIGS}
        for r in range(args.rounds):
            # The job's step: the slowest rank's, step by step.
            med = {c: statistics.median(max(ts) for ts in zip(*(g[name][c][r] for g in gathered))) for c in CONFIGS}
            for c in CONFIGS:
                ratios[c].append(med[c] / med["plain"])
        cells = {c: (statistics.median(v), min(v), max(v)) for c, v in ratios.items()}
        table[name] = cells
        print(f"{name:<12}" + "".join(f"{f'{m:.2f}x [{lo:.2f}-{hi:.2f}]':>28}" for m, lo, hi in cells.values()))
    return table


if __name__ == "__main__":
    main()
