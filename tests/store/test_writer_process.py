"""The writer's child process leaves nothing open in the training process once a run is stopped."""

from __future__ import annotations

import gc
import warnings

import torch

import trainguard as tg


def test_a_stopped_recording_leaves_no_pipe_open(tmp_path):
    # Found with `python -W error::ResourceWarning` around a recording: the pipes to the writer
    # process stayed open until the garbage collector found them.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        with tg.record(tmp_path / "r") as rec:
            torch.ones(3).exp()
        del rec
        gc.collect()
    assert not [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert tg.open(tmp_path / "r").count(op="aten.exp") == 1
