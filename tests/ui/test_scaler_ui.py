"""The alerts pane of a recorded fp16 run whose GradScaler settled: no alert, one quiet line for
the gradients the scaler discarded (the report says the same; tests/analysis/test_scaler_handled.py)."""

from __future__ import annotations

from amp_models import fp16_loop, mlp

import trainguard


def test_browser_alerts_pane_of_a_settling_scaler(page, live_server, tmp_path):
    root = tmp_path / "logs"
    with trainguard.record(root / "amp", mode="full_health", buffer=100_000):
        skipped = fp16_loop(mlp(), 12)
    n = sum(skipped)
    assert n >= 3
    with live_server(root) as srv:
        page.goto(f"{srv.url}/#/run/amp/debugger")
        page.wait_for_selector("body[data-ready=debugger]")
        pane = page.inner_text(".p-alerts")
        assert "No harmful NaN or Inf." in pane
        assert page.locator("#alert-nonfinite").count() == 0
        line = page.inner_text(".p-alerts .scaler")
        assert f"of {n} steps a GradScaler skipped (steps 0-{n - 1}" in line and "never reached the weights" in line
        page.goto("about:blank")  # leave the app before its server stops
