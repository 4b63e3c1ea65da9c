"""Small models and loops shared by the capture tests."""

from __future__ import annotations

import pytest
import torch
from torch import nn


@pytest.fixture
def one_rank():
    """A process group of one gloo rank: collectives run for real, in this process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


@pytest.fixture
def nan_empty():
    """Every uninitialised float allocation holds NaN."""
    was_det = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        assert torch.isnan(torch.empty(4)).all()
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = was_fill
        torch.use_deterministic_algorithms(was_det, warn_only=was_warn)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.proj(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for block in self.encoder:
            x = block(x)
        return self.head(x)


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Net()


@pytest.fixture
def train():
    return train_steps


def train_steps(model, steps=2, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.randn(4, 6)
    y = torch.randint(0, 3, (4,))
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return loss


# The backend cross-check helper, importable by the tests of this folder under importlib mode.
import importlib.util as _ilu  # noqa: E402
import sys as _sys  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

_spec = _ilu.spec_from_file_location("tests_capture_crosscheck", _Path(__file__).with_name("crosscheck.py"))
_mod = _ilu.module_from_spec(_spec)
_sys.modules["tests_capture_crosscheck"] = _mod
_spec.loader.exec_module(_mod)
_spec = _ilu.spec_from_file_location("tests_capture_flowmodel", _Path(__file__).with_name("flowmodel.py"))
_mod = _ilu.module_from_spec(_spec)
_sys.modules["tests_capture_flowmodel"] = _mod
_spec.loader.exec_module(_mod)
