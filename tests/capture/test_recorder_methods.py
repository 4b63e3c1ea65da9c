"""Ops that run inside a module's method with no module call around them (normflows'
``flow.inverse(z)``, ``vae.encode(x)``) belong to that module; ops inside a custom
``autograd.Function``'s forward in training with no module running (gpytorch's
``RBFCovariance``) are forward ops. Both backends say the same."""

from __future__ import annotations

import pytest
import torch
from tests_capture_flowmodel import NormalizingFlow, two_moons  # noqa: I001 - see conftest (path of this folder)
from torch import nn

import trainguard as tg
from trainguard.store import open_run

MODULES = {"flows.0": "AffineCouplingBlock", "flows.0.coupling": "AffineCoupling", "flows.2": "ActNorm",
           "q0": "DiagGaussian", "": "NormalizingFlow"}


def _flow_step(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = two_moons(16, torch.Generator().manual_seed(0))
    opt.zero_grad()
    model.forward_kld(x).backward()
    opt.step()


@pytest.mark.parametrize("backend", ["python", "native"])
def test_ops_in_a_modules_method_carry_its_path(tmp_path, backend):
    torch.manual_seed(0)
    model = NormalizingFlow(blocks=2)
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        _flow_step(model)
    run = open_run(tmp_path / "r")
    ex = run.executions()
    by_module = {}
    for e in ex:
        by_module.setdefault((e["module"], e["module_type"]), []).append(e)
    # the exp of AffineCoupling.inverse, the mean of NormalizingFlow.forward_kld, the base's log_prob
    exp = [e for e in ex if e["op"] == "aten.exp" and e["phase"] == "forward"]
    assert [(e["module"], e["module_type"]) for e in exp] == [  # the flows run last to first
        ("flows.5", "ActNorm"), ("flows.3.coupling", "AffineCoupling"), ("flows.2", "ActNorm"),
        ("flows.0.coupling", "AffineCoupling"), ("q0", "DiagGaussian")], [(e["module"], e["module_type"]) for e in exp]
    for path, type_name in MODULES.items():
        assert (path, type_name) in by_module, sorted(by_module)
    # their backward ops inherit the module, as those of a hooked module do
    assert any(e["phase"] == "backward" for e in by_module[("flows.0.coupling", "AffineCoupling")])
    # the optimizer's ops and the ops of a loop outside any method stay outside modules
    assert all(e["module"] is None for e in ex if e["phase"] == "optimizer")


def test_check_numerics_names_the_module_whose_method_made_the_inf():
    torch.manual_seed(0)
    model = NormalizingFlow(blocks=2)
    with torch.no_grad():  # the coupling's scale net says -100: exp(100) overflows in its inverse
        model.flows[0].coupling.param_map.net[-1].bias.fill_(-100.0)
    with pytest.raises(tg.NonFiniteError) as info:
        with tg.check_numerics():
            _flow_step(model)
    msg = str(info.value)
    assert "module: flows.0.coupling (AffineCoupling)" in msg, msg
    assert "flowmodel.py" in msg and "in inverse" in msg, msg


class _RBFCovariance(torch.autograd.Function):
    """gpytorch/functions/rbf_covariance.py: the kernel matrix made inside forward (grad off
    there), its gradient written by hand."""

    @staticmethod
    def forward(ctx, x1, x2, lengthscale):
        d2 = (x1[:, None] - x2[None, :]).pow(2) / lengthscale.pow(2)  # MARK-RBF
        k = torch.exp(-0.5 * d2)
        ctx.save_for_backward(d2, k, lengthscale)
        return k

    @staticmethod
    def backward(ctx, g):
        d2, k, lengthscale = ctx.saved_tensors
        return None, None, (g * k * d2 / lengthscale).sum().reshape(lengthscale.shape)


@pytest.mark.parametrize("backend", ["python", "native"])
def test_ops_inside_a_custom_function_in_training_are_forward(tmp_path, backend):
    x = torch.linspace(0, 1, 8)
    y = torch.sin(6 * x)
    raw = torch.zeros((), requires_grad=True)
    opt = torch.optim.Adam([raw], lr=0.1)
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        for _ in range(2):
            opt.zero_grad()
            k = _RBFCovariance.apply(x, x, torch.nn.functional.softplus(raw))
            loss = ((k @ y) - y).pow(2).mean()
            loss.backward()
            opt.step()
        with torch.no_grad():  # a metric after training: other
            _RBFCovariance.apply(x, x, torch.nn.functional.softplus(raw)).sum()
    ex = open_run(tmp_path / "r").executions()
    exps = [e for e in ex if e["op"] == "aten.exp"]
    # two training forwards, then the evaluation: under torch.no_grad the Function's ops are other
    assert [(e["step"], e["phase"]) for e in exps] == [(0, "forward"), (1, "forward"), (2, "other")], exps
    assert not [e for e in ex if e["phase"] == "other" and e["step"] < 2], [
        (e["op"], e["step"]) for e in ex if e["phase"] == "other"]


class _VAE(nn.Module):
    """pytorch/examples' VAE trained through model.loss(x), whose methods name their first
    argument ``s``; a free function that takes the model first is no method of it."""

    def __init__(s):
        super().__init__()
        s.enc = nn.Linear(6, 4)
        s.log_scale = nn.Parameter(torch.zeros(6))

    def loss(s, x):
        mu, logvar = s.enc(x).chunk(2, 1)
        z = mu + torch.exp(0.5 * logvar)  # MARK-VAE-EXP
        return (z.sum(1) + s.log_scale.sum()).mean()


def _penalty(model, x):
    return torch.tanh(x).mean()  # MARK-FREE-TANH


@pytest.mark.parametrize("backend", ["python", "native"])
def test_a_method_whose_self_has_another_name_is_the_modules(tmp_path, backend):
    torch.manual_seed(0)
    vae = _VAE()
    x = torch.randn(8, 6)
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        (vae.loss(x) + _penalty(vae, x)).backward()
    ex = open_run(tmp_path / "r").executions()
    assert [(e["module"], e["module_type"]) for e in ex if e["op"] == "aten.exp"] == [("", "_VAE")]
    assert [e["module"] for e in ex if e["op"] == "aten.tanh"] == [None]
