"""``trainguard ui``: bad input gives one clear line and exit code 2; good input serves."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest


def ui(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainguard", "ui", *args], capture_output=True, text=True,
                          timeout=timeout)


def one_clear_line(p: subprocess.CompletedProcess, needle: str) -> None:
    assert p.returncode == 2, p
    assert "Traceback" not in p.stderr + p.stdout
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainguard: error: ") and needle in lines[0], p.stderr


def test_missing_logdir(tmp_path):
    one_clear_line(ui(str(tmp_path / "absent")), "no such logdir")


def test_logdir_is_a_file(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("x")
    one_clear_line(ui(str(f)), "is a file, not a directory")


def test_bad_port(tmp_path):
    one_clear_line(ui(str(tmp_path), "--port", "70000"), "--port must be between 0 and 65535")


def test_port_in_use(tmp_path):
    from trainguard.ui import bind

    taken = bind(port=0)
    try:
        one_clear_line(ui(str(tmp_path), "--port", str(taken.getsockname()[1])), "pick another --port")
    finally:
        taken.close()


@pytest.mark.timeout(120)
def test_serves_the_runs_until_interrupted(logdir):
    proc = subprocess.Popen([sys.executable, "-m", "trainguard", "ui", str(logdir.root), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"(\d+) runs under .* at (http://127\.0\.0\.1:\d+/)", line)
        assert m, line
        assert int(m.group(1)) == 4  # ref, train, group/nested, damaged
        url = m.group(2)
        deadline = time.monotonic() + 30
        while True:
            try:
                runs = httpx.get(url + "api/runs", timeout=5).json()["runs"]
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server did not answer"
                time.sleep(0.1)
        assert sorted(r["id"] for r in runs) == ["damaged", "group:nested", "ref", "train"]
        assert httpx.get(url, timeout=5).status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) in (0, 130)
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
