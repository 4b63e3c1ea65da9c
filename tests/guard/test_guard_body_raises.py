"""An exception raised by the loop body itself on a NaN batch: facebookresearch/detr's
``generalized_box_iou`` asserts ``(boxes1[:, 2:] >= boxes1[:, :2]).all()`` (util/box_ops.py), which a
corrupt image's NaN boxes fail, in the matcher, before any loss. The error left the ``for`` loop, so
no form of the guard could go on: the generator the loop body runs in cannot be resumed once the
body raised. ``with loop.guarded():`` around the body hands such an error to the guard: when the
step's batch held NaN/Inf itself (or the step's loss was already non-finite), the step is a bad step
(rewound, replayed under recording, its batch skipped) and training goes on; any other error is
raised unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import trainguard as tg

BAD = 17  # the corrupt image


def box_cxcywh_to_xyxy(x):
    """detr @ 29901c5, util/box_ops.py."""
    x_c, y_c, w, h = x.unbind(-1)
    return torch.stack([(x_c - 0.5 * w), (y_c - 0.5 * h), (x_c + 0.5 * w), (y_c + 0.5 * h)], dim=-1)


def generalized_box_iou(boxes1, boxes2):
    """detr @ 29901c5, util/box_ops.py, its early check kept (the GIoU itself shortened)."""
    assert (boxes1[:, 2:] >= boxes1[:, :2]).all()
    assert (boxes2[:, 2:] >= boxes2[:, :2]).all()
    lt = torch.max(boxes1[:, None, :2], boxes2[:, :2])
    rb = torch.min(boxes1[:, None, 2:], boxes2[:, 2:])
    return (rb - lt).clamp(min=0).prod(-1)


def _data(bad=BAD):
    torch.manual_seed(0)
    data = [(torch.randn(3, 4, 4), torch.tensor([0.5, 0.5, 0.2, 0.3])) for _ in range(40)]
    if bad is not None:
        data[bad][0][0, 1, 2] = float("nan")
    return data


def _train(tmp_path, data, *, guarded=True, wide=False, steps=12):
    """DETR's step in small: boxes from the image, the matcher's GIoU check, an L1 + GIoU loss."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = tg.TrainState(model=model, optimizer=opt, loader=DataLoader(data, batch_size=4))
    loop = tg.CheckpointManager(tmp_path / "ckpt", every_steps=100).resume(
        state, total_steps=steps, guard=tg.Guard(tmp_path / "run", snapshot_every=4))
    for _, (images, tgt) in loop.batches():
        with loop.guarded() if guarded else torch.enable_grad():
            boxes = model(images).sigmoid()
            if wide:  # a bug of the code: a box whose corners are swapped, on every batch
                boxes = boxes * torch.tensor([1.0, 1.0, -1.0, -1.0])
            giou = generalized_box_iou(box_cxcywh_to_xyxy(boxes), box_cxcywh_to_xyxy(tgt))
            loss = F.l1_loss(boxes, tgt) + (1 - torch.diag(giou)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return loop.guard, state


def test_an_assert_on_a_nan_batch_inside_guarded_is_a_skipped_batch(tmp_path):
    guard, state = _train(tmp_path, _data())
    assert state.step == 12
    [event] = guard.events
    assert event["action"] == "skip" and event["step"] == 4, event["message"]
    assert event["raised"]["error"].startswith("AssertionError at "), event["raised"]
    assert "test_guard_body_raises.py:" in event["raised"]["error"], event["raised"]
    assert event["batch_nonfinite"]["samples"] == [BAD], event.get("batch_nonfinite")
    assert BAD in event["skipped"][0]["samples"]
    assert all(bool(torch.isfinite(p).all()) for p in state.model.parameters())


def test_without_guarded_the_assert_still_ends_the_script(tmp_path):
    with pytest.raises(AssertionError):
        _train(tmp_path, _data(), guarded=False)


def test_an_error_of_the_code_on_finite_data_is_raised_unchanged(tmp_path):
    with pytest.raises(AssertionError) as info:
        _train(tmp_path, _data(bad=None), wide=True)
    assert info.traceback[-1].name == "generalized_box_iou"  # its own traceback, from the assert
