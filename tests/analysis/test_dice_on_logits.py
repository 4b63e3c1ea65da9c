"""dice_not_probabilities: a soft dice loss computed over values outside [0, 1] (logits)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import trainguard
from trainguard import Monitor
from trainguard.analysis import diagnose


# milesial/Pytorch-UNet @ 21d7850f2af30a9695bbeea75f3136aa538cfc4a, utils/dice_score.py
def dice_coeff(input, target, reduce_batch_first=False, epsilon=1e-6):
    sum_dim = (-1, -2) if input.dim() == 2 or not reduce_batch_first else (-1, -2, -3)
    inter = 2 * (input * target).sum(dim=sum_dim)
    sets_sum = input.sum(dim=sum_dim) + target.sum(dim=sum_dim)
    sets_sum = torch.where(sets_sum == 0, inter, sets_sum)
    dice = (inter + epsilon) / (sets_sum + epsilon)
    return dice.mean()


def dice_loss(input, target):
    return 1 - dice_coeff(input.flatten(0, 1), target.flatten(0, 1), reduce_batch_first=True)


def _train(path, probabilities: bool):
    # train.py's loss: cross_entropy + dice_loss(F.softmax(masks_pred, dim=1), one_hot(true_masks))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Monitor(model, path, every=5) as mon:
        for _ in range(8):
            x = torch.randn(4, 3, 8, 8)
            y = (x[:, 0] > 0).long()
            masks_pred = model(x)
            pred = F.softmax(masks_pred, dim=1) if probabilities else masks_pred
            loss = F.cross_entropy(masks_pred, y)
            loss = loss + dice_loss(pred.float(), F.one_hot(y, 2).permute(0, 3, 1, 2).float())
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss)
    return [f for f in diagnose(trainguard.open(path)) if f.kind == "dice_not_probabilities"]


def test_a_dice_loss_on_logits_is_named(tmp_path):
    # milesial/Pytorch-UNet with F.softmax left out of the dice loss: called healthy (and its up4.up a
    # collapsed codebook); the soft dice of unbounded values is no overlap of masks.
    [f] = _train(tmp_path / "r", probabilities=False)
    assert f.severity == "warning" and "softmax" in f.suggestion
    assert f.evidence["made_by"] == "convolution"
    assert _train(tmp_path / "ok", probabilities=True) == []
