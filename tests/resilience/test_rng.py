"""Every process-wide generator and handed-in generators are captured and restored."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from trainguard import CheckpointError
from trainguard.resilience import _rng
from trainguard.resilience._codec import Encoder, decode


def draws(gen: torch.Generator) -> tuple:
    return (random.random(), float(np.random.rand()), float(np.random.randn()), torch.rand(2).tolist(),
            torch.rand(2, generator=gen).tolist())


def test_capture_then_restore_repeats_every_stream_even_through_json():
    gen = torch.Generator().manual_seed(5)
    np.random.randn()  # leaves a cached Gaussian in NumPy's state, which must be kept too
    enc = Encoder()
    doc = json.loads(json.dumps(enc.encode(_rng.capture_all([gen]), "rng")))
    first = draws(gen)
    _rng.restore_all(decode(doc, enc.tensors), [gen])
    assert draws(gen) == first


def test_generator_count_and_device_must_match():
    gen = torch.Generator().manual_seed(1)
    state = _rng.capture_all([gen])
    with pytest.raises(CheckpointError, match="expected the state of 0 generator"):
        _rng.restore_all(state, [])
    bad = dict(_rng.capture_generator(gen), device="cuda:0")
    with pytest.raises(CheckpointError, match="saved on cuda:0"):
        _rng.restore_generator(gen, bad)


def test_cuda_state_without_cuda_is_a_clear_error():
    state = _rng.capture_global()
    state["cuda"] = [b"\0" * 16]
    if torch.cuda.is_available():  # pragma: no cover - only on a GPU machine
        state["cuda"] = state["cuda"] * (torch.cuda.device_count() + 1)
    with pytest.raises(CheckpointError, match="CUDA device"):
        _rng.restore_global(state)
