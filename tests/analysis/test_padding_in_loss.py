"""padding_in_loss: a token-level cross entropy whose most frequent target is the padding value of the
model's integer inputs, with no ignore_index for it (the padding is scored as a word to predict)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import trainguard
from trainguard import Monitor
from trainguard.analysis import diagnose

# bentrevett/pytorch-seq2seq's special tokens: ["<unk>", "<pad>", "<sos>", "<eos>"]
UNK, PAD, SOS, EOS, V = 0, 1, 2, 3, 30


class _Seq2Seq(nn.Module):
    """bentrevett/pytorch-seq2seq @ b3cd54c72cd6e4e63f672d334c795b4fe744ef92, 1 - Sequence to Sequence
    Learning with Neural Networks.ipynb, shortened: GRU encoder and decoder, sequences first ([T, B]),
    teacher forcing always."""

    def __init__(self, padding_idx=None):
        super().__init__()
        self.src_emb = nn.Embedding(V, 8, padding_idx=padding_idx)
        self.trg_emb = nn.Embedding(V, 8, padding_idx=padding_idx)
        self.enc = nn.GRU(8, 16)
        self.dec = nn.GRU(8, 16)
        self.fc_out = nn.Linear(16, V)

    def forward(self, src, trg):
        _, hidden = self.enc(self.src_emb(src))
        out, _ = self.dec(self.trg_emb(trg[:-1]), hidden)
        return self.fc_out(out)  # [T - 1, B, V]


def _batch(g, b=16, t=12):
    """Reversal pairs of 3-10 tokens, <sos> ... <eos>, padded with <pad> to the batch's longest."""
    src = torch.full((t, b), PAD)
    trg = torch.full((t, b), PAD)
    for i in range(b):
        n = int(torch.randint(3, t - 1, (1,), generator=g))
        x = torch.randint(4, V, (n,), generator=g)
        src[: n + 2, i] = torch.cat([torch.tensor([SOS]), x, torch.tensor([EOS])])
        trg[: n + 2, i] = torch.cat([torch.tensor([SOS]), x.flip(0), torch.tensor([EOS])])
    return src, trg


def _train(path, ignore_index: int | None, padding_idx=None):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = _Seq2Seq(padding_idx)
    criterion = nn.CrossEntropyLoss() if ignore_index is None else nn.CrossEntropyLoss(ignore_index=ignore_index)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Monitor(model, path, every=5) as mon:
        for _ in range(12):
            src, trg = _batch(g)
            output = model(src, trg)
            loss = criterion(output.reshape(-1, V), trg[1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss)
    return [f for f in diagnose(trainguard.open(path)) if f.kind == "padding_in_loss"]


def test_padding_scored_as_a_target_is_found_with_its_class_and_share(tmp_path):
    # Without ignore_index=TRG_PAD_IDX ~30% of the targets were <pad>, and the run was called healthy.
    [f] = _train(tmp_path / "r", ignore_index=None)
    assert f.severity == "warning"
    assert f.evidence["class"] == PAD and 0.2 < f.evidence["share"] < 0.6
    assert "ignore_index=1" in f.suggestion
    # an Embedding's padding_idx says the same without the inputs' tails
    [f] = _train(tmp_path / "p", ignore_index=None, padding_idx=PAD)
    assert f.evidence["class"] == PAD


def test_padding_ignored_by_the_loss_is_no_finding(tmp_path):
    assert _train(tmp_path / "r", ignore_index=PAD) == []


def test_a_frequent_real_class_is_no_padding(tmp_path):
    # A tagger (NER's "O": 80% of the tags, class 0) over inputs padded with 0, its padded positions
    # labelled -100 (ignored): the frequent class is a real one, not the padding.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, 8, padding_idx=0), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Monitor(model, tmp_path / "r", every=5) as mon:
        for _ in range(10):
            ids = torch.randint(1, V, (16, 10))
            tags = torch.where(torch.rand(16, 10) < 0.8, 0, torch.randint(1, 3, (16, 10)))
            for i, n in enumerate(torch.randint(4, 10, (16,)).tolist()):
                ids[i, n:], tags[i, n:] = 0, -100
            loss = F.cross_entropy(model(ids).reshape(-1, 3), tags.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss)
    assert "padding_in_loss" not in [f.kind for f in diagnose(trainguard.open(tmp_path / "r"))]
    # nor a segmentation's background class over float images (no integer inputs, no padding)
    model = nn.Conv2d(3, 4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Monitor(model, tmp_path / "s", every=5) as mon:
        for _ in range(10):
            x = torch.randn(4, 3, 8, 8)
            y = torch.where(torch.rand(4, 8, 8) < 0.7, 0, torch.randint(1, 4, (4, 8, 8)))
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss)
    assert "padding_in_loss" not in [f.kind for f in diagnose(trainguard.open(tmp_path / "s"))]
