"""Gradients through a recurrent loop: the norm at each call of a module called many times per
forward, checked against the closed form of a linear recurrence."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainguard import Monitor
from trainguard.store import open_run


class LinearRNN(nn.Module):
    """``h_t = W h_{t-1} + x_t`` with ``W = a I``: the gradient reaching call t of ``rec`` is
    ``a ** (T - 1 - t)`` times the one reaching the last call."""

    def __init__(self, a: float, dim: int = 4):
        super().__init__()
        self.rec = nn.Linear(dim, dim, bias=False)
        with torch.no_grad():
            self.rec.weight.copy_(a * torch.eye(dim))
        self.dim = dim

    def forward(self, x):
        h = x.new_zeros(x.shape[0], self.dim)
        for t in range(x.shape[1]):
            h = self.rec(h) + x[:, t]
        return h


def through_time(path, layer="rec"):
    with open_run(path) as run:
        rows = [r for r in run.layer_stats(layer=layer) if r["kind"] == "through_time"]
    out: dict[int, dict[str, float]] = {}
    for r in rows:
        out.setdefault(r["step"], {})[r["stat"]] = r["value"]
    return out


@pytest.mark.parametrize("a", [1.5, 0.7])
def test_gradient_norm_per_call_matches_the_closed_form(tmp_path, a):
    T, dim = 10, 4
    model = LinearRNN(a, dim)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the recurrence stays a I
    with Monitor(model, tmp_path / "run", every=2, diagnose=False):
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(3, T, dim)).sum().backward()  # dL/dh_T = 1 for every unit
            opt.step()
    tt = through_time(tmp_path / "run")
    assert sorted(tt) == [0, 2]
    for stats in tt.values():
        assert stats["calls"] == T
        assert stats["grad_last"] == pytest.approx(math.sqrt(3 * dim), rel=1e-5)
        assert stats["grad_first"] == pytest.approx(a ** (T - 1) * math.sqrt(3 * dim), rel=1e-4)
        assert stats["growth_per_call"] == pytest.approx(a, rel=1e-4)


def test_a_layer_called_once_has_no_through_time_stats(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, tmp_path / "run", every=1, diagnose=False):
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
    with open_run(tmp_path / "run") as run:
        assert not [r for r in run.layer_stats() if r["kind"] == "through_time"]


def test_a_loop_layer_is_summarised_past_its_zero_initial_state(tmp_path):
    """The first call of ``rec`` sees h = 0 and outputs exactly 0 (it would read as dead units);
    once the loop is known, the statistics come from its middle call."""
    model = LinearRNN(0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with Monitor(model, tmp_path / "run", every=1, diagnose=False):
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 10, 4)).sum().backward()
            opt.step()
    with open_run(tmp_path / "run") as run:
        zero = {r["step"]: r["value"] for r in run.layer_stats(layer="rec", kind="activation") if r["stat"] == "zero_frac"}
    assert zero[0] == 1.0 and zero[1] < 0.5 and zero[2] < 0.5


def test_gradient_accumulation_follows_the_first_forward(tmp_path):
    model = LinearRNN(1.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with Monitor(model, tmp_path / "run", every=1, diagnose=False):
        opt.zero_grad()
        for _ in range(3):  # three micro-batches, one optimizer step
            model(torch.randn(3, 6, 4)).sum().backward()
        opt.step()
    assert through_time(tmp_path / "run")[0]["calls"] == 6


class Constrained(nn.Module):
    """cornellius-gp/gpytorch's constraints (gpytorch/constraints/constraints.py): every Positive /
    GreaterThan constraint holds the same module-level ``softplus = torch.nn.Softplus()``, so one
    parameterless module turns each raw hyperparameter into its value, called once per
    hyperparameter per forward, on inputs that never feed one another: not a loop. The values
    reach the loss with weights 1000, 100, 10 and 1 (the scales of a GP's noise, outputscale and
    lengthscales differ as much), which read as gradients growing x10 per call back in time."""

    def __init__(self):
        super().__init__()
        self.softplus = nn.Softplus()
        self.raw = nn.ParameterList([nn.Parameter(torch.zeros(2)) for _ in range(4)])

    def forward(self):
        return sum(10.0 ** (3 - k) * self.softplus(p).sum() for k, p in enumerate(self.raw))


def test_a_parameterless_module_shared_by_several_inputs_is_not_a_loop(tmp_path):
    model = Constrained()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with Monitor(model, tmp_path / "run", every=1, diagnose=False):
        for _ in range(3):
            opt.zero_grad()
            model().backward()
            opt.step()
    assert through_time(tmp_path / "run", layer="softplus") == {}
