"""fp16 with a GradScaler, recorded: the Inf/NaN gradients of the steps the scaler skipped are
routine (discarded with the update) and counted apart; the alerts, the origin and the report
speak of harmful values the program kept. Found as a user would: a recorded fp16 run whose scale
only settled showed "92 harmful NaN/Inf events" and an origin in step 0 while the monitor said
"routine"."""

from __future__ import annotations

import json

import torch
from amp_models import NAN_LINE, fp16_loop, mlp
from torch import nn

import trainguard
from trainguard.analysis import build_report, origin
from trainguard.cli import main
from trainguard.store import open_run


def test_a_settling_scalers_overflows_are_not_alerts(tmp_path, capsys):
    with trainguard.record(tmp_path / "r", mode="full_health", buffer=100_000):
        skipped = fp16_loop(mlp(), 20)
    n = sum(skipped)
    assert n >= 3 and not any(skipped[n:]), skipped  # the scale settles in the first steps
    with open_run(tmp_path / "r") as run:
        assert run.scaler_skipped() == [(0, n - 1)]
        alerts = run.alerts()
        assert alerts["total"] == 0 and alerts["first_seq"] is None, alerts
        sc = alerts["scaler"]
        assert sc["skipped_steps"] == n and sc["events"] > 0 and sc["first_seq"] is not None
        assert run.first_harm() is None and origin(run) is None
        # the values are still in the run, for whoever asks for them
        first = run.first_harm(handled=True)
        assert first is not None and run.execution(first["seq"])["step"] < n
        assert [s["scaler_skipped"] for s in run.steps()][: n + 1] == [True] * n + [False]
        report = build_report(run)
    assert report["origin"] is None and f"of {n} steps a GradScaler skipped (steps 0-{n - 1}" in report["scaler"]
    assert main(["report", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "No harmful NaN or Inf." in out and "GradScaler" in out
    assert main(["report", "--json", str(tmp_path / "r")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["alerts"]["scaler"]["events"] == sc["events"]


def test_a_nan_loss_in_a_skipped_step_stays_harmful(tmp_path):
    # The scaler skips this step too, but the NaN was made in the forward pass and is the loss the
    # program used: an alert whose origin is its line.
    with trainguard.record(tmp_path / "r", mode="full_health", buffer=100_000):
        skipped = fp16_loop(mlp(), 8, init_scale=2.0**8, nan_loss_at=5)
    assert skipped[5] and not any(skipped[:5])
    with open_run(tmp_path / "r") as run:
        assert run.scaler_skipped() == [(5, 5)]
        alerts = run.alerts()
        assert alerts["total"] > 0
        o = origin(run)
        assert o is not None and o.origin.step == 5 and o.origin.phase == "forward"
        assert o.origin.line == NAN_LINE, o.origin


def test_without_a_verdict_nothing_changes(tmp_path):
    # The same overflowing gradients without a scaler's verdict (a run recorded before this, or a
    # hand-written loss scale): harmful, as the rule says.
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainguard.record(tmp_path / "r", mode="full_health", buffer=100_000):
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(torch.randn(64, 8)), torch.zeros(64, dtype=torch.long))
            (loss * 2.0**24).backward()
    with open_run(tmp_path / "r") as run:
        assert run.scaler_skipped() == []
        assert run.alerts()["total"] > 0 and "scaler" not in run.alerts()
        assert run.first_harm() is not None
