"""Gradient accumulation written by hand with a short window: huggingface/accelerate's
examples/nlp_example.py @ 16cb6eb8 divides each micro-batch's loss by ``gradient_accumulation_steps``
and steps on ``step % gradient_accumulation_steps == 0``, so its first window holds one micro-batch
(and an epoch's last one may hold fewer than k). The monitor sums a window's losses: step 0 read half
the others' loss, and diagnose called the healthy run ``lr_too_high`` ("the smoothed loss rose to
0.694 by step 10, from 0.347 at initialisation")."""

from __future__ import annotations

import torch
from torch import nn

import trainguard as tg
from trainguard.analysis import diagnose
from trainguard.store import open_run

K = 2


def _hand_accumulated(path, divide: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    x = torch.randn(256, 8)
    y = torch.randint(0, 2, (256,))  # random labels: the loss stays near ln 2, as on a small MRPC
    with tg.Monitor(model, path, every=1, diagnose=False):
        for epoch in range(3):
            for step in range(15):  # 15 micro-batches an epoch: windows of 1, 2, ..., 2
                i = (epoch * 15 + step) % 32 * 8
                loss = nn.functional.cross_entropy(model(x[i:i + 8]), y[i:i + 8])
                if divide:
                    loss = loss / K
                loss.backward()
                if step % K == 0:
                    opt.step()
                    opt.zero_grad()


def test_a_short_first_window_of_micro_batches_is_no_rise_of_the_loss(tmp_path):
    for divide in (True, False):
        d = tmp_path / str(divide)
        _hand_accumulated(d, divide)
        with open_run(d) as run:
            losses = dict(run.scalars()["loss"])
            findings = diagnose(run)
        assert losses[0] < 0.75 * losses[1]  # step 0 summed one micro-batch, the others two
        kinds = {f.kind for f in findings if f.severity in ("warning", "error")}
        assert "lr_too_high" not in kinds, [f.title for f in findings]
        if divide:  # averaged as it should be: nothing to say (an undivided sum is accumulation_not_averaged's)
            assert not kinds, [f.title for f in findings]
