"""A recording whose disk fills up: the sink's failure reaches the run (or a sidecar file when the
database cannot be written), the command line and the report say how much was lost and why."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap

from trainguard.store import open_run
from trainguard.store._codec import MODE_FIELDS
from trainguard.store._sink import Sink

STEPS = 1500  # 30 executions a step: several MB of rows, more than the room left
SCRIPT = textwrap.dedent(f"""
    import torch
    x = torch.ones(64)
    for step in range({STEPS}):
        for _ in range(10):
            x = (x * 1.0001).exp().log()
    print("script done", flush=True)
""")


def _limit_file_size(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: writes fail
    return apply


def test_a_recording_on_a_full_disk_says_what_was_lost_and_why(small_disk, tmp_path):
    script = tmp_path / "many_ops.py"
    script.write_text(SCRIPT)
    run = small_disk.path / "run"
    # room for the run to start; the disk fills while the script runs
    if small_disk.real:
        small_disk.leave_free(1_500_000)
        limit = None
    else:  # no tmpfs here: every file of the run may grow to 1.5 MB only
        limit = _limit_file_size(1_500_000)
    done = subprocess.run([sys.executable, "-m", "trainguard", "run", "--buffer", "-1", "--logdir", str(run),
                           str(script)], capture_output=True, text=True, timeout=300, preexec_fn=limit)
    assert "script done" in done.stdout  # observing training never kills training
    assert "Traceback" not in done.stderr, done.stderr
    assert "OperationalError" not in done.stderr
    cli = [line for line in done.stderr.splitlines() if line.startswith("trainguard:")]
    assert any("not stored" in line for line in cli), done.stderr

    small_disk.free_up()
    with open_run(run) as r:
        stored = r.count()
        error, lost = r.meta.get("writer_error"), r.meta.get("lost")
    assert error and ("full" in error or "disk" in error or "I/O" in error), error
    assert lost and lost > 0 and stored + lost <= STEPS * 30 + 1
    report = subprocess.run([sys.executable, "-m", "trainguard", "report", str(run), "--json"],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    rep = json.loads(report.stdout)
    assert rep["meta"]["writer_error"] == error and rep["meta"]["lost"] == lost
    text = subprocess.run([sys.executable, "-m", "trainguard", "report", str(run)], capture_output=True, text=True,
                          timeout=120).stdout
    assert "writer error" in text and f"{lost:,}" in text


def _exec_records(start: int, n: int, fields: int) -> list[tuple]:
    summary = ((64.0,) + (0.0,) * (fields - 1),)
    return [(seq, 0, "forward", "aten.exp.default", None, None, None, 0, [], [["float32", [64], "cpu"]], summary)
            for seq in range(start, start + n)]


def test_the_sink_keeps_its_failure_when_the_database_cannot_be_written(small_disk, tmp_path):
    run = small_disk.path / "run" if small_disk.real else tmp_path / "run"
    run.mkdir()
    sink = Sink(run, mode="full_health")
    if small_disk.real:
        small_disk.leave_free(64_000)
    else:  # no tmpfs here: SQLite's own page limit fills the database the same way (SQLITE_FULL)
        pages = sink.con.execute("PRAGMA page_count").fetchone()[0]
        sink.con.execute(f"PRAGMA max_page_count = {pages + 4}")
    fields = len(MODE_FIELDS["full_health"])
    for i in range(40):
        sink.handle(("exec", _exec_records(i * 500, 500, fields)))
        sink.commit()
    sink.commit(final=True)
    assert sink.lost > 0 and sink.stopped
    small_disk.free_up()
    with open_run(run) as r:
        assert r.meta["writer_error"] == sink.stopped
        assert r.meta["lost"] == sink.lost
        assert r.count() + sink.lost == 40 * 500
    assert not os.path.exists(run / "run.sqlite-journal")
