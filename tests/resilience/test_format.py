"""The on-disk format: the manifest's own digest, quick and full checks, listing."""

from __future__ import annotations

import json

import pytest

from trainguard import CheckpointError
from trainguard.resilience import _format, list_checkpoints
from trainguard.resilience._format import Invalid


def fake_checkpoint(root, step: int, payload: bytes = b"tensor bytes", **extra):
    d = root / _format.checkpoint_name(step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(payload)
    body = {"format": _format.FORMAT, "format_version": _format.FORMAT_VERSION, "step": step, "epoch": 0,
            "time": 1000.0 + step, "ranks": [{"state": {}}], "metadata": {"loss": 0.5}, "state": {},
            "engine": {"version": None, "tensors": {}, "storage": []},
            "files": {"__0_0.distcp": {"size": len(payload), "sha256": _format.file_digest(d / "__0_0.distcp")}}}
    body.update(extra)
    _format.write_manifest(d, body)
    return d


def test_a_whole_checkpoint_passes_both_checks(tmp_path):
    d = fake_checkpoint(tmp_path, 7)
    assert _format.check(d, full=True)["step"] == 7


def test_a_manifest_edit_breaks_its_digest(tmp_path):
    d = fake_checkpoint(tmp_path, 7)
    doc = json.loads((d / "manifest.json").read_text())
    doc["step"] = 8
    (d / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(Invalid, match="fails its own checksum"):
        _format.check(d, full=False)


def test_quick_check_sees_sizes_full_check_sees_content(tmp_path):
    d = fake_checkpoint(tmp_path, 1)
    (d / "__0_0.distcp").write_bytes(b"tensor bytez")  # same size, different content
    _format.check(d, full=False)
    with pytest.raises(Invalid, match="fails its SHA-256"):
        _format.check(d, full=True)
    (d / "__0_0.distcp").write_bytes(b"short")
    with pytest.raises(Invalid, match="has 5 bytes, the manifest says 12"):
        _format.check(d, full=False)


def test_step_in_manifest_must_match_the_name(tmp_path):
    d = fake_checkpoint(tmp_path, 3)
    d.rename(tmp_path / "step-00000004")
    with pytest.raises(Invalid, match="says step 3"):
        _format.check(tmp_path / "step-00000004", full=False)


def test_unsafe_file_names_are_refused(tmp_path):
    d = fake_checkpoint(tmp_path, 3, files={"../escape": {"size": 1, "sha256": "0"}})
    with pytest.raises(Invalid, match="unsafe file"):
        _format.check(d, full=False)


def test_listing_is_ordered_and_shows_leftovers_and_damage(tmp_path):
    fake_checkpoint(tmp_path, 20)
    fake_checkpoint(tmp_path, 3)
    (tmp_path / ".tmp-step-00000030-abc123").mkdir()
    (fake_checkpoint(tmp_path, 10) / "manifest.json").unlink()
    (tmp_path / "unrelated").mkdir()
    infos = list_checkpoints(tmp_path)
    assert [(i.step, i.valid, i.complete) for i in infos] == [
        (3, True, True), (10, False, True), (20, True, True), (30, False, False)]
    assert infos[1].reason == "manifest.json is missing"
    assert infos[3].reason.startswith("incomplete")
    assert infos[0].metadata == {"loss": 0.5} and infos[0].time == 1003.0
    assert infos[0].to_dict()["name"] == "step-00000003"


def test_a_run_directory_with_a_checkpoints_folder_is_followed(tmp_path):
    fake_checkpoint(tmp_path / "checkpoints", 5)
    (tmp_path / "run.sqlite").write_bytes(b"")
    assert [i.step for i in list_checkpoints(tmp_path)] == [5]


def test_missing_directory_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        list_checkpoints(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        list_checkpoints(tmp_path / "file")
    assert list_checkpoints(tmp_path) == []


def test_listing_needs_no_torch(tmp_path):
    """The CLI and the UI list checkpoints without paying for a torch import."""
    import subprocess
    import sys

    fake_checkpoint(tmp_path, 1)
    code = ("import sys, trainguard, trainguard.resilience as r; "
            f"infos = r.list_checkpoints({str(tmp_path)!r}); "
            "assert [i.step for i in infos] == [1], infos; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
