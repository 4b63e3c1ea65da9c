"""Lightning Fabric loops (``fabric.setup``, ``fabric.backward``, ``fabric.clip_gradients``) are
plain loops to trainguard; what ``fabric.setup`` wraps the model in is no level of the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("lightning")

import lightning as L  # noqa: E402

import trainguard as tg  # noqa: E402
from trainguard.store import open_run  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


LAYERS = {"fc1", "fc2"}


def fabric_steps(model, opt, n=4):
    """The loop of lightning examples/fabric/language_model/train.py, on random data."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model, opt = fabric.setup(model, opt)
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        x, y = torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, clip_val=0.25)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("found", [False, True], ids=["given", "found"])
def test_layers_and_ops_are_named_by_the_model_not_fabrics_wrapper(tmp_path, found):
    # On lightning examples/fabric/language_model/train.py every layer, finding and recorded op was
    # "_forward_module.transformer.decoder.layers.1.linear2": the _FabricModule fabric.setup returns
    # holds the model as _forward_module, a name the user never wrote.
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tg.record(tmp_path / "r", buffer=-1), tg.Monitor(None if found else model, tmp_path / "m", every=2,
                                                           diagnose=False) as mon:
        fabric_steps(model, opt)
        assert set(mon.layers) == LAYERS
    with open_run(tmp_path / "m") as run:
        assert {r["layer"] for r in run.layer_stats(kind="activation")} == LAYERS
        assert {r["layer"] for r in run.layer_stats(kind="weight")} == {"fc1.weight", "fc1.bias", "fc2.weight",
                                                                          "fc2.bias"}
    with open_run(tmp_path / "r") as run:
        modules = {e["module"] for e in run.executions(phase="forward")}
    assert modules - {None, ""} == LAYERS
