"""``trainguard ckpt list|verify``: tables, JSON, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainguard.cli import main
from trainguard.resilience import CheckpointManager

from .conftest import make_state


@pytest.fixture
def run_dir(tmp_path):
    """A run directory with its checkpoints in checkpoints/, as the UI expects."""
    m = CheckpointManager(tmp_path / "checkpoints", keep=5)
    state = make_state()
    for step in (10, 20, 30):
        m.save(state, step, metadata={"loss": 1.0 / step})
    return tmp_path


def test_list_shows_steps_sizes_and_validity(run_dir, capsys):
    assert main(["ckpt", "list", str(run_dir)]) == 0
    out = capsys.readouterr().out
    for step in ("10", "20", "30"):
        assert step in out
    assert out.count("valid") == 3 and "KiB" in out and "loss=0.05" in out


def test_list_json_is_the_checkpoint_info(run_dir, capsys):
    assert main(["ckpt", "list", "--json", str(run_dir / "checkpoints")]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["valid"], r["name"]) for r in rows] == [
        (10, True, "step-00000010"), (20, True, "step-00000020"), (30, True, "step-00000030")]
    assert rows[0]["metadata"] == {"loss": 0.1} and rows[0]["size"] > 0


def test_list_marks_damage_quickly_and_verify_finds_content_damage(run_dir, capsys):
    data = next((run_dir / "checkpoints" / "step-00000030").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main(["ckpt", "list", str(run_dir)]) == 0
    assert "DAMAGED" not in capsys.readouterr().out  # the quick check reads sizes only
    assert main(["ckpt", "list", "--verify", str(run_dir)]) == 0
    assert "step-00000030: __0_0.distcp fails its SHA-256 checksum" in capsys.readouterr().out
    assert main(["ckpt", "verify", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "restore would use step-00000020" in out


def test_verify_passes_on_a_healthy_directory(run_dir, capsys):
    assert main(["ckpt", "verify", str(run_dir)]) == 0
    assert "newest checkpoint step-00000030 is valid" in capsys.readouterr().out


@pytest.mark.parametrize("action", ["list", "verify"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, action):
    (tmp_path / "empty").mkdir()
    for target, message in ((tmp_path / "missing", "no such directory"), (tmp_path / "empty", "no checkpoints here")):
        proc = subprocess.run([sys.executable, "-m", "trainguard", "ckpt", action, str(target)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2
        assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr
        assert "Traceback" not in proc.stderr
