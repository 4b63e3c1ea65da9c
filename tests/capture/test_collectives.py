"""Recording leaves no trace on the program's tensors and issues no collective of its own.

Under ``torch.distributed`` every rank must run the same collectives in the same order: a
recorder that changes how a tensor behaves (here: whether its storage can grow) makes one rank
fail inside a collective while the others wait for it forever.
"""

from __future__ import annotations

import pytest
import torch

import trainguard as tg
from trainguard.capture import _kernels
from trainguard.capture._summary import summarize_immediate


def _grow(t: torch.Tensor) -> None:
    t.resize_(t.numel() * 4 + 16)  # needs a new, larger allocation


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "numpy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.uint8, torch.int64])
@pytest.mark.parametrize("mode", ["curt_health", "full_health", "stats"])
def test_a_summarised_tensor_can_still_grow(dtype, mode, kernel, monkeypatch):
    if not kernel:
        monkeypatch.setattr(_kernels, "_kernel", None)
    t = torch.ones(5, dtype=dtype)
    summarize_immediate(t, mode)
    _grow(t)
    assert t.numel() == 36


def test_recorded_outputs_can_still_grow(tmp_path):
    # torch.distributed.gather_object grows the byte tensor of a pickled object this way: a
    # recorder that pins it makes the collective fail on one rank only (DCP's save hung).
    with tg.record(tmp_path / "r", mode="full_health"):
        storage = torch.ByteStorage._from_buffer(b"abc")
        bytes_ = torch.ByteTensor(storage)
        _grow(bytes_)
        floats = torch.randn(3, 4).t()
        _grow(floats)
    assert bytes_.numel() == 28 and floats.numel() == 64
