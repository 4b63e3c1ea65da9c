"""A NaN whose loss the loop checked and skipped (normflows' notebook loop: ``if ~(torch.isnan(loss)
| torch.isinf(loss)): loss.backward()``): before, ``trainguard report`` said it "reached no loss,
gradient or parameter by the end of the recording: training never used it", when it made the
loss NaN and the program checked that loss and skipped the step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.analysis import origin
from trainguard.store import open_run


def _skip_loop(iters: int, nan_at: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for it in range(iters):
        x = torch.randn(16, 2)
        if it == nan_at:
            x[3, 0] = float("nan")
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        if ~(torch.isnan(loss) | torch.isinf(loss)):
            opt.zero_grad()
            loss.backward()
            opt.step()


@pytest.mark.parametrize("backend", ["native", "python"])
def test_a_nan_whose_loss_the_loop_skipped_says_so(tmp_path, capsys, backend):
    from trainguard.cli import main

    d = tmp_path / "r"
    with tg.record(d, buffer=-1, backend=backend):
        _skip_loop(8, nan_at=4)
    run = open_run(d)
    assert run.meta["skipped_iterations"]["count"] == 1 and run.meta["skipped_iterations"]["steps"] == [4]
    o = origin(run)
    assert o.origin.step == 4 and o.reached_training is False
    assert o.skipped["step"] == 4 and o.skipped["check"] in ("isnan", "isinf")
    assert "which the program checked" in o.summary
    assert main(["report", str(d)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "training never used it" not in out, out
    assert "then: it made the loss nan in step 4; the program checked it" in out, out
    assert "skipped that iteration" in out


def _exit_loop(iters: int, nan_at: int) -> None:
    # facebookresearch/mae engine_pretrain.py @ efb2a80: `loss_value = loss.item(); if not
    # math.isfinite(loss_value): print(...); sys.exit(1)` before the backward
    import math
    import sys

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for it in range(iters):
        x = torch.randn(16, 2)
        mask = torch.zeros(16) if it == nan_at else torch.ones(16)  # mask_ratio 0: no patch to average over
        loss = (((model(x) - x.sum(1, keepdim=True)) ** 2).mean(1) * mask).sum() / mask.sum()
        loss_value = loss.item()  # READ
        if not math.isfinite(loss_value):
            sys.exit(1)
        opt.zero_grad()
        loss.backward()
        opt.step()


READ_LINE = next(i for i, line in enumerate(open(__file__), 1) if line.rstrip().endswith("# READ"))


def test_a_nan_loss_the_program_read_and_stopped_on_is_not_called_unused(tmp_path, capsys):
    # MAE with --mask_ratio 0.0: (loss * mask).sum() / mask.sum() is 0/0 in step 0, the loop reads it with
    # .item() and exits. The report said "it reached no loss, gradient or parameter by the end of the
    # recording: training never used it".
    from trainguard.cli import main

    d = tmp_path / "r"
    with pytest.raises(SystemExit):
        with tg.record(d, buffer=-1):
            _exit_loop(8, nan_at=3)
    o = origin(open_run(d))
    assert o.origin.step == 3 and o.origin.op == "aten.div.Tensor" and o.reached_training is False
    assert o.read["line"] == READ_LINE and o.read["step"] == 3, o.read
    assert main(["report", str(d)]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())  # the panel's wrapped lines
    assert "training never used it" not in out, out
    assert "then: the program read it (" in out, out
    assert f"test_origin_skipped.py:{READ_LINE}) in step 3 and exited with code 1" in out, out
