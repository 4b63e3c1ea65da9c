"""A regression loss whose targets lie outside the range its prediction can reach: DETR's sigmoid
box head against boxes in pixels (capture/_loss_watch.py's ``regression`` facts, analysis
``targets_out_of_range``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import trainguard as tg


class _MLP(nn.Module):
    """facebookresearch/detr @ 29901c5 models/detr.py's MLP (the box head, bbox_embed)."""

    def __init__(self, input_dim, hidden_dim, output_dim, num_layers):
        super().__init__()
        self.num_layers = num_layers
        h = [hidden_dim] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(n, k) for n, k in zip([input_dim] + h, h + [output_dim]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x)) if i < self.num_layers - 1 else layer(x)
        return x


class _DETR(nn.Module):
    """DETR's heads on query features from a small MLP in place of the backbone and transformer:
    class logits and sigmoid boxes (cx, cy, w, h) per query."""

    def __init__(self, queries=8, hidden=32, classes=5):
        super().__init__()
        self.queries, self.hidden = queries, hidden
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, queries * hidden))
        self.class_embed = nn.Linear(hidden, classes + 1)
        self.bbox_embed = _MLP(hidden, hidden, 4, 3)

    def forward(self, x):
        hs = self.body(x).view(x.shape[0], self.queries, self.hidden)
        return {"pred_logits": self.class_embed(hs), "pred_boxes": self.bbox_embed(hs).sigmoid()}


def _train(path, scale):
    """SetCriterion's loss_labels + loss_boxes (L1 part), with query i matched to box i (the Hungarian
    matcher left out); ``scale``: 1 for boxes normalised by the image size, as DETR expects, 640 for
    boxes in pixels of a 640-pixel image."""
    torch.manual_seed(0)
    model = _DETR()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tg.Monitor(model, path, every=5) as mon:
        for _ in range(30):
            x = torch.randn(8, 16)
            boxes = torch.rand(8, 3, 4) * 0.5 + 0.25  # 3 objects per image, normalised cxcywh
            labels = torch.randint(0, 5, (8, 3))
            out = model(x)
            idx = (torch.arange(8).repeat_interleave(3), torch.arange(3).repeat(8))
            target_classes = torch.full((8, 8), 5)
            target_classes[idx] = labels.reshape(-1)
            loss_ce = F.cross_entropy(out["pred_logits"].transpose(1, 2), target_classes)
            src_boxes = out["pred_boxes"][idx]
            target_boxes = (boxes * scale).reshape(-1, 4)
            loss_bbox = F.l1_loss(src_boxes, target_boxes, reduction="none").sum() / 24
            loss = loss_ce + 5 * loss_bbox
            opt.zero_grad()
            loss.backward()
            opt.step()
    return mon.findings


def test_box_targets_in_pixels_beside_a_sigmoid_head_are_found(tmp_path):
    fs = _train(tmp_path / "r", scale=640)
    [f] = [f for f in fs if f.kind == "targets_out_of_range"]
    assert f.severity == "error", f
    ev = f.evidence
    assert ev["loss"] == "l1_loss" and ev["bounded_by"] == "sigmoid" and ev["reach"] == [0.0, 1.0], ev
    assert 300 < ev["target_max_at_least"] < 640, ev
    assert ev["backward_at"]["line"] > 0, ev
    assert "normalis" in f.suggestion and "sigmoid" in f.suggestion, f.suggestion


def test_normalised_box_targets_are_no_finding(tmp_path):
    fs = _train(tmp_path / "r", scale=1)
    assert [f for f in fs if f.kind == "targets_out_of_range"] == []
    assert not [f for f in fs if f.severity in ("error", "critical")], [(f.kind, f.title) for f in fs]


def test_mse_targets_outside_a_tanh_are_found(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1), nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), 0.01)
    with tg.Monitor(model, tmp_path / "r", every=5) as mon:
        for _ in range(25):
            x = torch.randn(32, 4)
            loss = F.mse_loss(model(x), 10 + 5 * x[:, :1])
            opt.zero_grad()
            loss.backward()
            opt.step()
    [f] = [f for f in mon.findings if f.kind == "targets_out_of_range"]
    assert f.evidence["bounded_by"] == "tanh" and f.evidence["reach"] == [-1.0, 1.0], f.evidence
