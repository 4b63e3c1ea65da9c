"""Causes over symptoms in what a user reads: the terminal findings, ``--json`` and the report."""

from __future__ import annotations

import io
import json

from rich.console import Console

from trainguard.analysis import build_report
from trainguard.analysis._causes import explain
from trainguard.cli._findings_view import findings_json, render_findings
from trainguard.store import Finding, acquire_writer, open_run, release_writer


def findings():
    fs = [
        Finding(kind="loss_not_decreasing", severity="warning", title="Loss is not decreasing: 1.61 -> 1.6",
                source="monitor"),
        Finding(kind="lr_too_low", severity="warning", title="Learning rate too low: 1e-07 of their norm",
                suggestion="raise the learning rate", evidence={"update_ratio_median": 1e-7}, source="monitor"),
        Finding(kind="params_frozen", severity="info", title="frozen", source="monitor"),
    ]
    explain(fs)
    return fs


def test_terminal_shows_the_cause_first_and_the_symptom_under_it():
    buf = io.StringIO()
    render_findings(Console(file=buf, width=200, color_system=None), findings())
    text = buf.getvalue()
    assert text.index("lr_too_low") < text.index("explains:") < text.index("↳ loss_not_decreasing")
    assert text.count("loss_not_decreasing") == 2  # under the cause, and in its own title's "explained by"
    assert "INFO  loss_not_decreasing" not in text  # not listed again as a finding of its own


def test_json_nests_the_symptom_under_its_cause():
    data = findings_json(findings())
    assert [f["kind"] for f in data["findings"]] == ["lr_too_low", "params_frozen"]
    cause = data["findings"][0]
    assert cause["evidence"]["explains"] == ["loss_not_decreasing"]
    assert [s["kind"] for s in cause["symptoms"]] == ["loss_not_decreasing"]
    assert cause["symptoms"][0]["severity"] == "info"
    assert data["verdict"] == "warning" and data["counts"]["warning"] == 1
    json.dumps(data)
    # a folded list reads back: rendering it again shows the same thing
    buf = io.StringIO()
    render_findings(Console(file=buf, width=200, color_system=None), data["findings"])
    assert "↳ loss_not_decreasing" in buf.getvalue()


def test_report_folds_the_stored_findings(tmp_path):
    w = acquire_writer(tmp_path / "r")
    w.add_scalars(0, {"loss": 1.0})
    w.add_findings("monitor", [f.to_dict() for f in findings()])
    release_writer(w)
    with open_run(tmp_path / "r") as run:
        report = build_report(run, findings=run.findings())
    kinds = [f["kind"] for f in report["findings"]]
    assert "loss_not_decreasing" not in kinds and "lr_too_low" in kinds
    cause = next(f for f in report["findings"] if f["kind"] == "lr_too_low")
    assert [s["kind"] for s in cause["symptoms"]] == ["loss_not_decreasing"]
