"""A loss that is NaN at every step leaves every gradient zero (a mean over no counted target: its
backward scales by 1/0 of nothing): transformers' run_mlm.py (examples/pytorch/language-modeling,
3034a13b) with ``--mlm_probability 0`` got nonfinite_loss and, beside it as a problem of its own,
"42 parameter(s) always get an all-zero gradient ... the loss does not depend on them"."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import trainguard as tg


def test_zero_gradients_under_a_loss_never_finite_are_its_symptom(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tg.Monitor(model, tmp_path / "r", every=2) as mon:
        for _ in range(6):
            ids = torch.randint(0, 16, (4, 6))
            loss = F.cross_entropy(model(ids).view(-1, 16), torch.full((24,), -100))  # no token masked
            opt.zero_grad()
            loss.backward()
            opt.step()
    by_kind = {f.kind: f for f in mon.findings}
    assert "nonfinite_loss" in by_kind and "param_zero_gradient" in by_kind, list(by_kind)
    assert by_kind["param_zero_gradient"].evidence.get("explained_by") == ["nonfinite_loss"]
    assert by_kind["param_zero_gradient"].severity == "info"
