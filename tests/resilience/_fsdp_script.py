"""Two gloo ranks train an FSDP2 model (``fully_shard``) on CPU (driven by test_fsdp.py).

usage: _fsdp_script.py first|second ROOT PORT

``first``: train STEPS steps uninterrupted (ROOT/ref), then from scratch for SAVE_AT steps and
save a checkpoint (ROOT/ckpt), as a job that is then killed. ``second``: new processes build the
model and a fresh optimizer, restore, and train the remaining steps while recording and
monitoring (ROOT/run/rank-K). Each writes ROOT/<phase>-rank<r>.json: losses as hex, this rank's shards of
the final parameters and Adam moments, and how many collectives the default group ran over
the steps after SAVE_AT.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import trainguard as tg

WORLD, STEPS, SAVE_AT = 2, 6, 3


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model, opt, rank: int, start: int, stop: int) -> list[str]:
    out = []
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 * rank + step)  # each rank its own batch per step
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item().hex())
    return out


def shards(model, opt) -> dict:
    params = {k: v.to_local().flatten().tolist() for k, v in model.state_dict().items()}
    moments = {f"{i}/{k}": v.to_local().flatten().tolist() for i, s in enumerate(opt.state.values())
               for k, v in s.items() if k != "step"}
    return {"params": params, "moments": moments, "types": sorted({type(v).__name__ for v in model.state_dict().values()})}


def collectives() -> int:
    return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()


def worker(rank: int, phase: str, root: str, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    base = Path(root)
    try:
        model, opt = build()
        if phase == "first":
            losses = train(model, opt, rank, 0, SAVE_AT)
            before = collectives()
            losses += train(model, opt, rank, SAVE_AT, STEPS)
            result = {"losses": losses, "collectives": collectives() - before, **shards(model, opt)}
            (base / f"ref-rank{rank}.json").write_text(json.dumps(result))
            model, opt = build()
            train(model, opt, rank, 0, SAVE_AT)
            tg.CheckpointManager(base / "ckpt").save(tg.TrainState(model=model, optimizer=opt), step=SAVE_AT)
        else:
            state = tg.TrainState(model=model, optimizer=opt)
            restored = tg.CheckpointManager(base / "ckpt").restore(state)
            before = collectives()
            with tg.record(base / "run", buffer=-1) as rec, tg.Monitor(model, base / "run", every=1) as mon:
                losses = train(model, opt, rank, restored, STEPS)
            result = {"losses": losses, "collectives": collectives() - before, "record_errors": rec.failures,
                      "findings": [f.kind for f in mon.findings], **shards(model, opt)}
            (base / f"second-rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    phase, root, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mp.start_processes(worker, args=(phase, root, port), nprocs=WORLD, start_method="fork")  # the parent ran no torch op
