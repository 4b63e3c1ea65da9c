"""A loss module that holds the trained model (sentence-transformers' SoftmaxLoss: ``self.model``
and a classifier of its own, called by the Trainer as ``loss(features, labels)``): the recorder
names modules as the monitor does, after the model's own ``state_dict`` (``1``, not ``model.1``)
and the loss's own modules under ``loss.`` (``loss.classifier``), so that a non-finite finding's
layer is a layer the monitor shows and a name in the model the user saves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.analysis import diagnose
from trainguard.store import open_run


class Log(nn.Module):
    def forward(self, x):
        return x.log()  # NaN where the features are negative


class SoftmaxLoss(nn.Module):  # sentence_transformers/losses/SoftmaxLoss.py, reduced
    def __init__(self, model, dim, labels):
        super().__init__()
        self.model = model
        self.classifier = nn.Linear(dim, labels)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.classifier(self.model(x)), y)


@pytest.mark.parametrize("backend", ["python", "native"])
def test_the_recorder_names_modules_after_the_model_a_loss_module_holds(tmp_path, backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Log())
    loss_fn = SoftmaxLoss(model, 8, 3)
    opt = torch.optim.SGD(loss_fn.parameters(), lr=0.01)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    d = tmp_path / "r"
    with tg.record(d, buffer=-1, backend=backend), tg.Monitor(None, d, every=1, diagnose=False) as mon:
        # what the Hugging Face integration does when the monitor finds the Trainer's loss module
        # (integrations._auto.name_after_trainers_model): the monitor names it after trainer.model
        mon._attach_listeners.append(lambda m, module: m.name_after(module, model, "loss."))
        for _ in range(3):
            opt.zero_grad()
            loss_fn(x, y).backward()
            opt.step()
    run = open_run(d)
    layers = {la["name"] for la in run.meta["monitor"]["layers"]}
    assert {"0", "1", "loss.classifier"} <= layers, layers
    modules = {(e["module"], e["module_type"]) for e in run.executions()}
    assert {("0", "Linear"), ("1", "Log"), ("loss.classifier", "Linear")} <= modules, modules
    assert not any(m and m.startswith("model.") for m, _ in modules), modules
    harm = run.execution(run.first_harm()["origin"])
    assert (harm["op"], harm["module"]) == ("aten.log", "1"), harm
    finding = next(f for f in diagnose(run) if f.kind == "nonfinite_loss")
    assert finding.layers == ["1"], finding
