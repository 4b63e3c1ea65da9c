"""Small training setups shared by the resilience tests."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainguard.resilience import CheckpointManager, TrainState


def make_state(*, seed: int = 0, width: int = 8, num_workers: int = 0, extra_layer: bool = False,
               stateful_loader: bool = False, prepare: Callable | None = None) -> TrainState:
    """A tiny regression model with dropout, Adam, a StepLR schedule and a shuffled loader;
    ``prepare(model, opt, sched, loader)`` returns them as a framework wraps them."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    layers = [torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Dropout(0.25), torch.nn.Linear(width, 1)]
    if extra_layer:
        layers.append(torch.nn.Linear(1, 1))
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(1234)  # the data itself does not depend on the global RNG
    data = TensorDataset(torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g))
    if stateful_loader:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(data, batch_size=8, shuffle=True, num_workers=num_workers)
    else:
        loader = DataLoader(data, batch_size=8, shuffle=True, num_workers=num_workers)
    if prepare is not None:
        model, opt, sched, loader = prepare(model, opt, sched, loader)
    return TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader)


def train_steps(state: TrainState, steps: int) -> list[float]:
    """Run ``steps`` steps, continuing the loader (and its epoch) where the state stands."""
    losses = []
    it = iter(state.loader)
    for _ in range(steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(state.loader)
            x, y = next(it)
        loss = torch.nn.functional.mse_loss(state.model(x), y)
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.scheduler.step()
        state.step += 1
        losses.append(loss.item())
    return losses


def assert_same_training_state(a: TrainState, b: TrainState) -> None:
    """Bitwise-equal parameters and optimizer state, equal scheduler state."""
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert ka == kb
        assert torch.equal(va, vb), f"parameter {ka} differs"
    oa, ob = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for pid in oa["state"]:
        for key, value in oa["state"][pid].items():
            assert torch.equal(value, ob["state"][pid][key]), f"optimizer state {pid}/{key} differs"
    assert a.scheduler.state_dict() == b.scheduler.state_dict()


@pytest.fixture
def state_factory() -> Callable[..., TrainState]:
    return make_state


@pytest.fixture
def ckpt_dir(tmp_path):
    return tmp_path / "checkpoints"


@pytest.fixture
def manager(ckpt_dir):
    m = CheckpointManager(ckpt_dir, keep=3)
    yield m
    m.close()


# -- the subprocess training script ------------------------------------------------------------

SCRIPT = Path(__file__).with_name("_train_script.py")


def script_command(ckpt: Path, out: Path, *args: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--ckpt", str(ckpt), "--out", str(out), *args]


def read_losses(out: Path) -> list[tuple[int, int, str]]:
    """(pid, step, loss as float.hex()) per logged step; a line cut by SIGKILL is dropped."""
    rows = []
    for line in (out / "losses.txt").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            rows.append((int(parts[0]), int(parts[1]), parts[2]))
    return rows


def read_final(out: Path) -> dict:
    return torch.load(out / "final.pt", weights_only=True)


def assert_same_final(a: dict, b: dict) -> None:
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), f"parameter {key} differs"
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    for pid, entry in a["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, b["optimizer"]["state"][pid][key]), f"optimizer {pid}/{key} differs"
    assert a["scheduler"] == b["scheduler"]


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> tuple[dict[int, str], dict]:
    """An uninterrupted run of the script: per-step losses and the final state."""
    root = tmp_path_factory.mktemp("reference")
    subprocess.run(script_command(root / "ckpt", root / "out"), check=True, timeout=120)
    rows = read_losses(root / "out")
    assert [s for _, s, _ in rows] == list(range(30))
    return {s: loss for _, s, loss in rows}, read_final(root / "out")
