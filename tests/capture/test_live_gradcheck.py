"""The live gradient check: the first time a custom ``torch.autograd.Function`` runs in a backward
pass, the monitor checks it once in float64 against central differences, off the training thread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.cli import main
from trainguard.store import open_run


class WrongCube(torch.autograd.Function):
    """x**3 whose backward forgets the factor 3."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x**2  # WRONG: d/dx x^3 = 3 x^2


class ScaleBy(torch.autograd.Function):
    """x * w * k with a non-tensor factor; the gradient of ``w`` is wrong (sign)."""

    @staticmethod
    def forward(ctx, x, w, k, mode="mul"):
        ctx.save_for_backward(x, w)
        ctx.k = k
        return x * w * k

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w * ctx.k, -(grad * x * ctx.k).sum(0), None, None


class GoodSwish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        s = torch.sigmoid(x)
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx, grad):
        x, s = ctx.saved_tensors
        return grad * (s + x * s * (1 - s))


class GoodPair(torch.autograd.Function):
    """Returns a tuple: (sin x, cos x), a non-tensor argument too."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return torch.sin(x) * scale, torch.cos(x) * scale

    @staticmethod
    def backward(ctx, g1, g2):
        (x,) = ctx.saved_tensors
        return (g1 * torch.cos(x) - g2 * torch.sin(x)) * ctx.scale, None


class Float32Only(torch.autograd.Function):
    """Computes in float32 whatever it is given: not checkable in float64."""

    @staticmethod
    def forward(ctx, x):
        return (x.float() * 2).to(x.dtype) if x.dtype == torch.float32 else x.float() * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class RefusesFloat64(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        if x.dtype != torch.float32:
            raise TypeError("float32 only")
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class StraightThrough(torch.autograd.Function):
    """Rounding with an identity backward: a surrogate gradient by design."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class Net(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 1)
        self.w = nn.Parameter(torch.ones(8))
        self.fn = fn

    def forward(self, x):
        h = self.fc1(x)
        fn = self.fn
        if fn is ScaleBy:
            h = ScaleBy.apply(h, self.w, 0.5)
        elif fn is GoodPair:
            a, b = GoodPair.apply(h, 2.0)
            h = a + b
        elif fn is not None:
            h = fn.apply(h)
        return self.fc2(h)


def _train(fn, steps=5, seed=0):
    torch.manual_seed(seed)
    model = Net(fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 6)
        y = torch.randn(64, 1)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _monitor(tmp_path, fn, **kw):
    with tg.Monitor(None, tmp_path / "run", every=2, **kw) as mon:
        _train(fn)
    with open_run(tmp_path / "run") as run:
        checks = run.meta.get("gradcheck") or []
    return mon.findings, checks


def _wrong(findings):
    return [f for f in findings if f.kind == "custom_gradient_wrong" and f.is_problem]


def test_a_wrong_backward_is_an_error_naming_function_input_and_relative_error(tmp_path):
    findings, checks = _monitor(tmp_path, WrongCube)
    (f,) = _wrong(findings)
    assert f.severity == "error"
    assert f.evidence["function"].endswith("WrongCube") and "WrongCube" in f.title
    assert f.evidence["input"] == "x" and f.evidence["input_index"] == 0
    assert f.evidence["relative_error"] == pytest.approx(2 / 3, rel=1e-3)
    assert f.evidence["file"].endswith("test_live_gradcheck.py") and f.evidence["line"] > 0
    assert "WrongCube.backward" in f.suggestion
    assert [c["status"] for c in checks] == ["wrong"]  # checked once, not once per step


def test_the_wrong_input_among_several_is_named(tmp_path):
    (f,) = _wrong(_monitor(tmp_path, ScaleBy)[0])
    assert f.evidence["input"] == "w" and f.evidence["input_index"] == 1
    assert f.evidence["relative_error"] == pytest.approx(2.0, rel=1e-3)  # -g against g


@pytest.mark.parametrize("fn", [GoodSwish, GoodPair], ids=lambda c: c.__name__)
def test_a_correct_function_passes(tmp_path, fn):
    findings, checks = _monitor(tmp_path, fn)
    assert _wrong(findings) == []
    assert [c["status"] for c in checks] == ["ok"], checks
    assert all(f.severity == "info" for f in findings if f.kind == "custom_gradient_wrong")


@pytest.mark.parametrize("fn", [Float32Only, RefusesFloat64, StraightThrough], ids=lambda c: c.__name__)
def test_functions_that_cannot_be_checked_are_skipped_without_alarm(tmp_path, fn):
    findings, checks = _monitor(tmp_path, fn)
    assert _wrong(findings) == []
    assert [c["status"] for c in checks] == ["skipped"], checks
    assert checks[0]["reason"]


def test_the_check_can_be_turned_off(tmp_path):
    findings, checks = _monitor(tmp_path, WrongCube, gradcheck=False)
    assert _wrong(findings) == [] and checks == []


def test_the_check_changes_nothing_in_training(tmp_path):
    plain = _train(GoodSwish)
    with tg.Monitor(None, tmp_path / "run", every=2):
        watched = _train(GoodSwish)
    assert watched == plain


def test_inputs_are_sliced_to_a_few_rows(tmp_path):
    _, checks = _monitor(tmp_path, GoodSwish)
    assert checks[0]["sliced"] and checks[0]["inputs"][0]["shape"][0] <= 4


GALLERY = Path(__file__).resolve().parents[2] / "examples" / "broken"


def test_cli_no_gradcheck(tmp_path, capsys):
    script = str(GALLERY / "wrong_custom_backward.py")
    assert main(["monitor", "--logdir", str(tmp_path / "a"), "--json", script, "--quiet", "--steps", "30"]) == 0
    on = [f["kind"] for f in json.loads(capsys.readouterr().out)["findings"] if f["severity"] == "error"]
    assert "custom_gradient_wrong" in on
    assert main(["monitor", "--no-gradcheck", "--logdir", str(tmp_path / "b"), "--json", script, "--quiet",
                 "--steps", "30"]) == 0
    off = [f["kind"] for f in json.loads(capsys.readouterr().out)["findings"]]
    assert "custom_gradient_wrong" not in off
    assert main(["run", "--monitor", "--no-gradcheck", "--logdir", str(tmp_path / "c"), script, "--quiet",
                 "--steps", "5"]) == 0
    with open_run(tmp_path / "c") as run:
        assert not run.meta.get("gradcheck")


def test_a_wrong_gradient_explains_the_symptoms(tmp_path):
    """A flat loss with a wrong custom gradient: the gradient is the cause, the curve a symptom."""
    import numpy as np

    from trainguard.analysis import diagnose
    from trainguard.store import acquire_writer, release_writer

    w = acquire_writer(tmp_path / "r")
    rng = np.random.default_rng(0)
    for s in range(60):
        w.add_scalars(s, {"loss": 1.6 + 0.01 * float(rng.standard_normal())})
    w.set_meta(monitor={"every": 5, "layers": [], "params": {}, "order": []},
               gradcheck=[{"function": "m.Swish", "name": "Swish", "file": "m.py", "line": 3, "status": "wrong",
                           "inputs": [{"index": 0, "name": "x", "shape": [4, 8], "checked": 16, "max_rel": 1.26,
                                       "analytic": 0.5, "numeric": 0.9, "worst_index": [0, 1], "status": "wrong"}]}])
    release_writer(w)
    with open_run(tmp_path / "r") as run:
        fs = {f.kind: f for f in diagnose(run)}
    assert fs["custom_gradient_wrong"].severity == "error"
    assert fs["loss_not_decreasing"].severity == "info"
    assert fs["loss_not_decreasing"].evidence["explained_by"] == ["custom_gradient_wrong"]


def test_recorded_and_monitored_the_check_still_runs_and_its_copies_are_not_recorded(tmp_path, capsys):
    script = str(GALLERY / "wrong_custom_backward.py")
    assert main(["run", "--monitor", "--logdir", str(tmp_path / "r"), "--buffer", "-1", script, "--quiet",
                 "--steps", "3"]) == 0
    with open_run(tmp_path / "r") as run:
        assert [c["status"] for c in run.meta["gradcheck"]] == ["wrong"]
        assert any(f["kind"] == "custom_gradient_wrong" for f in run.findings())
        # the kept input rows are copies made under the recorder's nose: no clone of 4 rows is recorded
        four_rows = [e for e in run.executions(op="clone") if e["outputs"] and e["outputs"][0]["shape"][:1] == [4]]
    assert four_rows == []
