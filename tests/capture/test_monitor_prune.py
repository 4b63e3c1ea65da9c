"""The monitor on models pruned with torch.nn.utils.prune (pytorch/tutorials
intermediate_source/pruning_tutorial.py): ``ln_structured`` zeroes whole output units by masking
every incoming weight, so the ReLU after them outputs 0 for every sample on purpose."""

from __future__ import annotations

import torch
import torch.nn.utils.prune as prune
from torch import nn

from trainguard import Monitor


def train(amount: float, tmp_path, prune_it: bool = True, lr: float = 0.05) -> list:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    templates, y_all = torch.randn(10, 64, generator=g), torch.randint(0, 10, (1024,), generator=g)
    x_all = 0.8 * torch.randn(1024, 64, generator=g) + templates[y_all]
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    if prune_it:
        prune.ln_structured(model[0], name="weight", amount=amount, n=2, dim=0)
        prune.ln_structured(model[2], name="weight", amount=amount, n=2, dim=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    with Monitor(model, tmp_path / "r", every=10) as mon:
        for _ in range(80):
            idx = torch.randint(0, 1024, (64,), generator=g)
            loss = nn.functional.cross_entropy(model(x_all[idx]), y_all[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return mon.findings


def test_units_pruned_on_purpose_are_not_dead_units(tmp_path):
    findings = train(0.8, tmp_path)
    assert not [f for f in findings if f.kind == "dead_units"], [(f.kind, f.title) for f in findings]
    assert not [f for f in findings if f.is_problem], [(f.kind, f.title) for f in findings]


def test_the_pruned_units_are_stored_with_their_layers(tmp_path):
    from trainguard.store import open_run

    train(0.5, tmp_path)
    with open_run(tmp_path / "r") as run:
        pruned = {la["name"]: la.get("pruned_units") for la in run.meta["monitor"]["layers"]}
    assert pruned["0"] == 64 and pruned["2"] == 32 and pruned["1"] is None and pruned["4"] is None
