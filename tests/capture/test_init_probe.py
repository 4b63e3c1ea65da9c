"""A model that runs itself in its own ``__init__`` (ultralytics' stride probe): which modules the
monitor takes for models, and the names the recorder gives its layers."""

from __future__ import annotations

import copy

import torch
from torch import nn

import trainguard
from trainguard import Monitor
from trainguard.store import open_run


class _Conv(nn.Module):
    """ultralytics.nn.modules.Conv: a convolution, batch norm and SiLU."""

    def __init__(self, c1: int, c2: int, s: int = 2):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, 3, s, 1, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class _DetectionModel(nn.Module):
    """ultralytics' DetectionModel (ultralytics/nn/tasks.py), cut down: its layers in
    ``self.model``, run one by one by its forward; its ``__init__`` works out the strides with a
    forward of a zero image through ``self.forward(x)``, gradients on, so each layer is called with
    no module call around it."""

    def __init__(self, depth: int = 0):
        super().__init__()
        more = [_Conv(16, 16, 1) for _ in range(depth)]  # yolov8n has 23 layers, 17 with parameters
        self.model = nn.Sequential(_Conv(3, 8), _Conv(8, 16), *more, nn.Conv2d(16, 6, 1))
        self.model.eval()
        out = self.forward(torch.zeros(1, 3, 32, 32))
        self.model.train()
        self.stride = 32 // out.shape[-1]

    def forward(self, x):
        for m in self.model:
            x = m(x)
        return x


def test_layers_called_by_a_model_probing_itself_in_its_init_are_not_models(tmp_path):
    # YOLO("yolov8n.yaml").train(...) under `trainguard run --monitor`: YOLO() builds a
    # DetectionModel, the trainer builds a second one and trains it, an EMA copy validates. Each
    # construction's stride probe made every layer a model of its own: 34 roots (model.0 ...
    # model.22 of the first model, conv., c2f2. ... of the second), 21 "model model.N is not
    # trained" findings, and the trained model's layers named detectionmodel.model.0.conv where
    # its state_dict says model.0.conv.
    torch.manual_seed(0)
    _DetectionModel()  # YOLO("yolov8n.yaml"): built, never trained
    with Monitor(None, tmp_path / "r", every=1) as mon:
        _DetectionModel()  # a second model built while watched, also never trained
        model = _DetectionModel()  # the trainer's
        ema = copy.deepcopy(model).eval().requires_grad_(False)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        for step in range(3):
            x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(step))
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.mul_(0.9).add_(p, alpha=0.1)
                ema(x)  # the validator runs the EMA copy
        assert {"model.0.conv", "model.0.bn", "model.1.conv", "model.2"} <= set(mon.layers)
    run = open_run(tmp_path / "r")
    roots = run.meta["monitor"]["roots"]
    # the EMA copy is named by the loop's variable, beside the trained model of the same type
    assert [(r["prefix"], r["type"]) for r in roots] == [("", "_DetectionModel"), ("ema.", "_DetectionModel")]
    assert "model.0.conv.weight" in run.layers()
    [untrained] = [f for f in mon.findings if f.kind == "model_not_trained"]
    assert untrained.evidence["model"] == "ema"


def test_the_recorder_names_the_layers_of_a_model_probed_in_its_init_by_their_path(tmp_path):
    # `trainguard run` on YOLO("yolov8n.yaml").train(...): the forward convolutions of every
    # training step ran in modules named "conv", "cv1.conv", "m.0.cv1.conv", "cv2.0.0.conv"
    # (model.0.conv, model.2.cv1.conv, ... model.22.cv2.0.0.conv): each layer the probes called with
    # no module around it was named by a scan of the live objects for its holder, and after 16
    # such scans (the first model's 17 layers with parameters) by nothing.
    torch.manual_seed(0)
    with trainguard.record(tmp_path / "r", mode="no_tensor", buffer=-1):
        _DetectionModel(depth=8)  # YOLO("yolov8n.yaml"): built, never trained
        model = _DetectionModel(depth=8)  # the trainer's
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(2):
            x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    convs = open_run(tmp_path / "r").executions(phase="forward", op="convolution")
    trained = [e["module"] for e in convs if e["step"] == 1]
    assert trained == ["model.0.conv", "model.1.conv", *(f"model.{i}.conv" for i in range(2, 10)), "model.10"]
