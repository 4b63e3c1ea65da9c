"""The monitor beside torch.func: models called through ``functional_call`` under ``vmap`` / ``grad``.

Derived from pytorch/tutorials intermediate_source/ensembling.py (``stack_module_state``, a
``meta`` copy of one member called with ``vmap(functional_call)``, the trained parameters plain
stacked tensors in no nn.Module) and per_sample_grads.py (``vmap(grad(loss))`` over
``functional_call(model, ...)`` of a model that also trains as a module).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

from trainguard import Monitor
from trainguard.store import open_run


class SimpleMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 12, generator=g)
    return x, x[:, :4].argmax(1)


def _failures(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


def test_an_ensemble_called_only_under_vmap_is_not_measured_inside_the_transform(tmp_path, caplog):
    torch.manual_seed(0)
    models = [SimpleMLP() for _ in range(3)]
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    opt = torch.optim.Adam(list(params.values()), lr=1e-2)

    def fmodel(p, b, x):
        return functional_call(base, (p, b), (x,))

    losses = []
    with caplog.at_level("ERROR", logger="trainguard"):
        with Monitor(None, tmp_path / "r", every=2) as mon:
            for step in range(24):
                x, y = batch(step)
                out = vmap(fmodel, in_dims=(0, 0, None))(params, buffers, x)
                loss = nn.functional.cross_entropy(out.reshape(-1, 4), y.repeat(3))
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
    assert not _failures(caplog), _failures(caplog)
    assert losses[-1] < losses[0]
    kinds = {f.kind for f in mon.findings}
    # nothing is frozen (the meta copy's parameters are not the trained ones), and the script did
    # call its model as module(x): the advice about .forward() would be wrong
    assert "params_frozen" not in kinds and "no_model_called" not in kinds, [f.title for f in mon.findings]
    [verdict] = [f for f in mon.findings if f.kind == "model_in_torch_func"]
    assert "functional_call" in verdict.title and "vmap" in verdict.title
    assert verdict.severity == "info"
    with open_run(tmp_path / "r") as run:
        assert run.meta["monitor"]["status"] == "finished"


def test_per_sample_gradients_of_a_watched_model_leave_its_statistics_intact(tmp_path, caplog):
    torch.manual_seed(0)
    model = SimpleMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_one(p, b, x, y):
        return nn.functional.cross_entropy(functional_call(model, (p, b), (x.unsqueeze(0),)), y.unsqueeze(0))

    per_sample = vmap(grad(loss_one), in_dims=(None, None, 0, 0))
    with caplog.at_level("ERROR", logger="trainguard"):
        with Monitor(model, tmp_path / "r", every=2, diagnose=False):
            for step in range(6):
                x, y = batch(step)
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                params = {k: v.detach() for k, v in model.named_parameters()}
                norms = per_sample(params, {}, x, y)["fc1.weight"].flatten(1).norm(dim=1)
                assert norms.shape == (16,)
                opt.step()
    assert not _failures(caplog), _failures(caplog)
    with open_run(tmp_path / "r") as run:
        assert len(run.scalars("loss")["loss"]) == 6
        fc1 = {r["stat"]: r["value"] for r in run.layer_stats(layer="fc1", kind="activation") if r["step"] == 4}
        x, _ = batch(4)
        assert fc1, "the layer is measured in its own forward"
        assert fc1["max"] > 0
