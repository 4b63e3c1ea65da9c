"""The loss rules on recorded runs: what the origin of a NaN says about the loss before it."""

from __future__ import annotations

import torch
from torch import nn

import trainguard as tg


def test_a_nan_written_into_a_batch_after_noisy_losses_is_no_divergence(tmp_path):
    # YOLO("yolov8n.yaml").train() on 32 synthetic images with a NaN pixel written into the 6th
    # batch: the recorder traced it to that line ("the code wrote this value"), but the per-batch
    # detection loss, healthy and noisy (1.33, 5.9, 1.29, 11.5, 16.3: the number of boxes in each
    # mosaic), made lr_too_high an ERROR ("the loss grew 12.2x before turning NaN/Inf") and the
    # nonfinite_loss fix "lower the learning rate from 0.01 to about 0.001". The scales below are
    # those losses' ratios to the first.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scales = [1.0, 4.4, 0.97, 8.6, 12.2, 1.0]
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in scales]
    with tg.record(tmp_path / "r"), tg.Monitor(model, tmp_path / "r", every=1) as mon:
        for step, ((x, y), scale) in enumerate(zip(batches, scales)):
            if step == 5:
                x[0, 3] = float("nan")  # a corrupt sample
            loss = scale * nn.functional.mse_loss(model(x), y) / 1.1
            opt.zero_grad()
            loss.backward()
            opt.step()
    kinds = {f.kind: f for f in mon.findings}
    nonfinite = kinds["nonfinite_loss"]
    assert nonfinite.evidence["origin"]["op"] == "aten.lift_fresh", nonfinite.evidence["origin"]
    assert "lr_too_high" not in kinds, kinds["lr_too_high"].title
    assert "loss_grew" not in nonfinite.evidence and "learning rate" not in nonfinite.suggestion, nonfinite.suggestion
