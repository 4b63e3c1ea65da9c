"""A compiled model with a poisoned batch: the failing step is replayed eagerly under the recorder,
and training goes on through the compiled code."""

from __future__ import annotations

import warnings

import pytest
import torch

import trainguard as tg

from .conftest import PolyNet, finite, line_of, make_data, make_state, train


@pytest.mark.timeout(240)
def test_a_compiled_model_is_replayed_eagerly_and_continues_compiled(tmp_path):
    calls = {"compiled": 0, "compiles": 0}

    def backend(gm, example_inputs):  # a backend that counts the calls of the compiled graph
        calls["compiles"] += 1

        def run(*args):
            calls["compiled"] += 1
            return gm.forward(*args)

        return run

    torch._dynamo.reset()
    model = torch.compile(PolyNet(), backend=backend)
    state = make_state(make_data(30, poison_batch=12), model=model)
    guard = tg.Guard(tmp_path / "run", snapshot_every=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the replay's own warnings are kept out of the user's sight
        seen = train(guard.batches(state, total_steps=30), state)
    [event] = guard.events
    assert event["step"] == 12 and event["replay"]["bitwise_equal"] is True
    link = event["origin"]["origin"]
    assert link["op"].startswith("aten.pow") and link["line"] == line_of("POW_LINE")  # the model's own line
    assert len(seen) == 35 and calls["compiled"] == 34  # only the recorded step ran eagerly
    assert calls["compiles"] == 1 and state.step == 30 and finite(state)
