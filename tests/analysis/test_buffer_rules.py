"""Buffers that should move as a model trains but never do (analysis/_buffer_rules.py, from the
monitor's per-buffer ``changed`` fact, capture/_monitor_buffers.py)."""

from __future__ import annotations

import math

import torch
from torch import nn

import trainguard as tg


class _MoCo(nn.Module):
    """facebookresearch/moco @ 132aea9 moco/builder.py in small: a query encoder, a momentum key
    encoder, a queue of negatives and its pointer (buffers). ``enqueue``/``advance`` False leave out
    the call of ``_dequeue_and_enqueue`` / the line that moves ``queue_ptr``."""

    def __init__(self, enqueue=True, advance=True, dim=16, K=64, m=0.99, T=0.07):
        super().__init__()
        self.enqueue, self.advance, self.K, self.m, self.T = enqueue, advance, K, m, T
        self.encoder_q = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, dim))
        self.encoder_k = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, dim))
        for pq, pk in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            pk.data.copy_(pq.data)
            pk.requires_grad = False
        self.register_buffer("queue", torch.randn(dim, K))
        self.queue = nn.functional.normalize(self.queue, dim=0)
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))
        # constant by design: a position table and a mask
        angle = torch.arange(8.0)[:, None] / 10000 ** (torch.arange(0, 8, 2) / 8)
        self.register_buffer("pe", torch.stack([angle.sin(), angle.cos()], -1).reshape(8, 8))
        self.register_buffer("mask", torch.ones(8, dtype=torch.bool))

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        ptr = int(self.queue_ptr)
        self.queue[:, ptr:ptr + keys.shape[0]] = keys.T
        if self.advance:
            self.queue_ptr[0] = (ptr + keys.shape[0]) % self.K

    def forward(self, im_q, im_k):
        q = nn.functional.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            for pq, pk in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
                pk.data = pk.data * self.m + pq.data * (1.0 - self.m)
            k = nn.functional.normalize(self.encoder_k(im_k), dim=1)
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1) / self.T
        if self.enqueue:
            self._dequeue_and_enqueue(k)
        return logits, torch.zeros(logits.shape[0], dtype=torch.long)


def _train(path, **kw):
    torch.manual_seed(0)
    model = _MoCo(**kw)
    opt = torch.optim.SGD(model.encoder_q.parameters(), 0.03, momentum=0.9)
    protos = torch.randn(32, 32)
    with tg.Monitor(model, path, every=5) as mon:
        for _ in range(30):
            base = protos[torch.randint(0, 32, (16,))]
            logits, labels = model(base + 0.5 * torch.randn(16, 32), base + 0.5 * torch.randn(16, 32))
            loss = nn.functional.cross_entropy(logits, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return mon.findings


def _buffers(findings):
    return [f for f in findings if f.kind == "buffer_not_updated"]


def test_a_queue_never_enqueued_is_found(tmp_path):
    # _dequeue_and_enqueue never called: the negatives stay the random vectors the queue started
    # with, the task is easy and the loss falls: the run was called healthy.
    fs = _buffers(_train(tmp_path / "r", enqueue=False))
    assert len(fs) == 1, fs
    f = fs[0]
    assert f.severity == "warning"
    assert f.evidence["buffer"] == "queue_ptr" and f.evidence["module_type"] == "_MoCo", f.evidence
    assert f.evidence["recordings"] == 5 and f.evidence["unchanged_too"] == ["queue"], f.evidence
    assert "pe" not in f.evidence["unchanged_too"] and "mask" not in str(f.evidence)
    assert "never written" in f.suggestion and "queue" in f.suggestion, f.suggestion


def test_a_queue_pointer_never_advanced_is_found(tmp_path):
    # queue_ptr never moved: every batch of keys overwrites the same 16 of the 64 columns
    fs = _buffers(_train(tmp_path / "r", advance=False))
    assert len(fs) == 1, fs
    f = fs[0]
    assert f.evidence["buffer"] == "queue_ptr" and f.evidence["changing"] == ["queue"], f.evidence
    assert "same place" in f.suggestion, f.suggestion


def test_a_working_queue_and_constant_tables_are_no_finding(tmp_path):
    fs = _train(tmp_path / "r")
    assert _buffers(fs) == [], fs
    assert not [f for f in fs if f.severity in ("warning", "error", "critical")], [(f.kind, f.title) for f in fs]


def test_buffers_of_a_model_in_eval_mode_are_not_judged(tmp_path):
    # a frozen model run in eval mode keeps its counters still, by design
    torch.manual_seed(0)
    frozen = _MoCo(enqueue=False).eval().requires_grad_(False)
    head = nn.Linear(16, 4)
    opt = torch.optim.SGD(head.parameters(), 0.1)
    with tg.Monitor({"frozen": frozen, "head": head}, tmp_path / "r", every=5) as mon:
        for _ in range(25):
            x = torch.randn(16, 32)
            with torch.no_grad():
                feats = frozen.encoder_q(x)
            loss = nn.functional.cross_entropy(head(feats), torch.randint(0, 4, (16,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert _buffers(mon.findings) == []
    assert math.isfinite(loss.item())
