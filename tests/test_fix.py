"""``trainguard.fix.revive_dead_units``: a network with ~70% dead ReLU units recovers."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import trainguard as tg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "broken"))
from _common import Teacher  # noqa: E402


def dead_fractions(model: nn.Module, x: torch.Tensor) -> list[float]:
    outs = []
    hooks = [m.register_forward_hook(lambda m, a, o: outs.append(o)) for m in model if isinstance(m, nn.ReLU)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return [(~o.ne(0).any(0)).float().mean().item() for o in outs]


def kill(model: nn.Module, fraction: float, width: int) -> None:
    with torch.no_grad():
        for lin in (model[0], model[2]):
            lin.bias[torch.randperm(width)[: int(fraction * width)]] = -20.0


def train(model, task, steps, gen, opt=None):
    opt = opt or torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        x, y = task.batch(64, gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return opt


def test_seventy_percent_dead_network_recovers_after_revival():
    torch.manual_seed(0)
    width = 16
    task = Teacher(classes=5, hidden=64)
    model = nn.Sequential(nn.Linear(20, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 5))
    kill(model, 0.7, width)
    xv, yv = task.batch(1024, torch.Generator().manual_seed(99))
    opt = train(model, task, 100, torch.Generator().manual_seed(0))
    dead = dead_fractions(model, xv)
    assert min(dead) >= 0.65  # still dead after training: no gradient reaches them
    control = copy.deepcopy(model)

    report = tg.fix.revive_dead_units(model, xv[:256], optimizer=opt, generator=torch.Generator().manual_seed(1))
    assert report.layers == {"0": (round(dead[0] * width), width), "2": (round(dead[1] * width), width)}
    assert report.activations == {"0": "1", "2": "3"}
    assert str(report).startswith(f"revived {report.total} of 32 units (0: ")
    assert dead_fractions(model, xv) == [0.0, 0.0]

    train(model, task, 200, torch.Generator().manual_seed(5), opt)
    train(control, task, 200, torch.Generator().manual_seed(5))
    with torch.no_grad():
        revived_loss = F.cross_entropy(model(xv), yv).item()
        control_loss = F.cross_entropy(control(xv), yv).item()
    assert max(dead_fractions(model, xv)) < 0.2
    assert revived_loss < 0.85 * control_loss


def test_conv_batchnorm_channels_buffers_and_optimizer_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Flatten(),
                          nn.Linear(4 * 5 * 5, 2))
    with torch.no_grad():
        model[1].bias.copy_(torch.tensor([0.0, -30.0, 0.0, -30.0]))  # channels 1 and 3 dead behind batch norm
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(16, 1, 5, 5)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    stats = model[1].running_mean.clone(), model[1].num_batches_tracked.clone()
    report = tg.fix.revive_dead_units(model, x, optimizer=opt)
    assert report.layers == {"0": (2, 4)}
    assert torch.equal(model[1].running_mean, stats[0]) and torch.equal(model[1].num_batches_tracked, stats[1])
    assert model[1].bias[[1, 3]].tolist() == [0.0, 0.0] and model[1].weight[[1, 3]].tolist() == [1.0, 1.0]
    momentum = opt.state[model[0].weight]["momentum_buffer"]
    assert momentum[1].abs().sum() == 0 and momentum[3].abs().sum() == 0 and momentum[0].abs().sum() > 0
    assert dead_fractions(nn.Sequential(*model[:3]), x) == [0.0]


def test_nothing_dead_nothing_changed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    before = copy.deepcopy(model.state_dict())
    report = tg.fix.revive_dead_units(model, torch.randn(64, 4))
    assert report.total == 0 and str(report) == "revived 0 of 8 units (0: 0/8)"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
