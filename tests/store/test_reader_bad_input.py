"""Opening something that is not a good run: one clear error of the right type."""

from __future__ import annotations

import sqlite3

import pytest
import torch

import trainguard as tg
from trainguard.store import SCHEMA_VERSION, open_run


@pytest.fixture
def good_run(tmp_path):
    with tg.record(tmp_path / "good", buffer=-1):
        for _ in range(200):
            torch.ones(64).exp()
    return tmp_path / "good"


def test_missing_path(tmp_path):
    with pytest.raises(tg.RunNotFound, match="no such run directory"):
        open_run(tmp_path / "nope")


def test_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(tg.RunNotFound, match="is empty"):
        open_run(tmp_path / "empty")


def test_folder_of_something_else(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hello")
    with pytest.raises(tg.RunNotFound, match="holds no trainguard run"):
        open_run(tmp_path / "other")


def test_a_file_is_not_a_run(tmp_path):
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(tg.RunNotFound, match="is a file"):
        open_run(tmp_path / "f.txt")


def test_not_sqlite(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "run.sqlite").write_bytes(b"this is not a database at all" * 100)
    with pytest.raises(tg.CorruptRun, match="not a readable trainguard run"):
        open_run(tmp_path / "r")


def test_truncated_database(good_run):
    db = good_run / "run.sqlite"
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 3])
    with pytest.raises(tg.CorruptRun):
        run = open_run(good_run)
        run.executions()  # damage may only show when the pages are read


def test_corrupted_pages(good_run):
    db = good_run / "run.sqlite"
    data = bytearray(db.read_bytes())
    for i in range(4096, len(data), 997):
        data[i] ^= 0xFF
    db.write_bytes(bytes(data))
    with pytest.raises(tg.CorruptRun):
        run = open_run(good_run)
        run.executions()
        run.alerts()


def test_sqlite_of_another_program(tmp_path):
    (tmp_path / "r").mkdir()
    con = sqlite3.connect(tmp_path / "r" / "run.sqlite")
    con.execute("CREATE TABLE t(x)")
    con.commit()
    con.close()
    with pytest.raises(tg.CorruptRun, match="not a readable trainguard run"):
        open_run(tmp_path / "r")


def test_newer_schema(good_run):
    con = sqlite3.connect(good_run / "run.sqlite")
    con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    con.commit()
    con.close()
    with pytest.raises(tg.SchemaTooNew, match="upgrade trainguard"):
        open_run(good_run)


def test_ranks_are_found(tmp_path):
    for rank in (0, 1):
        with tg.record(tmp_path / "dist" / f"rank-{rank}", buffer=-1):
            torch.ones(2) * rank
    run = open_run(tmp_path / "dist")
    assert run.ranks == [0, 1] and run.path.name == "rank-0"
    assert open_run(tmp_path / "dist", rank=1).path.name == "rank-1"
    with pytest.raises(tg.RunNotFound, match="no rank 5"):
        open_run(tmp_path / "dist", rank=5)


def test_a_wrong_argument_is_not_called_damage(good_run):
    # `run.scalars(["loss"])` said "run ... is damaged: Error binding parameter 1", which it was not.
    run = open_run(good_run)
    with pytest.raises(TypeError, match="'loss'"):
        run.scalars(["loss"])
    run.close()
    with pytest.raises(tg.TrainguardError, match="closed") as exc:
        run.scalars("loss")
    assert not isinstance(exc.value, tg.CorruptRun)
