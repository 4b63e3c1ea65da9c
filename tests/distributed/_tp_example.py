"""pytorch/examples distributed/tensor_parallelism/tensor_parallel_example.py, shrunk: its ToyModel
(``in_proj`` ColwiseParallel, ``out_proj`` RowwiseParallel, whose bias stays ``Replicate``) on a
two-rank CPU mesh with gloo, Adam and ``clip_grad_norm_``; every rank trains on the same batch. Rank
0 prints each step's loss and the full gradient norm ``clip_grad_norm_`` returned."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(10, 32)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(32, 5)

    def forward(self, x):
        return self.out_proj(self.relu(self.in_proj(x)))


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = parallelize_module(ToyModel(), mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        torch.manual_seed(step)  # the same batch on every rank of the tensor-parallel group
        x = torch.rand(20, 10)
        loss = nn.functional.mse_loss(model(x), x[:, :5] * 2 - 1)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        opt.zero_grad()
        norm = norm.full_tensor()
        if dist.get_rank() == 0:
            print("loss", loss.item(), "norm", norm.item(), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
