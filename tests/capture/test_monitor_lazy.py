"""The monitor on models whose parameters are lazy (``nn.LazyLinear``; PyG's ``Linear(-1, out)``,
``SAGEConv((-1, -1), 16)`` and every model ``to_hetero`` builds, as in pytorch_geometric's
examples/hetero/to_hetero_mag.py): their shapes exist only after the first forward."""

from __future__ import annotations

import torch
from torch import nn

from trainguard import Monitor
from trainguard.store import open_run


def test_a_model_with_lazy_parameters_trains_under_the_monitor(tmp_path):
    # The monitor read param.shape of an UninitializedParameter when it attached the model and
    # raised "Can't access the shape of an uninitialized parameter": the script died at its
    # first forward, which runs under the monitor's hooks.
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, 3))
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    with Monitor(model, tmp_path / "r", every=5) as mon:
        with torch.no_grad():
            model(x)  # the lazy init, as PyG's examples do before building the optimizer
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for _ in range(25):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not [f for f in mon.findings if f.is_problem], [(f.kind, f.title) for f in mon.findings]
    with open_run(tmp_path / "r") as run:
        params = run.meta["monitor"]["params"]
        assert params["0.weight"]["shape"] == [16, 8] and params["0.bias"]["shape"] == [16], params
        assert "0" in run.layers()
