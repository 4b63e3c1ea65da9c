"""lr_range_test: the sweep, the divergence stop, the suggestion rule, CSV, plot and progress."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest
import torch
from rich.console import Console
from torch import nn

from trainguard import doctor
from trainguard.doctor._lr_range import gaussian_smooth, suggest
from trainguard.store import dumps


def linear_problem(seed: int, batch_size: int = 64):
    """Least squares with whitened inputs: the MSE's Hessian is 2I (curvature lambda = 2), so plain
    SGD diverges above 2/lambda = 1, and for the default sweep (ratio r = 1e8 ** (1/99) per step)
    the loss falls fastest per decade at (r - 1) / (2 lambda) = 0.051 (docs/doctor.md)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8192, 10, generator=g)
    y = x @ torch.randn(10, 1, generator=g) + 0.1 * torch.randn(8192, 1, generator=g)
    torch.manual_seed(seed)
    return nn.Linear(10, 1), [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, 8192, batch_size)]


# The documented band: within 3x of the predicted 0.051 either way.
BAND = (0.017, 0.15)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_suggestion_on_known_problem_lands_in_the_documented_band(seed):
    model, data = linear_problem(seed)
    r = doctor.lr_range_test(model, data, nn.MSELoss(), lambda p: torch.optim.SGD(p, lr=0.0))
    assert r.passed
    assert BAND[0] <= r.suggestion <= BAND[1], r.suggestion
    # Everything past the divergence point 2/lambda = 1 is where the sweep stops.
    assert r.diverged and 1.0 < r.lrs[-1] < 10
    assert r.suggestion < r.min_loss_lr < 2.0


def test_the_sweep_is_exponential_from_start(mlp, batches):
    r = doctor.lr_range_test(mlp, batches, nn.CrossEntropyLoss(), start=1e-6, end=1.0, steps=20, diverge=1e9)
    expected = 1e-6 * (1e6) ** (np.arange(20) / 19)
    assert np.allclose(r.lrs[: len(r.lrs)], expected[: len(r.lrs)])
    assert r.start == 1e-6 and r.end == 1.0


def test_stops_on_a_non_finite_loss():
    model, data = linear_problem(0)
    r = doctor.lr_range_test(model, data, nn.MSELoss(), lambda p: torch.optim.SGD(p, lr=0.0), end=1e12,
                             diverge=float("inf"))
    assert r.diverged and "non-finite" in r.stop_reason
    assert not np.isfinite(r.losses[-1])
    assert len(r.lrs) < 100
    assert r.suggestion is not None  # found from the finite part of the curve


def test_stops_when_the_smoothed_loss_diverges(mlp, batches):
    r = doctor.lr_range_test(mlp, batches, nn.CrossEntropyLoss(), end=100.0)
    assert r.diverged and "4x its best" in r.stop_reason
    assert len(r.lrs) < 100


def test_smoothing_keeps_the_curve_centred():
    """A step in the loss stays where it is (a running average would move it right)."""
    step = np.r_[np.full(50, 2.0), np.full(50, 1.0)]
    smooth = gaussian_smooth(step, 3.0)
    assert smooth[49] == pytest.approx(1.5, abs=0.1) and smooth[50] == pytest.approx(1.5, abs=0.1)
    noisy = step + np.random.default_rng(0).normal(0, 0.2, 100)
    assert np.std(np.diff(gaussian_smooth(noisy, 3.0))) < 0.3 * np.std(np.diff(noisy))


def test_suggest_picks_the_steepest_point_before_the_minimum():
    lrs = 10.0 ** np.linspace(-6, 0, 61)
    # a sigmoid drop centred at 1e-3, then a rise after 1e-1
    loss = 2 - 1 / (1 + np.exp(-(np.log10(lrs) + 3) * 3)) + np.where(lrs > 0.1, (np.log10(lrs) + 1) * 5, 0)
    i, i_min, why = suggest(lrs, loss)
    assert lrs[i] == pytest.approx(1e-3, rel=0.3) and why == ""
    assert lrs[i_min] == pytest.approx(0.1, rel=0.3)


def test_no_suggestion_when_the_loss_never_falls(mlp, batches):
    def constant(out, y):
        return (out * 0).sum() + 1.0

    r = doctor.lr_range_test(mlp, batches, constant, steps=20)
    assert r.suggestion is None and not r.passed
    assert r.why_none == "the smoothed loss never fell"
    assert r.verdict == "warn"
    assert [f.kind for f in r.findings()] == ["lr_range_no_suggestion"]


def test_csv_has_every_step(mlp, batches, tmp_path):
    r = doctor.lr_range_test(mlp, batches, nn.CrossEntropyLoss(), steps=30)
    path = tmp_path / "lr.csv"
    text = r.to_csv(path)
    assert path.read_text() == text
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [float(row["lr"]) for row in rows] == r.lrs
    assert [float(row["loss"]) for row in rows] == r.losses
    assert list(rows[0]) == ["step", "lr", "loss", "smoothed_loss"]


def test_plot_is_a_png_with_a_log_axis_and_the_suggestion_marked(mlp, batches, tmp_path):
    from matplotlib.image import imread

    r = doctor.lr_range_test(mlp, batches, nn.CrossEntropyLoss())
    path = tmp_path / "lr.png"
    r.plot(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = imread(path)
    assert pixels.shape[:2] == (504, 840)
    assert pixels[..., :3].std() > 0.05  # not a blank canvas
    ax = r.figure().axes[0]
    assert ax.get_xscale() == "log"
    marked = [line for line in ax.get_lines() if line.get_label().startswith("suggested lr")]
    assert marked and marked[0].get_xdata()[0] == r.suggestion


def test_progress_bar_only_with_a_console(mlp, batches, capsys):
    doctor.lr_range_test(mlp, batches, nn.CrossEntropyLoss(), steps=10)
    assert capsys.readouterr().out == ""
    buf = io.StringIO()
    doctor.lr_range_test(mlp, batches, nn.CrossEntropyLoss(), steps=10, console=Console(file=buf, width=100))
    assert "LR range test" in buf.getvalue() and "10/10" in buf.getvalue()


def test_accepts_a_loader_and_a_single_batch(mlp, blobs, batch):
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(*blobs), batch_size=128)
    assert len(doctor.lr_range_test(mlp, loader, nn.CrossEntropyLoss(), steps=30).lrs) <= 30
    assert len(doctor.lr_range_test(mlp, batch, nn.CrossEntropyLoss(), steps=10).lrs) <= 10


def test_result_serialises(mlp, batches):
    r = doctor.lr_range_test(mlp, batches, nn.CrossEntropyLoss(), steps=20)
    d = json.loads(dumps(r.to_dict()))
    assert d["check"] == "lr_range_test" and len(d["lrs"]) == len(r.lrs)
    Console(file=io.StringIO()).print(r)


@pytest.mark.parametrize("kwargs, match", [
    (dict(start=1.0, end=0.1), "greater than start"),
    (dict(steps=3), "at least 5"),
    (dict(start=0), "start"),
    (dict(smooth=-1), "smooth"),
    (dict(diverge=1.0), "diverge"),
    (dict(data=[]), "no batches"),
    (dict(data=iter([])), "re-iterable"),
    (dict(data=5), "iterable"),
    (dict(data=[(torch.zeros(4, 20), torch.zeros(3, dtype=torch.long))]), "4 samples but targets have 3"),
    (dict(optimizer_factory=lambda p: "adam"), "torch.optim.Optimizer"),
])
def test_bad_inputs_are_value_errors(kwargs, match, mlp, batches):
    args = dict(model=mlp, data=batches, loss_fn=nn.CrossEntropyLoss(), steps=10)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        doctor.lr_range_test(**args)


def test_a_batch_holding_inf_is_named_not_called_a_divergence():
    # huggingface/trl trl/trainer/reward_trainer.py's loss, -logsigmoid(r_chosen - r_rejected - margin),
    # on batches whose dataset margin column holds one inf (batch 4): the loss is inf at the 5th step,
    # at lr 2.1e-7, whatever the rate. The sweep said "diverged at lr 2.1e-07" and told to widen it.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 6, generator=g)  # a pair per sample: chosen, rejected
    margin = torch.full((64,), 0.5)
    margin[37] = float("inf")
    data = [(x[i:i + 8], margin[i:i + 8]) for i in range(0, 64, 8)]
    torch.manual_seed(0)
    head = nn.Linear(6, 1)

    def loss_fn(rewards, margin):
        return -nn.functional.logsigmoid(rewards[:, 0, 0] - rewards[:, 1, 0] - margin).mean()

    r = doctor.lr_range_test(head, data, loss_fn)
    assert len(r.lrs) == 5 and not np.isfinite(r.losses[-1])
    assert not r.diverged and "diverged" not in r.summary, r.summary
    assert "batch 4" in r.stop_reason and "targets" in r.stop_reason, r.stop_reason
    (f,) = r.findings()
    assert "validate_data" in f.suggestion and "widen the sweep" not in f.suggestion, f.suggestion


class _RecordingSGD(torch.optim.SGD):
    def __init__(self, groups):
        super().__init__(groups, lr=0.0)
        self.seen = []

    def step(self, closure=None):
        self.seen.append([g["lr"] for g in self.param_groups])
        return super().step(closure)


def test_parameter_groups_keep_the_ratios_of_their_rates():
    """karpathy/nanochat@92d63d4 nanochat/gpt.py setup_optimizer: one optimizer, groups at their own
    rates (embedding 0.69, lm_head 0.014, matrices 0.02, scalars 0.005 for width 64). The sweep set
    every group to the same rate, a setup nanochat never trains with, and suggested one rate (0.0148)
    without saying for which group."""
    model, data = linear_problem(0)
    made = []

    def factory(params):
        made.append(_RecordingSGD([{"params": [model.weight], "lr": 0.02}, {"params": [model.bias], "lr": 0.5}]))
        return made[0]

    r = doctor.lr_range_test(model, data, nn.MSELoss(), factory)
    assert all(abs(b / a - 25) < 1e-9 for a, b in made[0].seen), made[0].seen[:3]
    assert [a for a, _ in made[0].seen] == pytest.approx(r.lrs[:len(made[0].seen)])
    assert r.group_scales == [1.0, 25.0]
    assert r.suggestion is not None, r.summary
    assert f"group 1 at lr={r.suggestion * 25:.3g}" in r.findings()[0].suggestion, r.findings()[0].suggestion
