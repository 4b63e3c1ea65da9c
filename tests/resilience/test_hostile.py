"""Hostile checkpoint contents: only regular files inside the checkpoint directory, each listed
and checksummed, are ever read; anything else makes that checkpoint invalid with one line, and
restore falls back to the previous valid one.

The attacker here may rewrite ``manifest.json`` whole: its digest is a checksum, not a
signature, so a crafted manifest is as "valid" as a real one.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest

from trainguard.cli import main
from trainguard.resilience import CheckpointFallbackWarning, CheckpointManager, _format, list_checkpoints

from .conftest import assert_same_training_state, make_state, train_steps

NEWEST = "step-00000020"
PLANTED = "planted-pickle-ran"


@pytest.fixture
def ckpt(tmp_path):
    """Checkpoints 10 and 20 of a small run; the tests make 20 hostile. Returns (dir, state at 10)."""
    directory = tmp_path / "checkpoints"
    m = CheckpointManager(directory, keep=5)
    state = make_state()
    train_steps(state, 10)
    m.save(state)
    at_10 = make_state(seed=1)
    at_10.model.load_state_dict(copy.deepcopy(state.model.state_dict()))
    at_10.optimizer.load_state_dict(copy.deepcopy(state.optimizer.state_dict()))
    at_10.scheduler.load_state_dict(copy.deepcopy(state.scheduler.state_dict()))
    train_steps(state, 10)
    m.save(state)
    m.close()
    return directory, at_10


def manifest(d) -> dict:
    doc = json.loads((d / "manifest.json").read_text())
    doc.pop("digest")
    return doc


def rewrite(d, doc: dict) -> None:
    """What an attacker can do: any body, with a digest that matches it."""
    (d / "manifest.json").unlink()
    _format.write_manifest(d, doc)


def data_file(d):
    return next(d.glob("*.distcp"))


def list_as_empty_file(d, name: str) -> None:
    doc = manifest(d)
    doc["files"][name] = {"size": 0, "sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"}
    for entry in doc["engine"]["storage"]:  # a manifest consistent with itself: only the file is odd
        entry["start"] = entry["length"] = 0
    rewrite(d, doc)


def fifo(d) -> str:
    f = data_file(d)
    f.unlink()
    os.mkfifo(f)
    list_as_empty_file(d, f.name)
    return "not a regular file"


def dev_zero(d) -> str:
    f = data_file(d)
    f.unlink()
    f.symlink_to("/dev/zero")
    list_as_empty_file(d, f.name)
    return "symbolic link"


def symlink_outside(d) -> str:
    f = data_file(d)
    outside = d.parent.parent / "outside.bin"
    shutil.copy(f, outside)  # same bytes, same size, same checksum: only where it lives differs
    f.unlink()
    f.symlink_to(outside)
    return "symbolic link"


def directory_symlink_outside(d) -> str:
    outside = d.parent.parent / "elsewhere"
    shutil.copytree(d, outside)
    shutil.rmtree(d)
    d.symlink_to(outside)
    return "symbolic link"


def unlisted_engine_file(d) -> str:
    f = data_file(d)
    shutil.copy(f, d / "unlisted.distcp")
    doc = manifest(d)
    for entry in doc["engine"]["storage"]:
        entry["file"] = "unlisted.distcp"
    rewrite(d, doc)
    return "unlisted.distcp"


class _Plant:
    def __reduce__(self):
        return (open, (PLANTED, "w"))


def planted_pickle(d) -> str:
    f = data_file(d)
    f.write_bytes(pickle.dumps({"weights": _Plant()}))
    doc = manifest(d)
    doc["files"][f.name] = {"size": f.stat().st_size, "sha256": _format.file_digest(f)}
    for entry in doc["engine"]["storage"]:  # every tensor is read from the pickle
        entry["start"], entry["length"] = 0, f.stat().st_size
    rewrite(d, doc)
    return "cannot be read"


def wrong_type(field: str, value):
    def damage(d) -> str:
        doc = manifest(d)
        if value is _MISSING:
            del doc[field]
        else:
            doc[field] = value
        rewrite(d, doc)
        return field

    damage.__name__ = f"{field}_{'missing' if value is _MISSING else type(value).__name__}"
    return damage


_MISSING = object()
WRONG_TYPES = [wrong_type("files", ["__0_0.distcp"]), wrong_type("time", "yesterday"), wrong_type("metadata", [1]),
               wrong_type("epoch", "two"), wrong_type("ranks", _MISSING), wrong_type("state", _MISSING),
               wrong_type("engine", "none")]
HOSTILE = [symlink_outside, directory_symlink_outside, unlisted_engine_file, planted_pickle, *WRONG_TYPES]


@pytest.mark.parametrize("damage", HOSTILE, ids=lambda f: f.__name__)
def test_hostile_newest_checkpoint_is_invalid_and_restore_falls_back(ckpt, damage, capsys, monkeypatch):
    directory, at_10 = ckpt
    monkeypatch.chdir(directory.parent)  # where the planted pickle would leave its mark
    why = damage(directory / NEWEST)
    fresh = make_state(seed=7)
    with pytest.warns(CheckpointFallbackWarning, match=f"{NEWEST}.*{why}"):
        assert CheckpointManager(directory).restore(fresh) == 10
    assert_same_training_state(at_10, fresh)
    assert not os.path.exists(PLANTED)

    if damage is not planted_pickle:  # its files and manifest are consistent: only loading refuses it
        infos = {i.name: i for i in list_checkpoints(directory, verify=True)}
        assert not infos[NEWEST].valid and why in infos[NEWEST].reason
        assert "\n" not in infos[NEWEST].reason
        capsys.readouterr()
        assert main(["ckpt", "list", str(directory)]) == 0
        assert main(["ckpt", "verify", str(directory)]) == 1
        out = capsys.readouterr()
        assert "Traceback" not in out.out + out.err and why in out.out


VERIFY_AND_RESTORE = textwrap.dedent("""
    import sys, warnings
    from trainguard.cli import main
    sys.path.insert(0, sys.argv[2])
    code = main(["ckpt", "verify", sys.argv[1]])
    print("verify exit", code, flush=True)
    from conftest import make_state
    from trainguard.resilience import CheckpointManager
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = CheckpointManager(sys.argv[1]).restore(make_state(seed=3))
    print("restored", step, "|", " ".join(str(w.message) for w in caught), flush=True)
""")


@pytest.mark.parametrize("damage", [fifo, dev_zero], ids=lambda f: f.__name__)
def test_a_data_file_that_never_ends_does_not_hang_verify_or_restore(ckpt, damage):
    directory, _ = ckpt
    why = damage(directory / NEWEST)
    here = os.path.dirname(__file__)
    try:
        done = subprocess.run([sys.executable, "-c", VERIFY_AND_RESTORE, str(directory), here],
                              capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"verify or restore hung on a data file that is a {damage.__name__}")
    assert done.returncode == 0, done.stderr
    assert "verify exit 1" in done.stdout and why in done.stdout
    assert "restored 10 |" in done.stdout and NEWEST in done.stdout


def test_files_the_manifest_does_not_list_are_never_read(ckpt, monkeypatch):
    directory, _ = ckpt
    monkeypatch.chdir(directory.parent)
    (directory / NEWEST / ".metadata").write_bytes(pickle.dumps(_Plant()))  # DCP's own (pickled) metadata name
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CheckpointManager(directory).restore(make_state(seed=2)) == 20
    assert not os.path.exists(PLANTED)
