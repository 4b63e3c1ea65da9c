"""Damaged rows (a garbage summary blob, garbage outputs JSON, garbage stack frames) are skipped and
counted, never a traceback."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest
import torch

import trainguard as tg
from trainguard.store import open_run


@pytest.fixture
def damaged_run(tmp_path):
    run = tmp_path / "run"
    with tg.record(run, buffer=-1, mode="full_health"):
        for _ in range(10):
            (torch.ones(8) * 2).exp().log()
    con = sqlite3.connect(run / "run.sqlite")
    seqs = [r[0] for r in con.execute("SELECT seq FROM executions ORDER BY seq")]
    con.execute("UPDATE executions SET summary = X'010203' WHERE seq = ?", (seqs[1],))
    con.execute("UPDATE executions SET outputs = '{not json' WHERE seq = ?", (seqs[2],))
    con.execute("UPDATE executions SET outputs = '[1, 2]' WHERE seq = ?", (seqs[3],))
    stack = con.execute("SELECT stack_id FROM executions WHERE seq = ?", (seqs[4],)).fetchone()[0]
    con.execute("UPDATE stacks SET frames = 'garbage' WHERE id = ?", (stack,))
    con.commit()
    con.close()
    return run, seqs


def test_the_reader_skips_and_counts_damaged_rows(damaged_run):
    run_dir, seqs = damaged_run
    with open_run(run_dir) as run:
        listed = [d["seq"] for d in run.executions()]
        assert seqs[1] not in listed and seqs[2] not in listed and seqs[3] not in listed
        assert len(listed) == len(seqs) - 3
        assert run.damaged["executions"] == 3
        with pytest.raises(tg.CorruptRun, match=f"execution {seqs[2]} is damaged"):
            run.execution(seqs[2])
        assert run.execution(seqs[4])["stack"] == []  # the execution is fine, its stack is not
        assert run.damaged["stacks"] == 1


@pytest.mark.parametrize("as_json", [False, True])
def test_report_says_how_many_rows_were_damaged_in_one_line(damaged_run, as_json):
    run_dir, _ = damaged_run
    done = subprocess.run([sys.executable, "-m", "trainguard", "report", str(run_dir)] + (["--json"] if as_json else []),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    if as_json:
        assert json.loads(done.stdout)["damaged"]["executions"] == 3
    else:
        lines = [x for x in done.stdout.splitlines() if "damaged" in x]
        assert len(lines) == 1 and "3" in lines[0] and "skipped" in lines[0], done.stdout
