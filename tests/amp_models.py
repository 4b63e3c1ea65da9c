"""fp16 training with a GradScaler on CPU (the AMP recipe of the PyTorch docs), for the tests of
how a recorded run treats the gradients of the steps the scaler skipped."""

from __future__ import annotations

import torch
from torch import nn


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))


def fp16_loop(model, steps, *, init_scale=2.0**24, nan_loss_at=None):
    """The AMP recipe of the PyTorch docs on CPU; ``nan_loss_at``: the loss itself is NaN there."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    skipped = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(64, 8, generator=g)
        y = x[:, :3].argmax(1)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
            if step == nan_loss_at:
                out = out * torch.log(torch.zeros(())).neg().mul(0)  # NAN LINE: -inf * -1 * 0 is NaN
            loss = nn.functional.cross_entropy(out, y)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < scale)
    return skipped


NAN_LINE = next(i for i, line in enumerate(open(__file__), 1) if "# NAN LINE" in line and "torch.log" in line)
