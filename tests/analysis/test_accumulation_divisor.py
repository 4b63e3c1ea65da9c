"""``accumulation_not_averaged``: a step that accumulates k ``backward()`` calls on losses divided by
something other than k (or not at all): its gradients are k/d times the accumulated batch's mean.

Cut from karpathy/nanochat@92d63d4 scripts/base_train.py, whose loop runs ``grad_accum_steps``
micro-batches per optimizer step, each ``loss = loss / grad_accum_steps`` before ``loss.backward()``.
Without that division (4 micro-batches), nanochat's GPT under MuonAdamW still trained (Muon and Adam
normalise the update size) and the monitor said "Training looks healthy: loss 7.35 -> 0.0659", its
first loss 22.2 = 4 x ln 256."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainguard import Monitor

V, D = 32, 16


def train(tmp_path, divisor, accum=4, steps=25):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, V))
    nn.init.zeros_(model[3].weight)  # nanochat's lm_head starts near 0: the first losses are ln V
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    with Monitor(model, tmp_path / "r", every=5) as mon:
        for _ in range(steps):
            for _micro in range(accum):
                x = torch.randint(0, V, (16,), generator=g)
                loss = F.cross_entropy(model(x), (x * 3) % V)
                (loss / divisor).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {f.kind: f for f in mon.findings}


def test_micro_batch_losses_not_divided_by_the_accumulation_count_are_found(tmp_path):
    found = train(tmp_path, divisor=1)
    f = found.get("accumulation_not_averaged")
    assert f is not None and f.severity == "warning", list(found)
    ev = f.evidence
    assert ev["backward_per_step"] == 4 and abs(ev["divisor"] - 1) < 0.01, ev
    assert "loss / 4" in f.suggestion and "test_accumulation_divisor.py" in f.suggestion, f.suggestion
    assert "healthy" not in found
    # the loss four times the cross entropy sits "above chance" for that reason alone: a symptom of it
    assert found["loss_above_chance"].evidence.get("explained_by") == ["accumulation_not_averaged"]


def test_micro_batch_losses_divided_by_the_accumulation_count_are_healthy(tmp_path):
    assert "accumulation_not_averaged" not in train(tmp_path, divisor=4)
    assert "accumulation_not_averaged" not in train(tmp_path / "one", divisor=1, accum=1)
