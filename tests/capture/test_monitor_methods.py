"""Models whose modules run through methods (``flow.inverse(z)``, ``q0.log_prob(z)``,
``vae.encode(x)``), never ``module(x)``: the monitor still watches every tensor the loss trains."""

from __future__ import annotations

import math

import torch
from tests_capture_flowmodel import NormalizingFlow, two_moons  # noqa: I001 - see conftest (path of this folder)

import trainguard as tg
from trainguard.store import open_run


def _train(tmp_path, steps=4):
    torch.manual_seed(0)
    model = NormalizingFlow(blocks=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    norms = []
    with tg.Monitor(None, tmp_path / "m", every=1, diagnose=False):
        for _ in range(steps):
            opt.zero_grad()
            model.forward_kld(two_moons(64, g)).backward()
            norms.append(math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters())))
            opt.step()
    return model, open_run(tmp_path / "m"), norms


def test_every_trained_tensor_of_a_flow_run_through_methods_is_watched(tmp_path):
    model, run, norms = _train(tmp_path)
    params = run.meta["monitor"]["params"]
    # normflows' Real NVP: only the coupling MLPs are called as module(x); ActNorm's s and t and
    # the base distribution's loc and log_scale were left out (18 of 66 tensors in the notebook's
    # 8-block flow), under the names of the flow's own state_dict
    assert sorted(params) == sorted(n for n, _ in model.named_parameters()), sorted(params)
    assert params["flows.2.s"]["layer"] == "flows.2" and params["q0.log_scale"]["layer"] == "q0"
    assert all(p["gradient_steps"] == 4 for p in params.values()), params
    # the gradient norm covers them all
    got = [v for _, v in run.scalars("grad_norm")["grad_norm"]]
    assert len(got) == 4 and all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(got, norms)), (got, norms)
    # the layers called as module(x) keep their statistics, under the same names
    layers = {la["name"] for la in run.meta["monitor"]["layers"]}
    assert "flows.0.coupling.param_map.net.0" in layers, layers
