"""Whether the loop writes its learning rates itself or a scheduler does (the fix text differs)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainguard import Monitor
from trainguard.store import open_run


def _train(tmp_path, scheduler: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: min(1.0, (it + 1) / 4)) if scheduler else None
    g = torch.Generator().manual_seed(0)
    with Monitor(model, tmp_path / "run", every=2, diagnose=False):
        for it in range(6):
            if sched is None:  # karpathy/llama2.c's train.py: get_lr(it) into every group, by hand
                for group in opt.param_groups:
                    group["lr"] = 1e-2 * min(1.0, it / 4) * (0.5 * (1 + math.cos(math.pi * it / 6)))
            x = torch.randn(16, 8, generator=g)
            F.cross_entropy(model(x), x[:, :3].argmax(1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
    with open_run(tmp_path / "run") as run:
        return run.meta["monitor"]


@pytest.mark.parametrize("scheduler", [False, True])
def test_the_monitor_says_when_the_loop_sets_its_learning_rate_itself(tmp_path, scheduler):
    meta = _train(tmp_path, scheduler)
    assert meta.get("lr_by_hand", False) is (not scheduler), meta


def test_reduce_lr_on_plateau_adds_no_initial_lr(tmp_path):
    # Why the fix text for lr_by_hand names ReduceLROnPlateau beside a loop's own get_lr(it): the
    # monitor cannot tell them apart by the optimizer's groups (torch 2.13).
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    assert not any("initial_lr" in g for g in opt.param_groups)
