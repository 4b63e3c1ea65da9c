"""An object that keeps training state in plain attributes and has no ``state_dict()``:
Time-Series-Library's ``EarlyStopping`` (utils/tools.py: ``counter``, ``best_score``, ``early_stop``,
``val_loss_min``). Left out of the TrainState it resets silently on resume: the resumed run starts
its patience over and trains epochs the uninterrupted run never trained. The TrainState now holds
such an object (its attributes are plain numbers, saved as JSON, never pickled), and the loop names
one left out, at the first save, once its attributes have changed."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg
from tests.ts_models import DLinear


class EarlyStopping:
    """thuml/Time-Series-Library @ 4e938a1, utils/tools.py, as it is (its prints dropped)."""

    def __init__(self, patience=7, verbose=False, delta=0):
        self.patience = patience
        self.verbose = verbose
        self.counter = 0
        self.best_score = None
        self.early_stop = False
        self.val_loss_min = np.inf
        self.delta = delta

    def __call__(self, val_loss, model, path):
        score = -val_loss
        if self.best_score is None:
            self.best_score = score
            self.save_checkpoint(val_loss, model, path)
        elif score < self.best_score + self.delta:
            self.counter += 1
            if self.counter >= self.patience:
                self.early_stop = True
        else:
            self.best_score = score
            self.save_checkpoint(val_loss, model, path)
            self.counter = 0

    def save_checkpoint(self, val_loss, model, path):
        torch.save(model.state_dict(), path + '/' + 'checkpoint.pth')
        self.val_loss_min = val_loss


def _windows(seed, n=48):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n + 32, dtype=torch.float32)
    series = torch.sin(t / 3)[:, None] + 0.5 * torch.randn(n + 32, 1, generator=g)
    x = torch.stack([series[i:i + 24] for i in range(n)])
    return x, torch.stack([series[i + 24:i + 32] for i in range(n)])


def _train(tmp_path, ckpt, *, hold, crash_at=None, epochs=12):
    """exp_long_term_forecasting.train in small: an epoch of MSE training, vali() on another
    stretch of the series, early_stopping(vali_loss, ...) and a break on early_stop."""
    torch.manual_seed(0)
    model = DLinear()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    x, y = _windows(1)
    vx, vy = _windows(2)
    early_stopping = EarlyStopping(patience=2)
    state = tg.TrainState(model=model, optimizer=opt, loader=DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True))
    if hold:
        state.early_stopping = early_stopping
    losses = []
    for epoch in tg.CheckpointManager(ckpt, keep=20).resume(state, epochs=epochs):
        if epoch == crash_at:
            raise RuntimeError("killed")
        for bx, by in state.loader:
            opt.zero_grad()
            F.mse_loss(model(bx), by).backward()
            opt.step()
        with torch.no_grad():
            vali_loss = np.average([F.mse_loss(model(vx[i:i + 8]), vy[i:i + 8]).item() for i in range(0, 48, 8)])
        losses.append(float(vali_loss))
        early_stopping(vali_loss, model, str(tmp_path))
        if early_stopping.early_stop:
            break
    return losses, early_stopping, model


def test_early_stopping_in_the_state_resumes_as_the_uninterrupted_run(tmp_path):
    expected, stopper, model = _train(tmp_path, tmp_path / "ref", hold=True)
    assert stopper.early_stop and 3 <= len(expected) < 12, expected  # it stops early, after a few epochs
    crash = len(expected) - 1  # killed after the epoch whose save holds a counter above 0
    with pytest.raises(RuntimeError, match="killed"):
        _train(tmp_path, tmp_path / "ck", hold=True, crash_at=crash)
    tail, resumed, resumed_model = _train(tmp_path, tmp_path / "ck", hold=True)
    assert tail == expected[crash:], (expected, tail)
    assert vars(resumed) == vars(stopper)
    assert type(resumed.best_score) is type(stopper.best_score)  # numpy's float64 comes back as one
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)


def test_early_stopping_left_out_is_named_at_the_first_save(tmp_path):
    with pytest.warns(UserWarning, match=r"early_stopping \(EarlyStopping\) .*(counter|best_score)") as seen:
        _train(tmp_path, tmp_path / "ck", hold=False, epochs=2)
    [w] = [w for w in seen if "early_stopping" in str(w.message)]
    assert "TrainState(..., early_stopping=early_stopping)" in str(w.message), str(w.message)
    assert w.filename == __file__  # the line that started the loop


def test_an_unchanged_plain_object_is_not_named(tmp_path):
    class Config:  # a namespace of settings (argparse's args) never moves
        def __init__(self):
            self.lr, self.epochs = 0.05, 2

    args = Config()  # noqa: F841 - a local the loop reads
    state = tg.TrainState(model=DLinear(), loader=DataLoader(TensorDataset(*_windows(1)), batch_size=8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in tg.CheckpointManager(tmp_path / "ck").resume(state, epochs=2):
            for _batch in state.loader:
                pass
