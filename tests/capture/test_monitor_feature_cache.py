"""A model trained through the inner module that its watched wrapper holds, and contrastive
gradient accumulation with cached features (open_clip's ``--accum-freq``, GradCache).

The two-tower model is derived from mlfoundations/open_clip (``open_clip.model.CLIP``,
``open_clip.loss.ClipLoss``, ``open_clip.task.CLIPTask`` and the ``accum_freq > 1`` branch of
``open_clip_train/train.py``'s ``train_one_epoch``): the task holds the model as
``trainable_module`` and the loss as ``loss``; with ``--accum-freq k`` the loop first runs the
model on each of k micro-batches under ``no_grad`` to cache their features, then, per
micro-batch j, runs the model again with gradients and calls ``backward()`` on the loss over all
k micro-batches (micro-batch j's fresh features, the others' cached ones): each backward's loss is
the whole step's loss, and their gradients add up to its gradient. Evaluation calls ``task(batch)``
under ``no_grad`` in eval mode."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainguard import Monitor
from trainguard.store import open_run


class Tower(nn.Module):
    def __init__(self, d_in: int, d: int):
        super().__init__()
        self.fc1 = nn.Linear(d_in, 32)
        self.bn = nn.BatchNorm1d(32)  # its output depends on train/eval mode (open_clip's towers: dropout)
        self.fc2 = nn.Linear(32, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.bn(self.fc1(x))))


class CLIP(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = Tower(24, 16)
        self.text = Tower(12, 16)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def forward(self, image, text):
        return {"image_features": F.normalize(self.visual(image), dim=-1),
                "text_features": F.normalize(self.text(text), dim=-1),
                "logit_scale": self.logit_scale.exp()}


class ClipLoss(nn.Module):
    def forward(self, image_features, text_features, logit_scale):
        logits = logit_scale * image_features @ text_features.T
        labels = torch.arange(logits.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


class CLIPTask(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.trainable_module = model
        self.loss = ClipLoss()

    def forward(self, batch):
        return self.loss(**self.trainable_module(**batch))


def train(path, accum: int, steps: int = 6, watch_task: bool = False):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 12, generator=g)

    def batch(n=16):
        img = torch.randn(n, 24, generator=g)
        return {"image": img, "text": img @ w + 0.1 * torch.randn(n, 12, generator=g)}

    task = CLIPTask(CLIP())
    opt = torch.optim.AdamW(task.trainable_module.parameters(), lr=1e-2)
    val = [batch() for _ in range(2)]
    losses, val_losses = [], []
    with Monitor(task if watch_task else None, path, every=2, diagnose=False):
        for step in range(steps):
            task.train()
            if accum == 1:
                loss = task(batch())
                opt.zero_grad()
                loss.backward()
                losses.append(loss.item())
            else:
                bs = [batch() for _ in range(accum)]
                with torch.no_grad():
                    cached = [task.trainable_module(**b) for b in bs]
                opt.zero_grad()
                for j, b in enumerate(bs):
                    out = task.trainable_module(**b)
                    feats = {k: torch.cat([c[k] for c in cached[:j]] + [out[k]] + [c[k] for c in cached[j + 1:]])
                             for k in ("image_features", "text_features")}
                    loss = task.loss(**feats, logit_scale=out["logit_scale"])
                    loss.backward()
                losses.append(loss.item())  # what open_clip logs: the loss over the k micro-batches
            opt.step()
            with torch.no_grad():
                task.trainable_module.logit_scale.clamp_(0, math.log(100))
            if step % 2 == 1:
                task.eval()
                with torch.no_grad():
                    val_losses.append(sum(task(b).item() for b in val) / len(val))
    return losses, val_losses


@pytest.mark.parametrize("accum", [1, 2, 3])
def test_cached_feature_accumulation_stores_the_loss_the_loop_logs(tmp_path, accum):
    # Before: with --accum-freq 2 the step's loss was the sum of its two backward losses, each the
    # whole step's loss: 13.89 at step 0 where open_clip logs 6.94.
    losses, _ = train(tmp_path / "r", accum)
    got = [v for _, v in open_run(tmp_path / "r").scalars("loss")["loss"]]
    assert got == pytest.approx(losses, rel=2e-5)


@pytest.mark.parametrize("accum,watch_task", [(1, False), (2, False), (2, True)])
def test_evaluation_through_the_task_is_seen_when_training_calls_its_inner_model(tmp_path, accum, watch_task):
    # Before: with --accum-freq 2 (training calls task.trainable_module, evaluation calls task)
    # the run had no val_loss at all.
    _, val_losses = train(tmp_path / "r", accum, watch_task=watch_task)
    with open_run(tmp_path / "r") as run:
        got = run.scalars("val_loss")["val_loss"]
        monitor = run.meta["monitor"]
    assert [s for s, _ in got] == [2, 4, 6]
    assert [v for _, v in got] == pytest.approx(val_losses, rel=1e-5)
    # the caching forwards (no_grad, train mode) are part of the training step, not an evaluation
    assert monitor["modes"]["eval_forwards_in_train"] == 0
    assert not monitor["validation"].get("leak")
