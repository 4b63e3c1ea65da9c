"""The monitor on models whose weights are parametrized (torch.nn.utils.parametrize).

Derived from pytorch/tutorials intermediate_source/parametrizations.py (a ``Symmetric``
parametrization) with ``orthogonal`` and ``spectral_norm`` from ``torch.nn.utils.parametrizations``:
registering a parametrization evaluates it, and reading ``layer.weight`` calls its
``ParametrizationList``, a module with a parameter (``original``) that is no model of its own.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn
from torch.nn.utils import parametrizations as P

from trainguard import Monitor
from trainguard.store import open_run


class Symmetric(nn.Module):
    def forward(self, X):
        return X.triu() + X.triu(1).transpose(-1, -2)


def build() -> nn.Module:
    torch.manual_seed(0)
    sym = nn.Linear(8, 8)
    parametrize.register_parametrization(sym, "weight", Symmetric())
    return nn.Sequential(OrderedDict(inp=nn.Linear(6, 8), act1=nn.Tanh(), sym=sym, act2=nn.Tanh(),
                                     orth=P.orthogonal(nn.Linear(8, 8)), act3=nn.ReLU(),
                                     head=P.spectral_norm(nn.Linear(8, 3))))


def test_a_parametrization_evaluated_outside_the_model_is_not_taken_for_a_model(tmp_path):
    g = torch.Generator().manual_seed(1)
    x = 3.0 + 2.0 * torch.randn(64, 6, generator=g)  # the data's statistics, unlike any weight's
    y = torch.randint(0, 3, (64,), generator=g)
    with Monitor(None, tmp_path / "r", every=2, diagnose=False) as mon:  # as `trainguard run --monitor` starts
        model = build()  # register_parametrization evaluates each parametrization once
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(4):
            with parametrize.cached():
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert "original" not in mon.layers and not any(la.startswith("parametrizationlist") for la in mon.layers)
    with open_run(tmp_path / "r") as run:
        layers = run.layers()
        assert not [la for la in layers if la.startswith("parametrizationlist") or la in ("0", "original")], layers
        assert set(run.meta["monitor"]["params"]) == {n for n, _ in model.named_parameters()}
        first = {r["stat"]: r["value"] for r in run.layer_stats(layer="<input>", kind="input") if r["step"] == 0}
        assert abs(first["mean"] - x.mean().item()) < 1e-4 and abs(first["std"] - x.std().item()) < 1e-4
