"""Bad command-line inputs: one clear line and a non-zero exit, never a traceback, and no run left
behind; a script with a syntax error is shown as plain ``python`` shows it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainguard.cli import main


def trainguard(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainguard", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


@pytest.fixture
def here(tmp_path):
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "ok.py").write_text("import torch\ntorch.ones(2).exp()\n")
    (tmp_path / "bad.py").write_text("import torch\n\ndef f(:\n    pass\n")
    return tmp_path


@pytest.mark.parametrize("args, message", [
    (["run", "--logdir", "afile/run", "ok.py"], "cannot create the run directory 'afile/run'"),
    (["run", "--logdir", "/proc/no-such/run", "ok.py"], "cannot create the run directory '/proc/no-such/run'"),
    (["run", "--monitor", "--every", "0", "--logdir", "r", "ok.py"], "--every must be an int >= 1, got 0"),
    (["run", "--logdir", "r", "-m", "no_such_module"], "no module named 'no_such_module'"),
    (["run", "--logdir", "r", "--buffer", "-5", "ok.py"], "buffer must be -1"),
    (["run", "--resume", "--overwrite", "--logdir", "r", "ok.py"], "choose one of --resume and --overwrite"),
    (["run", "--resume", "--overwrite", "--nproc-per-node", "2", "--logdir", "r", "ok.py"],
     "choose one of --resume and --overwrite"),
    (["monitor", "--resume", "--overwrite", "--nproc-per-node", "2", "--logdir", "r", "ok.py"],
     "choose one of --resume and --overwrite"),
])
def test_one_line_and_no_run_left_behind(here, args, message, capsys, monkeypatch):
    monkeypatch.chdir(here)
    before = sorted(p.name for p in here.iterdir())
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainguard: error: ") and message in lines[0], err
    assert sorted(p.name for p in here.iterdir()) == before, "an empty run was left behind"


def test_export_into_a_place_that_cannot_be_made_is_one_line(here, capsys, monkeypatch):
    monkeypatch.chdir(here)
    assert main(["run", "--logdir", "r", "ok.py"]) == 0
    capsys.readouterr()
    assert main(["export", "tensorboard", "r", "/proc/no-such/out"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainguard: error: ") and "/proc/no-such/out" in lines[0]


@pytest.mark.parametrize("command", ["run", "monitor"])
def test_a_syntax_error_is_shown_as_python_shows_it(here, command):
    # `trainguard monitor` made a run, printed runner frames and a script_crashed finding "called
    # from <frozen runpy>:259"; `run` refuses the script before the run directory exists.
    plain = subprocess.run([sys.executable, "bad.py"], capture_output=True, text=True, cwd=here)
    done = trainguard(command, "--logdir", "r", "bad.py", cwd=here)
    assert done.returncode == plain.returncode == 1
    assert done.stderr == plain.stderr  # no trainguard frames, nothing else
    assert not (here / "r").exists()


@pytest.mark.parametrize("command", ["run", "monitor"])
def test_a_runtime_error_shows_the_scripts_frames_only(here, command):
    # `trainguard monitor` printed the runner's frames too (cli/_monitor.py, runpy) above the script's.
    (here / "boom.py").write_text("import json\n\ndef go():\n    raise ValueError('boom')\n\ngo()\n")
    plain = subprocess.run([sys.executable, "boom.py"], capture_output=True, text=True, cwd=here)
    done = trainguard(command, "--logdir", "r", "boom.py", cwd=here)
    assert done.returncode == 1
    traceback_lines = [x for x in done.stderr.splitlines() if not x.startswith("trainguard:")]
    assert "\n".join(traceback_lines) == plain.stderr.rstrip("\n")
