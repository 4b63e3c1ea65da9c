"""A teacher's soft targets that collapse to one class (DINO without centering): the student copies
them and the loss falls, so no loss rule sees it (analysis/_collapse_rules.py ``target_collapse``,
from the monitor's ``soft_target`` entropies, capture/_loss_watch.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import trainguard as tg


# facebookresearch/dino @ 7c446df5: vision_transformer.py's DINOHead (an MLP, l2-normalised, a
# weight-normed last layer with its g fixed at 1) on a small MLP backbone in place of the ViT, and
# main_dino.py's DINOLoss (teacher temperature 0.04, student 0.1, centering 0.9) with the teacher
# updated by EMA under no_grad.
class _Head(nn.Module):
    def __init__(self, in_dim=64, out_dim=64, hidden=64, bottleneck=32):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, bottleneck))
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        self.last_layer = nn.utils.parametrizations.weight_norm(nn.Linear(bottleneck, out_dim, bias=False))
        self.last_layer.parametrizations.weight.original0.data.fill_(1)
        self.last_layer.parametrizations.weight.original0.requires_grad = False

    def forward(self, x):
        return self.last_layer(F.normalize(self.mlp(x), dim=-1))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))
        self.head = _Head()

    def forward(self, x):
        return self.head(self.backbone(x))


class _DINOLoss(nn.Module):
    def __init__(self, out_dim=64, centering=True, teacher_temp=0.04, student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.centering, self.teacher_temp, self.student_temp = centering, teacher_temp, student_temp
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(1, out_dim))

    def forward(self, student_output, teacher_output):
        student_out = (student_output / self.student_temp).chunk(2)
        t = teacher_output - self.center if self.centering else teacher_output
        teacher_out = F.softmax(t / self.teacher_temp, dim=-1).detach().chunk(2)
        total, n = 0, 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v != iq:
                    total += torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1).mean()
                    n += 1
        total /= n
        if self.centering:
            with torch.no_grad():
                batch_center = teacher_output.sum(0, keepdim=True) / len(teacher_output)
                self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)
        return total


def _train(path, centering, steps=160, lr=3e-3):
    torch.manual_seed(0)
    student, teacher = _Net(), _Net()
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    dino_loss = _DINOLoss(centering=centering)
    opt = torch.optim.AdamW(student.parameters(), lr=lr)
    protos = torch.randn(32, 32)
    with tg.Monitor({"student": student, "teacher": teacher}, path, every=10) as mon:
        for _ in range(steps):
            base = protos[torch.randint(0, 32, (32,))]
            images = torch.cat([base + 0.3 * torch.randn(32, 32) for _ in range(2)])
            loss = dino_loss(student(images), teacher(images))
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for ps, pt in zip(student.parameters(), teacher.parameters()):
                    pt.mul_(0.996).add_(0.004 * ps.detach())
    return mon.findings


def test_soft_targets_collapsed_onto_one_class_are_found_though_the_loss_falls(tmp_path):
    # without centering the sharpened teacher puts every image on the same output: the loss fell
    # 2.2 -> 0.2 and the run was called healthy
    fs = _train(tmp_path / "r", centering=False)
    [f] = [f for f in fs if f.kind == "target_collapse"]
    assert f.severity == "warning", f
    ev = f.evidence
    assert ev["classes"] == 64 and ev["kind"] == "one_class", ev
    assert ev["mean_target_perplexity"] < 3 < ev["initial_mean_target_perplexity"], ev
    assert ev["chance"] == math.log(64), ev
    assert "center" in f.suggestion and "backward" in f.suggestion, f.suggestion
    assert "file" in ev["backward_at"] and ev["backward_at"]["line"] > 0, ev
    assert "healthy" not in [g.kind for g in fs]


def test_centered_soft_targets_are_no_collapse(tmp_path):
    fs = _train(tmp_path / "r", centering=True)
    assert [f for f in fs if f.kind == "target_collapse"] == []
    assert not [f for f in fs if f.severity in ("warning", "error", "critical")], [(f.kind, f.title) for f in fs]
