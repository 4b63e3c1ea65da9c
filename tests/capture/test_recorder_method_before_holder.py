"""A model whose method ran ops before a holder ran it is named in that holder afterwards.

Derived from mlfoundations/open_clip: ``CLIP`` holds ``logit_scale`` as a parameter of its own and
re-initialises its weights in ``init_parameters()``; ``CLIPTask`` holds it as ``trainable_module``
and runs it in every training step. A script that calls ``model.init_parameters()`` (or any method
running tensor ops on the model) after building it and before the task runs it had the recorder
name the model at the top level then ("" for CLIP, ``visual.fc`` for its layers) for the rest of
the run, where the monitor, and the recorder without that call, say ``trainable_module.visual.fc``:
one non-finite finding named its layers in the monitor's names and its origin in the other."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainguard
from trainguard.store import open_run


class CLIP(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = nn.Sequential(nn.Linear(6, 8))
        self.text = nn.Sequential(nn.Linear(5, 8))
        self.logit_scale = nn.Parameter(torch.ones([]))
        self.init_parameters()

    def init_parameters(self):
        nn.init.normal_(self.visual[0].weight, std=0.02)
        with torch.no_grad():
            self.logit_scale.fill_(math.log(1 / 0.07))

    def forward(self, image, text):
        return F.normalize(self.visual(image), dim=-1), F.normalize(self.text(text), dim=-1), self.logit_scale.exp()


class CLIPTask(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.trainable_module = model

    def forward(self, image, text):
        a, b, s = self.trainable_module(image, text)
        logits = s * a @ b.T
        labels = torch.arange(len(logits))
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


@pytest.mark.parametrize("reinit", [False, True])
def test_a_method_run_before_the_holder_does_not_fix_the_models_names(tmp_path, reinit):
    torch.manual_seed(0)
    with trainguard.record(tmp_path / "r", buffer=-1):
        model = CLIP()
        if reinit:
            model.init_parameters()  # ops in a method of the model, no module call around them
        task = CLIPTask(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            loss = task(torch.randn(4, 6), torch.randn(4, 5))
            opt.zero_grad()
            loss.backward()
            opt.step()
    with open_run(tmp_path / "r") as run:
        forward = {e["module"] for e in run.executions(phase="forward", step=1)}
    # Before: with the re-initialisation, {"", "visual.0", "text.0", "<task>"} instead
    assert {"trainable_module", "trainable_module.visual.0", "trainable_module.text.0"} <= forward, forward
    assert not {"visual.0", "text.0"} & forward, forward
