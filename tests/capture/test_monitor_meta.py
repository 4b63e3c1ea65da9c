"""Shape passes on the "meta" device under the monitor.

Keras 3 on its torch backend (``keras/src/backend/torch/core.py``: ``compute_output_spec``) runs
the model and the loss on "meta" tensors, under ``no_grad``, to learn their output shapes: at
``compile``/``fit`` start and before each ``evaluate``. Such a pass has no values: it is neither a
training step nor a validation pass, and reading it (``.cpu()``) raises "Cannot copy out of meta
tensor". The model here is plain torch; the shape pass swaps in meta parameters as Keras does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from trainguard import Monitor
from trainguard.store import open_run


def _shape_pass(model: nn.Module) -> None:
    meta = {n: torch.empty_like(p, device="meta") for n, p in model.named_parameters()}
    with torch.no_grad():
        out = functional_call(model, meta, (torch.empty(4, 8, device="meta"),))
        F.cross_entropy(out, torch.zeros(4, dtype=torch.long, device="meta"))


def test_meta_shape_passes_are_not_steps_or_validation(tmp_path, caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    xv = torch.randn(64, 8, generator=g)
    yv = xv[:, :3].argmax(1)
    ref = []
    with Monitor(model, tmp_path / "run", every=2, diagnose=False):
        _shape_pass(model)
        for _epoch in range(3):
            for _ in range(8):
                x = torch.randn(32, 8, generator=g)
                opt.zero_grad()
                F.cross_entropy(model(x), x[:, :3].argmax(1)).backward()
                opt.step()
            _shape_pass(model)  # Keras' evaluate inside fit: a shape pass, then the batches
            with torch.no_grad():
                ref.append(F.cross_entropy(model(xv), yv).item())
    assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.text
    with open_run(tmp_path / "run") as run:
        loss = run.scalars("loss")["loss"]
        val = run.scalars("val_loss")["val_loss"]
    assert [s for s, _ in loss] == list(range(24))
    assert len(val) == 3
    assert [round(v, 5) for _, v in val] == [round(v, 5) for v in ref]


class KerasTensor:
    """A symbolic tensor: a shape and a dtype, no values (Keras' own has the same name)."""

    def __init__(self, shape):
        self.shape, self.dtype = shape, "float32"


class KerasLikeDense(nn.Module):
    """A Keras layer on the torch backend: built (its weights made) before its first, symbolic,
    call; the weights kept in the model's ParameterDict under their Keras paths too, the layer
    never registered as a torch child."""

    def __init__(self, fan_in: int, units: int, path: str):
        super().__init__()
        self.units, self.path = units, path
        self.kernel = nn.Parameter(torch.randn(fan_in, units) * 0.3)
        self.bias = nn.Parameter(torch.zeros(units))

    def forward(self, x):
        if isinstance(x, KerasTensor):
            return KerasTensor((x.shape[0], self.units))
        return x @ self.kernel + self.bias


class KerasLikeSequential(nn.Module):
    def __init__(self):
        super().__init__()
        object.__setattr__(self, "layers", [KerasLikeDense(8, 16, "seq/hidden"), KerasLikeDense(16, 3, "seq/out")])
        x = KerasTensor((None, 8))
        for layer in self.layers:  # Sequential.build: each layer called symbolically
            x = layer(x)
        self._torch_params = nn.ParameterDict(
            {f"{la.path}/{n}": getattr(la, n) for la in self.layers for n in ("kernel", "bias")})

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = torch.relu(x) if i == 0 else x
        return x


def test_keras_like_layers_are_part_of_the_model_found(tmp_path):
    """Found at run time (``trainguard monitor``): the model is the one trained, named by its own
    ``state_dict``; its layers, built by symbolic calls before it ran and called by it without
    being its torch children, are not models of their own (a Keras MLP made three roots: the
    first Dense layer as "", the second as "dense.", the Sequential as "sequential.")."""
    torch.manual_seed(0)
    with Monitor(None, tmp_path / "run", every=1, diagnose=False) as mon:
        model = KerasLikeSequential()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            x = torch.randn(16, 8)
            opt.zero_grad()
            F.cross_entropy(model(x), x[:, :3].argmax(1)).backward()
            opt.step()
        assert [r.prefix for r in mon._roots] == [""]
    with open_run(tmp_path / "run") as run:
        names = {r["layer"] for r in run.layer_stats(kind="gradient")}
    assert names == set(model.state_dict())
