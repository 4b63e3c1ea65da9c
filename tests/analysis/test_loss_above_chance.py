"""``loss_above_chance``: a cross entropy over C classes that starts and stays well above ln C, the
loss of a uniform guess (confidently wrong logits: an output layer initialised far too large).

The model is johnma2006/mamba-minimal's head made small: an ``nn.Embedding`` (N(0, 1) by default)
whose weight the ``lm_head`` shares, behind a final norm. There, 40 steps went 15.7 -> 9.62 against
ln 64 = 4.16 and the monitor said "Training looks healthy"."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainguard import Monitor

V, D = 64, 16


class TiedLM(nn.Module):
    def __init__(self, std: float | None = None):
        super().__init__()
        self.embedding = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.norm_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.embedding.weight  # tied, as mamba-minimal's and nanoGPT's
        if std is not None:
            nn.init.normal_(self.embedding.weight, std=std)

    def forward(self, ids):
        x = self.embedding(ids)
        x = x + torch.tanh(self.mix(x))
        return self.lm_head(self.norm_f(x))


def train(tmp_path, std=None, lr=3e-3, steps=30, loss_fn=None):
    torch.manual_seed(0)
    model = TiedLM(std)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(1, V, (64, 8), generator=g).repeat(1, 5)[:, :33]
    loss_fn = loss_fn or (lambda logits, y: F.cross_entropy(logits, y))
    losses = []
    with Monitor(model, tmp_path / "r", every=5) as mon:
        for _ in range(steps):
            b = data[torch.randint(0, 64, (8,), generator=g)]
            loss = loss_fn(model(b[:, :-1]).reshape(-1, V), b[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return {f.kind: f for f in mon.findings}, losses


def test_a_tied_embedding_initialised_n01_keeps_the_loss_above_chance(tmp_path):
    found, losses = train(tmp_path)
    assert losses[0] > 3 * math.log(V) and losses[-1] > 2 * math.log(V), losses  # 14.7 -> 12.2 against 4.16
    assert "healthy" not in found, list(found)
    f = found.get("loss_above_chance")
    assert f is not None and f.severity == "warning", list(found)
    ev = f.evidence
    assert ev["classes"] == V and abs(ev["chance"] - math.log(V)) < 1e-9, ev
    assert ev["loss_start"] > 3 * ev["chance"] and ev["loss_end"] > 2 * ev["chance"], ev
    assert ev["logit_std"] > 2, ev  # a uniform guess has logits of equal value
    assert ev["output_layer"] == "lm_head" and ev["tied_to"] == "embedding.weight", ev
    assert "ln 64" in f.title or "ln(64)" in f.title, f.title
    assert "nn.init.normal_(model.embedding.weight, std=0.02)" in f.suggestion, f.suggestion


def test_a_small_init_is_not_above_chance(tmp_path):
    # GPT-2's init: the loss starts at ln 64 and falls from there
    found, losses = train(tmp_path, std=0.02)
    assert abs(losses[0] - math.log(V)) < 0.05, losses
    assert "loss_above_chance" not in found, list(found)


def test_a_summed_cross_entropy_is_not_judged_against_chance(tmp_path):
    # reduction="sum" over 256 tokens: 1,060 at the start, healthy; the loss is no per-token mean
    found, losses = train(tmp_path, std=0.02, loss_fn=lambda x, y: F.cross_entropy(x, y, reduction="sum"))
    assert losses[-1] > 100 * math.log(V), losses
    assert "loss_above_chance" not in found, list(found)


def test_a_cross_entropy_plus_a_penalty_is_not_judged_against_chance(tmp_path):
    # the loss is more than the cross entropy (a large auxiliary term): its level says nothing of ln C
    found, _ = train(tmp_path, std=0.02, loss_fn=lambda x, y: F.cross_entropy(x, y) + 10.0 + 0 * x.pow(2).mean())
    assert "loss_above_chance" not in found, list(found)


def test_a_loss_that_starts_above_chance_and_falls_below_it_is_fine(tmp_path):
    found, losses = train(tmp_path, lr=3e-2, steps=40)
    assert losses[0] > 2 * math.log(V) and sum(losses[-5:]) / 5 < math.log(V), losses
    assert "loss_above_chance" not in found, list(found)


def test_soft_targets_that_sum_to_one_are_judged_against_chance(tmp_path):
    # mixup's soft targets (timm's SoftTargetCrossEntropy): a uniform guess still loses ln C whatever
    # the target distribution, so the N(0, 1) head is above chance here too
    def soft(logits, y):
        t = 0.7 * F.one_hot(y, V).float() + 0.3 * F.one_hot(y.roll(1), V).float()
        return torch.sum(-t * F.log_softmax(logits, dim=-1), dim=-1).mean()

    found, _ = train(tmp_path, loss_fn=soft)
    assert "loss_above_chance" in found, list(found)


def test_a_regression_loss_is_not_judged_against_chance(tmp_path):
    found, _ = train(tmp_path, loss_fn=lambda x, y: F.mse_loss(x, F.one_hot(y, V).float() * 30))
    assert "loss_above_chance" not in found, list(found)


class _Clip(nn.Module):
    # open_clip's loss made small: two towers, unit-length features, a logit scale, and the mean of the
    # image->text and text->image cross entropies over the batch (two heads, C = the batch)
    def __init__(self, scale: float):
        super().__init__()
        self.a, self.b, self.scale = nn.Linear(32, 16), nn.Linear(32, 16), scale

    def forward(self, x, y):
        return self.scale * F.normalize(self.a(x), dim=-1) @ F.normalize(self.b(y), dim=-1).t()


def _clip_run(tmp_path, scale: float):
    torch.manual_seed(0)
    model = _Clip(scale)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mix = torch.randn(32, 32, generator=torch.Generator().manual_seed(9))
    with Monitor(model, tmp_path / f"clip{scale:.3g}", every=5) as mon:
        for step in range(30):
            g = torch.Generator().manual_seed(step)
            z = torch.randn(32, 32, generator=g)
            logits = model(z + 0.1 * torch.randn(32, 32, generator=g), z @ mix)
            labels = torch.arange(32)
            loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {f.kind: f for f in mon.findings}


def test_a_symmetric_contrastive_loss_with_too_large_a_logit_scale_is_above_chance(tmp_path):
    # 57.4 -> 26.5 against ln 32 = 3.47 at a fixed logit scale of 100; at CLIP's 1/0.07 it starts at
    # 7.49 and ends at 3.58, below the bar
    found = _clip_run(tmp_path, 100.0)
    f = found.get("loss_above_chance")
    assert f is not None and f.evidence["classes"] == 32, list(found)
    assert "temperature or logit scale" in f.suggestion, f.suggestion
    assert "loss_above_chance" not in _clip_run(tmp_path, 1 / 0.07)
