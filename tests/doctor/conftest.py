"""Fixtures of the doctor tests: small models and data, and a fingerprint of everything a check
must leave as it found it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

FEATURES = 20
CLASSES = 10


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread; two threads spin against the other tests' processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_blobs(n: int, seed: int, classes: int = CLASSES, features: int = FEATURES):
    centres = torch.randn(classes, features, generator=torch.Generator().manual_seed(1234)) * 1.5
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = centres[y] + torch.randn(n, features, generator=g)
    return x, y


def make_mlp(seed: int = 0, hidden: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, CLASSES))


@pytest.fixture
def blobs():
    return make_blobs(2048, seed=1)


@pytest.fixture
def batch(blobs):
    x, y = blobs
    return x[:32], y[:32]


@pytest.fixture
def batches(blobs):
    x, y = blobs
    return [(x[i:i + 64], y[i:i + 64]) for i in range(0, len(x), 64)]


@pytest.fixture
def mlp():
    return make_mlp()


class Busy(nn.Module):
    """Every kind of state a check could disturb: batch-norm buffers, dropout, a frozen
    parameter, a custom buffer, a submodule left in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(32, CLASSES)
        self.scale = nn.Parameter(torch.ones(1), requires_grad=False)
        self.register_buffer("offset", torch.zeros(CLASSES))

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x))))) * self.scale + self.offset


@pytest.fixture
def busy(blobs):
    """A model mid-training: gradients present, Adam state, mixed train/eval modes, set RNGs."""
    torch.manual_seed(0)
    model = Busy()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x, y = blobs
    for i in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[i * 16:(i + 1) * 16]), y[i * 16:(i + 1) * 16]).backward()
        opt.step()
    model.bn.eval()  # a module the user left in eval mode
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    return model, opt


def fingerprint(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict:
    """Everything observable about the state: values, identities, storages, dtypes, modes, RNGs."""
    params = [
        (n, id(p), p.data_ptr(), p.dtype, p.device, p.requires_grad, p.detach().clone(),
         None if p.grad is None else (id(p.grad), p.grad.layout, p.grad.to_dense().clone()))
        for n, p in model.named_parameters()
    ]
    buffers = [(n, id(b), b.dtype, b.clone()) for n, b in model.named_buffers()]
    opt_state = None
    if opt is not None:
        sd = opt.state_dict()
        opt_state = ({k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()}
                      for k, v in sd["state"].items()}, [dict(g) for g in sd["param_groups"]])
    return {
        "params": params,
        "buffers": buffers,
        "modes": [(n, m.training) for n, m in model.named_modules()],
        "opt": opt_state,
        "torch_rng": torch.get_rng_state().clone(),
        "numpy_rng": np.random.get_state()[1].copy(),
        "python_rng": random.getstate(),
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
    }


def _equal(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def assert_same_state(before: dict, after: dict) -> None:
    for key in before:
        assert _equal(before[key], after[key]), f"{key} changed"


@pytest.fixture
def same_state():
    return assert_same_state


@pytest.fixture
def state_of():
    return fingerprint


@pytest.fixture
def new_mlp():
    return make_mlp


@pytest.fixture
def new_blobs():
    return make_blobs


class DINOLoss(nn.Module):
    """facebookresearch/dino (main_dino.py, DINOLoss) for two views: the cross-entropy of the
    student's softmax against the teacher's centred and sharpened one, whose center is a buffer
    the loss moves towards the batch's teacher mean (an EMA, reassigned) on every call."""

    def __init__(self, out_dim: int) -> None:
        super().__init__()
        self.register_buffer("center", torch.zeros(1, out_dim))

    def forward(self, student_output, teacher_output):
        q = torch.softmax((teacher_output - self.center) / 0.04, dim=-1)
        loss = torch.sum(-q * torch.log_softmax(student_output / 0.1, dim=-1), dim=-1).mean()
        with torch.no_grad():
            self.center = self.center * 0.9 + teacher_output.mean(0, keepdim=True) * 0.1
        return loss


@pytest.fixture
def dino():
    """A student, its batch (inputs, the teacher's outputs) and a fresh DINOLoss."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(20, 32), nn.GELU(), nn.Linear(32, 16))
    x = torch.randn(16, 20)
    teacher_output = torch.randn(16, 16) + 3.0  # far from the initial center: each call moves it
    return student, (x, teacher_output), DINOLoss(16)


@pytest.fixture
def qat_model():
    """``make(channels, side, classes)``: a small CNN prepared for eager-mode quantization-aware
    training as PyTorch's QAT tutorial prepares it (QuantStub/DeQuantStub,
    get_default_qat_qconfig("x86"), prepare_qat), for inputs of shape [N, 1, side, side]."""
    import torch.ao.quantization as tq

    def make(channels: int, side: int, classes: int) -> nn.Module:
        model = nn.Sequential(tq.QuantStub(), nn.Conv2d(1, channels, 3), nn.Flatten(),
                              nn.Linear(channels * (side - 2) ** 2, classes), tq.DeQuantStub()).train()
        model.qconfig = tq.get_default_qat_qconfig("x86")
        return tq.prepare_qat(model, inplace=True)

    return make


class TeacherForcedDecoder(nn.Module):
    """bentrevett/pytorch-seq2seq legacy/4's Seq2Seq.forward (@ b3cd54c) cut down to a GRU decoder:
    at each target step ``random.random() < teacher_forcing_ratio`` (Python's generator) decides
    whether the next input is the true token or the model's own argmax."""

    def __init__(self, vocab: int = 12, teacher_forcing_ratio: float = 0.5):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, 8)
        self.rnn = nn.GRUCell(8, 16)
        self.out = nn.Linear(16, vocab)
        self.teacher_forcing_ratio = teacher_forcing_ratio

    def forward(self, trg):  # [batch, trg len]
        hidden = torch.zeros(trg.shape[0], 16, dtype=self.out.weight.dtype)
        inp, outputs = trg[:, 0], []
        for t in range(1, trg.shape[1]):
            hidden = self.rnn(self.emb(inp), hidden)
            outputs.append(self.out(hidden))
            teacher_force = random.random() < self.teacher_forcing_ratio
            inp = trg[:, t] if teacher_force else outputs[-1].argmax(1)
        return torch.stack(outputs, 1)  # [batch, trg len - 1, vocab]


@pytest.fixture
def teacher_forcing():
    """The decoder, a batch of token sequences (the targets are the sequences shifted) and its loss."""
    trg = torch.randint(1, 12, (6, 7), generator=torch.Generator().manual_seed(0))
    return (TeacherForcedDecoder(), (trg, trg[:, 1:]),
            lambda out, y: nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)))
