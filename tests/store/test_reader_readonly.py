"""Runs the reader may not write: on read-only media, or owned by another user. The reader, the
report and the UI open them read-only (immutable where SQLite cannot create its WAL index) and
create nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import trainguard as tg

NOBODY = 65534


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _record(run: Path) -> None:
    with tg.record(run, buffer=-1):
        for _ in range(3):
            torch.ones(3).exp()


@pytest.fixture
def shared_dir():
    """A folder other users can enter (pytest's own temporary folders are private to root)."""
    d = Path(tempfile.mkdtemp(prefix="tg-ro-"))
    d.chmod(0o755)
    yield d
    subprocess.run(["umount", "-l", str(d / "ro")], capture_output=True)
    for p in d.rglob("*"):
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o755)
    shutil.rmtree(d, ignore_errors=True)


def _read_only_media(shared_dir: Path) -> Path:
    src = shared_dir / "src"
    _record(src / "run")
    ro = shared_dir / "ro"
    ro.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "--bind", "-o", "ro", str(src), str(ro)],
                                                   capture_output=True).returncode == 0
    if mounted and subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True).returncode == 0:
        return ro / "run"
    subprocess.run(["umount", "-l", str(ro)], capture_output=True)
    # Without mounting: a folder nobody may write (the owner included) is what the reader meets.
    shutil.rmtree(ro)
    shutil.copytree(src, ro)
    for p in ro.rglob("*"):
        p.chmod(0o555 if p.is_dir() else 0o444)
    ro.chmod(0o555)
    return ro / "run"


READER = """
import json, os, sys
from trainguard.cli import main
from trainguard.store import open_run
from trainguard.ui._registry import Registry

def read(path):
    with open_run(path) as run:
        n = run.count(op="exp")
    code = main(["report", path, "--json"])
    reg = Registry(path)
    ok = reg.handle(next(iter(reg.scan()))).run.count(op="exp")
    reg.close()
    return {"count": n, "report": code, "ui": ok}

if len(sys.argv) > 2:  # root: load every module on a run of its own, then become another user
    read(sys.argv[2])
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
print("RESULT", json.dumps(read(sys.argv[1])))
""".replace("NOBODY", str(NOBODY))


def _as_reader(run: Path, warm: Path | None = None) -> dict:
    argv = [sys.executable, "-c", READER, str(run)] + ([str(warm)] if warm is not None else [])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[7:])


def test_a_run_on_read_only_media(shared_dir):
    run = _read_only_media(shared_dir)
    before = tree(run)
    assert _as_reader(run) == {"count": 3, "report": 0, "ui": 3}
    assert tree(run) == before


def test_a_run_owned_by_another_user(shared_dir):
    run = shared_dir / "theirs"
    _record(run)
    before = tree(run)
    if os.geteuid() == 0:
        # root reads as "nobody", for whom root's run is readable and not writable
        warm = shared_dir / "warm"
        _record(warm)
        result = _as_reader(run, warm)
    else:
        for p in [run, *run.rglob("*")]:
            p.chmod(0o555 if p.is_dir() else 0o444)
        result = _as_reader(run)
    assert result == {"count": 3, "report": 0, "ui": 3}
    assert tree(run) == before
