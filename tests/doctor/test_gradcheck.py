"""gradient_check: float64 central differences against autograd, banded, with the wrong ones named."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console
from torch import nn

from trainguard import doctor
from trainguard.doctor._gradcheck import BUG_BAND, PASS_BAND, band
from trainguard.store import dumps


class LinearFn(torch.autograd.Function):
    """A hand-written linear layer whose weight gradient is multiplied by ``scale``."""

    @staticmethod
    def forward(ctx, x, w, b, scale):
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w, ctx.scale * (grad.t() @ x), grad.sum(0), None


class CustomNet(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(20, 32)
        self.fc2 = nn.Linear(32, 10)
        self.scale = scale

    def forward(self, x):
        return LinearFn.apply(torch.tanh(self.fc1(x)), self.fc2.weight, self.fc2.bias, self.scale)


def test_healthy_models_pass(batch, new_mlp):
    nets = [
        new_mlp(),
        nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Dropout(0.3), nn.Linear(32, 32), nn.BatchNorm1d(32),
                      nn.GELU(), nn.Linear(32, 10)),
        CustomNet(scale=1.0),
    ]
    for net in nets:
        r = doctor.gradient_check(net, batch, nn.CrossEntropyLoss())
        assert r.passed, r.summary
        assert r.bad_params == [] and r.suspicious_params == []
        assert r.max_rel < PASS_BAND
        assert all(p.status == "ok" for p in r.params)


def test_wrongly_scaled_weight_gradient_in_custom_backward_is_named(batch):
    r = doctor.gradient_check(CustomNet(scale=1.5), batch, nn.CrossEntropyLoss())
    assert not r.passed
    assert r.bad_params == ["fc2.weight"]
    worst = next(p for p in r.params if p.name == "fc2.weight")
    assert worst.max_rel == pytest.approx(1 / 3, rel=1e-4)  # |1.5a - a| / 1.5|a|
    assert worst.analytic == pytest.approx(1.5 * worst.numeric, rel=1e-6)
    f = next(f for f in r.findings() if f.kind == "wrong_gradient")
    assert f.layers == ["fc2.weight"] and f.severity == "error"
    assert r.verdict == "fail"


def test_a_slightly_wrong_gradient_is_suspicious(batch):
    r = doctor.gradient_check(CustomNet(scale=1 + 1e-4), batch, nn.CrossEntropyLoss())
    assert r.suspicious_params == ["fc2.weight"] and r.bad_params == []
    assert not r.passed and r.verdict == "warn"


def test_a_gradient_that_does_not_flow_is_wrong(batch):
    class Leaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(20, 10)
            self.gain = nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            return self.fc(x) * self.gain.detach() + 0 * self.gain  # gain's gradient is cut

    r = doctor.gradient_check(Leaky(), batch, nn.CrossEntropyLoss())
    assert r.bad_params == ["gain"]


def test_bands():
    assert band(0.0) == "ok" and band(PASS_BAND / 2) == "ok"
    assert band(PASS_BAND * 2) == "suspicious" and band(BUG_BAND) == "suspicious"
    assert band(BUG_BAND * 1.01) == "wrong" and band(float("nan")) == "wrong" and band(float("inf")) == "wrong"


def test_params_selects_by_name_or_object(batch):
    net = CustomNet(scale=1.5)
    r = doctor.gradient_check(net, batch, nn.CrossEntropyLoss(), params=["fc1.weight"])
    assert [p.name for p in r.params] == ["fc1.weight"] and r.passed
    r = doctor.gradient_check(net, batch, nn.CrossEntropyLoss(), params=[net.fc2.weight], samples_per_param=3)
    assert r.bad_params == ["fc2.weight"] and r.params[0].checked == 3


def test_frozen_parameters_are_not_checked(batch, new_mlp):
    net = new_mlp()
    net[0].weight.requires_grad_(False)
    r = doctor.gradient_check(net, batch, nn.CrossEntropyLoss(), samples_per_param=2)
    assert "0.weight" not in [p.name for p in r.params]
    assert net[0].weight.grad is None and not net[0].weight.requires_grad


def test_result_serialises_and_renders(batch):
    r = doctor.gradient_check(CustomNet(scale=1.5), batch, nn.CrossEntropyLoss(), samples_per_param=4)
    d = json.loads(dumps(r.to_dict()))
    assert d["bad_params"] == ["fc2.weight"] and {p["name"] for p in d["params"]} == {
        "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    buf = io.StringIO()
    Console(file=buf, width=120).print(r)
    assert "fc2.weight" in buf.getvalue() and "wrong" in buf.getvalue()


@pytest.mark.parametrize("kwargs, match", [
    (dict(eps=0), "eps"),
    (dict(samples_per_param=0), "samples_per_param"),
    (dict(params=["nope"]), "no trainable parameter named 'nope'"),
    (dict(params=[torch.zeros(3)]), "parameter names or parameters"),
    (dict(batch=(torch.zeros(4, 20),)), "pair"),
    (dict(model=None), "nn.Module"),
])
def test_bad_inputs_are_value_errors(kwargs, match, mlp, batch):
    args = dict(model=mlp, batch=batch, loss_fn=nn.CrossEntropyLoss())
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        doctor.gradient_check(**args)


def test_sparse_embedding_gradients_and_large_parameters(state_of, same_state):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50_000, 8, sparse=True), nn.Flatten(), nn.Linear(24, 3))
    x, y = torch.randint(0, 50_000, (8, 3)), torch.randint(0, 3, (8,))
    nn.functional.cross_entropy(model(x), y).backward()  # leaves a sparse .grad behind
    before = state_of(model)
    # Entries sampled from the 400k-entry table are mostly unused rows: gradient 0 both ways.
    r = doctor.gradient_check(model, (x, y), nn.CrossEntropyLoss(), samples_per_param=32)
    assert r.passed and r.params[0].checked == 32
    same_state(before, state_of(model))
