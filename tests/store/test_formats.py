"""Run format 3 (taint per execution, harmful counts) and the runs older versions wrote."""

from __future__ import annotations

import sqlite3

import torch

import trainguard as tg
from trainguard.analysis import origin
from trainguard.store import SCHEMA_VERSION, RunWriter, open_run


def _as_format_2(d) -> None:
    """Rewrite a run as trainguard's format 2 left it: no taint, no harmful counts."""
    con = sqlite3.connect(d / "run.sqlite")
    con.execute("DROP INDEX executions_harmful")
    con.execute("ALTER TABLE executions DROP COLUMN taint")
    con.execute("ALTER TABLE executions DROP COLUMN origin")
    con.execute("DROP TABLE harmful")
    con.execute("DELETE FROM meta WHERE key IN ('first_harm', 'harm_counts', 'intended')")
    con.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    con.commit()
    con.close()


def _record(d) -> None:
    with tg.record(d, buffer=-1):
        mask = torch.zeros(4).masked_fill(torch.tensor([True, False, False, False]), -float("inf"))
        torch.softmax(mask, 0)  # intended: absorbed
        zeros = torch.softmax(torch.tensor([0.0, 200.0]), 0)
        (torch.log(zeros) * 0).sum()  # log(0) = -inf, 0 * -inf = NaN: harmful


def test_format_3_stores_taint_and_counts(tmp_path):
    _record(tmp_path / "r")
    run = open_run(tmp_path / "r")
    assert SCHEMA_VERSION == 3 and run.meta["schema_version"] == 3 and run.tainted
    assert [e["taint"] for e in run.executions(op="masked_fill")] == ["pending"]
    assert [e["taint"] for e in run.executions(health="harmful")] == ["harmful"] * 3  # log, mul, sum
    first = run.first_harm()
    assert first["reason"] == "nan" and run.execution(first["seq"])["op"] == "aten.mul.Tensor"
    assert run.execution(first["origin"])["op"] == "aten.log"
    assert run.count(health="pending") == 1 and run.alerts()["total"] == 3


def test_a_format_2_run_reads_as_before_and_upgrades_when_appended_to(tmp_path):
    d = tmp_path / "r"
    _record(d)
    _as_format_2(d)
    run = open_run(d)
    assert not run.tainted
    # as format 2 meant it: every non-finite execution is harmful, the first one is the origin
    alerts = run.alerts()
    assert alerts["total"] == 4 and alerts["by_op"][0]["op"] == "aten.masked_fill.Scalar"
    assert run.executions(health="harmful")[0]["taint"] == "harmful"
    assert origin(run).origin.op == "aten.masked_fill.Scalar"
    run.close()
    # appending (doctor results, a second recording) upgrades the format and keeps that meaning
    RunWriter(d, append=True).close()
    run = open_run(d)
    assert run.meta["schema_version"] == 3 and run.tainted
    assert run.alerts()["total"] == 4
    assert {e["op"] for e in run.executions(health="harmful")} == {
        "aten.masked_fill.Scalar", "aten.log", "aten.mul.Tensor", "aten.sum"}


def _rec(seq, taint=0, origin=None, health=0):
    summary = (1.0, 0.0, 0.0, 0.0, 1.0 if health else 0.0, 0.0, 0.0)
    return (seq, 0, "forward", "aten.exp.default", None, None, None, health, (("op", seq - 1),) if seq else (),
            (("float32", (1,), "cpu"),), (summary,), taint, origin)


def test_a_value_that_turns_harmful_later_is_pinned_and_updated(tmp_path):
    """The recorder sends a pending record, then (much later, in a batch of its own) pins it and
    sends it again as harmful: the circular buffer keeps it, with its new taint."""
    from trainguard.store import ExecBatch

    w = RunWriter(tmp_path / "r", mode="full_health", buffer=5)
    w.put_executions(ExecBatch([_rec(s, 2, 3, 4) if s == 3 else _rec(s) for s in range(50)], pins=[]))
    w.flush()
    w.put_executions(ExecBatch([], pins=[3, 2], resend=[_rec(3, 3, 3, 4)]), must_keep=True)
    w.put_executions(ExecBatch([_rec(s) for s in range(50, 100)], pins=[]))
    w.close()
    run = open_run(tmp_path / "r")
    assert [e["seq"] for e in run.executions()] == [2, 3, 95, 96, 97, 98, 99]
    assert run.execution(3)["taint"] == "harmful" and run.execution(3)["origin"] == 3
    assert run.execution(2)["taint"] == "finite"
