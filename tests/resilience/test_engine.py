"""The tensor engine: DCP underneath, no pickle anywhere on the way back."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from trainguard.resilience import CheckpointManager
from trainguard.resilience._engine import load_tensors, metadata_from_json, metadata_to_json, save_tensors

from .conftest import assert_same_training_state, make_state, train_steps


def test_tensors_round_trip_and_metadata_is_json(tmp_path):
    tensors = {"a/w": torch.randn(3, 4), "a/step": torch.tensor(2.0), "b/i": torch.arange(5), "empty": torch.zeros(0)}
    meta, written = save_tensors(tensors, tmp_path, None)
    assert [p.name for p in written] == ["__0_0.distcp"]
    assert not (tmp_path / ".metadata").exists()  # DCP's pickled metadata is never written
    assert metadata_to_json(metadata_from_json(meta)) == meta
    targets = {k: torch.empty_like(v) for k, v in tensors.items()}
    load_tensors(targets, tmp_path, meta, None)
    assert all(torch.equal(targets[k], v) for k, v in tensors.items())


def test_restore_never_unpickles(tmp_path, monkeypatch):
    state = make_state()
    train_steps(state, 3)
    CheckpointManager(tmp_path).save(state)

    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used while loading a checkpoint")

    for name in ("load", "loads"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    real_load = torch.load
    calls = []

    def checked_load(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        assert kwargs.get("weights_only") is True, "torch.load without weights_only=True"
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", checked_load)
    fresh = make_state(seed=1)
    assert CheckpointManager(tmp_path).restore(fresh) == 3
    assert calls and all(calls)
    assert_same_training_state(state, fresh)


def test_a_pickle_planted_in_a_data_file_is_not_executed(tmp_path, monkeypatch):
    """The data files are read as tensors only: a crafted pickle payload fails instead of running."""
    monkeypatch.chdir(tmp_path)
    state = make_state()
    m = CheckpointManager(tmp_path)
    m.save(state)
    data = next((tmp_path / "step-00000000").glob("*.distcp"))
    evil = io.BytesIO()
    pickle.dump(_Boom(), evil)
    data.write_bytes(evil.getvalue() + data.read_bytes()[len(evil.getvalue()):])
    # Even with the manifest's checksums bypassed, loading the tensor fails without running code.
    from trainguard.resilience import _format

    manifest = _format.read_manifest(tmp_path / "step-00000000")
    targets = {k: torch.empty(v["shape"], dtype=getattr(torch, v["dtype"])) for k, v in manifest["engine"]["tensors"].items()}
    with pytest.raises(BaseException, match="Weights only load failed"), pytest.warns(UserWarning):
        load_tensors(targets, tmp_path / "step-00000000", manifest["engine"], None)
    assert not (tmp_path / "pwned").exists()


class _Boom:
    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path("pwned"),))
