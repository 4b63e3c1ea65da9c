"""Neural ODEs as rtqichen/torchdiffeq trains them (examples/ode_demo.py, examples/odenet_mnist.py):
``odeint(func, y0, t)`` wraps the user's dynamics in a module of its own, made anew at each call
(``_PerturbFunc``, holding ``func`` as ``base_func``), and the solver calls that wrapper many times
per step. The solver here is torchdiffeq's fixed-grid ``rk4`` (the 3/8 rule) written out."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard import Monitor
from trainguard.store import open_run


class _PerturbFunc(nn.Module):
    """torchdiffeq/_impl/misc.py: what odeint calls instead of ``func`` (it also nudges ``t`` to
    the next float at a discontinuity); ``_TupleFunc`` and ``_ReverseFunc`` hold it the same way."""

    def __init__(self, base_func):
        super().__init__()
        self.base_func = base_func

    def forward(self, t, y):
        return self.base_func(t.to(y.abs().dtype), y)


def odeint(func, y0, t):
    """The states at the times ``t``, as torchdiffeq's ``odeint(func, y0, t, method="rk4")``."""
    func = _PerturbFunc(func)
    y, ys = y0, [y0]
    for t0, t1 in zip(t[:-1], t[1:]):
        dt = t1 - t0
        k1 = func(t0, y)
        k2 = func(t0 + dt / 3, y + dt * k1 / 3)
        k3 = func(t0 + dt * 2 / 3, y + dt * (k2 - k1 / 3))
        k4 = func(t1, y + dt * (k1 - k2 + k3))
        y = y + dt * (k1 + 3 * (k2 + k3) + k4) / 8
        ys.append(y)
    return torch.stack(ys)


class ODEFunc(nn.Module):
    """examples/ode_demo.py's dynamics (hidden width 50 there)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, t, y):
        return self.net(y**3)


class ODEBlock(nn.Module):
    """examples/odenet_mnist.py's block: the model's forward calls odeint on its ``odefunc``."""

    def __init__(self, odefunc):
        super().__init__()
        self.odefunc = odefunc

    def forward(self, x):
        return odeint(self.odefunc, x, torch.tensor([0.0, 0.5, 1.0]))[-1]


def spiral_fit(func: nn.Module, steps: int) -> None:
    """ode_demo.py's loop: the optimizer holds func's parameters; the loop only calls odeint."""
    torch.manual_seed(0)
    opt = torch.optim.RMSprop(func.parameters(), lr=1e-3)
    t = torch.linspace(0.0, 1.0, 4)
    for _ in range(steps):
        y0 = torch.randn(8, 2)
        target = torch.stack([y0 * torch.exp(-s) for s in t])
        loss = (odeint(func, y0, t) - target).abs().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_monitor_names_the_dynamics_by_its_state_dict(tmp_path):
    # The monitor took odeint's wrapper for the model: its layers were "base_func.net.0", and as
    # each call's wrapper was freed the next was "a new model trained after it" (ode_demo.py over
    # 40 steps: 42 models, `_perturbfunc.` ... `_perturbfunc41.`, models_in_sequence), so the
    # loss's trend was never judged.
    func = ODEFunc()
    with Monitor(None, tmp_path / "r", every=1, diagnose=False) as mon:
        spiral_fit(func, steps=5)
        layers = sorted(mon.layers)
    assert "models_in_sequence" not in open_run(tmp_path / "r").meta["monitor"]  # the loss's trend is judged
    assert layers == ["net.0", "net.1", "net.2"]
    run = open_run(tmp_path / "r")
    assert set(run.meta["monitor"]["params"]) == set(func.state_dict())
    assert {r["step"] for r in run.layer_stats(layer="net.0.weight", kind="gradient")} == {0, 1, 2, 3, 4}


def _linear_names(run) -> tuple[set, set]:
    ops = run.executions(phase="forward", op="addmm")
    params = {i["name"] for e in ops for i in run.execution(e["seq"])["inputs"] if i["kind"] == "param"}
    return {r["module"] for r in ops}, params


@pytest.mark.parametrize("backend", ["native", "python"])
def test_recorder_names_the_dynamics_by_its_state_dict(tmp_path, backend):
    # Recorded, the dynamics' ops were in "base_func.net.0" (ode_demo.py), and inside a model
    # in "7.<_PerturbFunc>.base_func.conv1._layer" (odenet_mnist.py), where its state_dict says
    # "7.odefunc.conv1._layer.weight".
    func = ODEFunc()
    model = nn.Sequential(nn.Linear(3, 2), ODEBlock(ODEFunc()), nn.Linear(2, 1))
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        spiral_fit(func, steps=1)
        model(torch.randn(4, 3)).sum().backward()
    modules, params = _linear_names(open_run(tmp_path / "r"))
    assert modules == {"net.0", "net.2", "0", "1.odefunc.net.0", "1.odefunc.net.2", "2"}
    assert params == {"net.0.bias", "net.2.bias", "0.bias", "1.odefunc.net.0.bias", "1.odefunc.net.2.bias", "2.bias"}


class _AdjointSolve(torch.autograd.Function):
    """torchdiffeq's odeint_adjoint (adjoint.py, OdeintAdjointMethod) with fixed Euler steps: the
    forward solve runs with gradients off; the backward integrates the state and its adjoint
    ``a = dL/dy`` back from t1 to t0, one vector-Jacobian product of the dynamics per evaluation,
    each taken under ``enable_grad`` on a fresh leaf."""

    @staticmethod
    def forward(ctx, func, y0, steps, dt, *params):
        y = y0
        for _ in range(steps):
            y = y + dt * func(torch.zeros(()), y)
        ctx.func, ctx.steps, ctx.dt = func, steps, dt
        ctx.save_for_backward(y, *params)
        return y

    @staticmethod
    def backward(ctx, a):
        y, *params = ctx.saved_tensors
        grads = [torch.zeros_like(p) for p in params]
        for _ in range(ctx.steps):
            with torch.enable_grad():
                leaf = y.detach().requires_grad_()
                f = ctx.func(torch.zeros(()), leaf)
                vjp_y, *vjp_params = torch.autograd.grad(f, (leaf, *params), a)
            y = y - ctx.dt * f.detach()
            a = a + ctx.dt * vjp_y
            grads = [g + ctx.dt * v for g, v in zip(grads, vjp_params)]
        return (None, a, None, None, *grads)


class LinearField(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, t, y):
        return self.lin(y)


class DampedODE(nn.Module):
    """A stable linear vector field dy/dt = W y with W = -5 I, solved over t in [0, 3] in 30 Euler
    steps between an encoder and a decoder: the gradient reaching the state fades by 0.5 per step
    going back in time, from the last evaluation to the first."""

    def __init__(self, adjoint: bool):
        super().__init__()
        self.adjoint = adjoint
        self.enc = nn.Linear(4, 4)
        self.odefunc = LinearField()
        with torch.no_grad():
            self.odefunc.lin.weight.copy_(-5.0 * torch.eye(4))
            self.odefunc.lin.bias.zero_()
        self.dec = nn.Linear(4, 1)

    def forward(self, x):
        func = _PerturbFunc(self.odefunc)
        y = self.enc(x)
        if self.adjoint:
            y = _AdjointSolve.apply(func, y, 30, 0.1, *self.odefunc.parameters())
        else:
            for _ in range(30):
                y = y + 0.1 * func(torch.zeros(()), y)
        return self.dec(y)


@pytest.mark.parametrize("adjoint", [False, True])
def test_an_adjoint_solve_is_no_loop_through_time(tmp_path, adjoint):
    # odeint_adjoint calls the dynamics in the backward pass, one vector-Jacobian product per call
    # going back from t1: the monitor followed those calls as a recurrent loop in the order they
    # ran, so the gradient at t1 was "the first call's". A damped ODE, whose gradient fades going
    # back in time (grad at t0 / grad at t1 = 0.5 ** 29 here), was reported as exploding through
    # time (an error: "called 27 times per forward", first / last 6.7e7, x2.0 per call, with truncated
    # BPTT and nn.LSTM as the fix). torchdiffeq: examples/odenet_mnist.py --adjoint True, damped (W = -5 I).
    torch.manual_seed(0)
    model = DampedODE(adjoint)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with Monitor(model, tmp_path / "r", every=5) as mon:
        for _ in range(20):
            loss = (model(torch.randn(16, 4)) - 1).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert "gradient_explodes_through_time" not in {f.kind for f in mon.findings}, [f.title for f in mon.findings]
    with open_run(tmp_path / "r") as run:
        tt = {(r["step"], r["stat"]): r["value"] for r in run.layer_stats(layer="odefunc.lin") if r["kind"] == "through_time"}
    if adjoint:
        assert tt == {}, tt  # each call is differentiated on its own, before the next: no loop to follow
    else:  # the direct solve is a loop through time, followed from t0: the gradient fades going back
        assert tt[(0, "calls")] == 30
        assert tt[(0, "growth_per_call")] == pytest.approx(0.5, rel=1e-4)


@pytest.mark.parametrize("backend", ["native", "python"])
def test_recorder_names_the_adjoint_backward_passs_calls_by_the_dynamics(tmp_path, backend):
    # odeint_adjoint calls its wrapper of the dynamics again in the backward pass, where no module
    # of the model runs around it: the wrapper's own ops (y.abs() of t.to(y.abs().dtype), as in
    # torchdiffeq's _PerturbFunc) keep the name the forward pass gave it, the dynamics' "odefunc".
    model = DampedODE(adjoint=True)
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        model(torch.randn(4, 4)).sum().backward()
    with open_run(tmp_path / "r") as run:
        named = {(e["module"], e["phase"]) for e in run.executions() if e["module_type"] == "LinearField"}
    assert {m for m, _ in named} == {"odefunc"}, named
