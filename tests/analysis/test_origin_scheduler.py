"""A NaN validation metric that ReduceLROnPlateau reads: milesial/Pytorch-UNet (@21d7850) steps
``scheduler.step(val_score)`` on its dice score, and a dice without epsilon is 0/0 for an empty mask
the model also leaves empty. The report said the NaN "reached no loss, gradient or parameter by the
end of the recording: training never used it", while the scheduler counted each NaN as a step
without improvement and cut the learning rate after ``patience`` of them."""

from __future__ import annotations

import torch
from torch import nn

import trainguard as tg
from trainguard.analysis import origin
from trainguard.store import open_run


def _dice(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    inter = 2 * (pred * target).sum()
    return inter / (pred.sum() + target.sum())  # no epsilon: 0/0 on an empty mask predicted empty


def _loop(steps: int, nan_metric: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, "max", patience=1)
    for _ in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            mask = torch.zeros(8) if nan_metric else torch.ones(8)
            sched.step(_dice((model(torch.randn(8, 4)).squeeze(1) > 1e9).float(), mask))
    return opt


def test_a_nan_metric_read_by_reduce_lr_on_plateau_is_named(tmp_path, capsys):
    from trainguard.cli import main

    d = tmp_path / "r"
    with tg.record(d, buffer=-1):
        opt = _loop(4, nan_metric=True)
    assert opt.param_groups[0]["lr"] < 0.1  # the NaN metric did cut the learning rate
    o = origin(open_run(d))
    assert o.origin.op == "aten.div.Tensor" and o.reached_training is False
    assert o.scheduler["steps"] == 4 and o.scheduler["file"].endswith("test_origin_scheduler.py"), o.scheduler
    assert main(["report", str(d)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "training never used it" not in out, out
    assert "ReduceLROnPlateau" in out and "learning rate" in out, out


def _monitored(tmp_path, nan_metric: bool):
    d = tmp_path / ("nan" if nan_metric else "ok")
    with tg.record(d, buffer=-1), tg.Monitor(None, d, every=5) as mon:
        _loop(30, nan_metric=nan_metric)
    return d, mon.findings


def test_a_run_with_a_harmful_nan_metric_is_not_called_healthy(tmp_path, capsys):
    # The UNet run (dice without eps on an empty validation mask, read by ReduceLROnPlateau) got the
    # verdict "Training looks healthy" beside the report's harmful-NaN origin panel.
    from trainguard.analysis import diagnose
    from trainguard.cli import main

    _, ok = _monitored(tmp_path, nan_metric=False)
    assert [f.kind for f in ok] == ["healthy"], [(f.kind, f.title) for f in ok]
    d, findings = _monitored(tmp_path, nan_metric=True)
    for fs in (findings, diagnose(open_run(d))):
        kinds = [f.kind for f in fs]
        assert "healthy" not in kinds, [(f.kind, f.title) for f in fs]
        f = next(f for f in fs if f.kind == "harmful_nonfinite")
        assert f.severity == "warning" and "ReduceLROnPlateau" in f.title and "learning rate" in f.title, f.title
    main(["diagnose", str(d)])
    out = " ".join(capsys.readouterr().out.split())
    assert "looks healthy" not in out and "harmful_nonfinite" in out, out
