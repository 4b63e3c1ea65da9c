"""CTC loss fed something else than log-probabilities over its classes.

``nn.CTCLoss`` / ``F.ctc_loss`` take ``log_probs`` of shape ``[T, N, C]``: ``log_softmax`` over the
classes, the last dimension. meijieru/crnn.pytorch trained with warp-ctc, which takes raw
activations; its forks that moved to ``torch.nn.CTCLoss`` had to add ``F.log_softmax(output, dim=2)``
(Holmeyoung/crnn-pytorch, models/crnn.py: "add log_softmax to converge output"). Without it (raw
scores), with ``softmax`` instead, or with ``log_softmax`` over the batch dimension, the loss trains
to nothing: on Holmeyoung's CRNN the monitor called the softmax run healthy (its loss went from
-0.32 to -0.67, which -log p of a target never is), the raw one "loss rose instead of decreasing"
with a fix about shuffling targets, and the wrong dimension only dead units.

The model is that CRNN shrunk: a conv over the image's columns, a BiLSTM over them, a linear layer
to the classes, time first.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainguard as tg
from trainguard.analysis import diagnose
from trainguard.store import open_run

KINDS = ("ctc_loss_on_logits", "ctc_loss_on_probabilities", "ctc_log_softmax_wrong_dim")


class _CRNN(nn.Module):
    def __init__(self, head: str) -> None:
        super().__init__()
        self.head = head
        self.conv = nn.Conv1d(4, 8, kernel_size=3, stride=2, padding=1)
        self.rnn = nn.LSTM(8, 8, bidirectional=True)
        self.embedding = nn.Linear(16, 6)

    def forward(self, x):  # [N, 4, W] -> [W // 2, N, 6]
        seq = torch.relu(self.conv(x)).permute(2, 0, 1)
        out = self.embedding(self.rnn(seq)[0])
        if self.head == "log_softmax":
            return F.log_softmax(out, dim=2)
        if self.head == "softmax":
            return F.softmax(out, dim=2)
        if self.head == "log_softmax_dim1":
            return F.log_softmax(out, dim=1)
        return out  # raw scores, as warp-ctc took them


def _train(head: str, steps: int = 6) -> None:
    torch.manual_seed(0)
    model = _CRNN(head)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    criterion = nn.CTCLoss()
    for _ in range(steps):
        x = torch.randn(5, 4, 16)
        text = torch.randint(1, 6, (5, 3))
        length = torch.tensor([3, 2, 3, 1, 2])
        preds = model(x)
        preds_size = torch.full((5,), preds.size(0), dtype=torch.long)
        cost = criterion(preds, text, preds_size, length) / 5  # train.py divides by the batch again
        opt.zero_grad()
        cost.backward()
        opt.step()


def _misuse(findings):
    return [f for f in findings if f.kind in KINDS and f.is_problem]


@pytest.mark.parametrize(("head", "kind"), [("raw", "ctc_loss_on_logits"), ("softmax", "ctc_loss_on_probabilities"),
                                            ("log_softmax_dim1", "ctc_log_softmax_wrong_dim")])
def test_the_monitor_names_what_ctc_loss_was_fed(tmp_path, head, kind):
    with tg.Monitor(None, tmp_path / "mon", every=2) as mon:
        _train(head)
    got = _misuse(mon.findings)
    assert [f.kind for f in got] == [kind], [(f.kind, f.title) for f in mon.findings]
    f = got[0]
    assert f.severity == "warning" and f.evidence["source"] == "autograd graph"
    assert "log_softmax" in f.suggestion and "dim=2" in f.suggestion, f.suggestion
    assert "ctc_loss" in f.title, f.title


@pytest.mark.parametrize(("head", "kind"), [("raw", "ctc_loss_on_logits"), ("softmax", "ctc_loss_on_probabilities")])
def test_a_recording_names_what_ctc_loss_was_fed_with_its_line(tmp_path, head, kind):
    with tg.record(tmp_path / "rec"):
        _train(head)
    with open_run(tmp_path / "rec") as run:
        got = _misuse(diagnose(run))
    assert [f.kind for f in got] == [kind], got
    chain = got[0].evidence["chain"]
    assert chain[-1]["op"] == "ctc_loss" and chain[-1]["file"].endswith("test_ctc_loss_rules.py"), chain


def test_log_softmax_over_the_classes_is_no_misuse(tmp_path):
    with tg.Monitor(None, tmp_path / "mon", every=2) as mon:
        _train("log_softmax")
    assert not _misuse(mon.findings), [(f.kind, f.title) for f in mon.findings]
    with tg.record(tmp_path / "rec"):
        _train("log_softmax")
    with open_run(tmp_path / "rec") as run:
        assert not _misuse(diagnose(run))


def _train_zero_infinity(too_long: int, steps: int = 4) -> None:
    torch.manual_seed(0)
    model = _CRNN("log_softmax")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    criterion = nn.CTCLoss(zero_infinity=True)  # Holmeyoung's params.dealwith_lossnan = True
    for _ in range(steps):
        x = torch.randn(5, 4, 16)
        text = torch.randint(1, 6, (5, 10))
        length = torch.tensor([3, 2, 3, 1, 2])
        length[:too_long] = 10  # 10 labels for 8 frames: no alignment fits
        preds = model(x)
        preds_size = torch.full((5,), preds.size(0), dtype=torch.long)
        cost = criterion(preds, text, preds_size, length) / 5
        opt.zero_grad()
        cost.backward()
        opt.step()


def test_zero_infinity_dropping_samples_is_said(tmp_path):
    # Holmeyoung's CRNN with dealwith_lossnan = True (zero_infinity) and labels up to 30 characters for
    # its 26 frames: about a quarter of the samples added 0 to the loss and the gradient, and the
    # monitor called the run healthy.
    with tg.Monitor(None, tmp_path / "mon", every=2) as mon:
        _train_zero_infinity(too_long=2)
    got = [f for f in mon.findings if f.kind == "ctc_targets_zeroed"]
    assert len(got) == 1 and got[0].severity == "warning", [(f.kind, f.title) for f in mon.findings]
    f = got[0]
    assert "6 of 15" in f.title and "zero_infinity" in f.title, f.title
    assert "frames" in f.suggestion, f.suggestion
    assert not [g for g in mon.findings if g.kind == "healthy"]


def test_zero_infinity_with_every_target_aligned_says_nothing(tmp_path):
    with tg.Monitor(None, tmp_path / "mon", every=2) as mon:
        _train_zero_infinity(too_long=0)
    assert not [f for f in mon.findings if f.kind == "ctc_targets_zeroed"]
