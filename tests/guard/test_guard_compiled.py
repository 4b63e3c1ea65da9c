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
    assert len(seen) == 34 and calls["compiled"] == 33  # only the recorded step ran eagerly
    assert calls["compiles"] == 1 and state.step == 30 and finite(state)


def _compiled_step_loop(batches, state):
    """The user's loop with the optimizer step compiled (PyTorch's "compiling the optimizer")."""
    step = torch.compile(lambda: state.optimizer.step(), backend="aot_eager")
    for _, (x, y) in batches:
        loss = torch.nn.functional.mse_loss(state.model(x), y)
        state.optimizer.zero_grad()
        loss.backward()
        step()


@pytest.mark.timeout(300)
def test_a_compiled_optimizer_step_keeps_its_graph_under_the_guard(tmp_path):
    from torch._dynamo.utils import counters

    def counts():
        out = {k: dict(counters[k]) for k in ("stats", "graph_break", "frames", "recompiles")}
        out["stats"].pop("calls_captured", None)  # the optimizer hooks' taps are calls in the graph
        return out

    torch._dynamo.reset()
    counters.clear()
    state = make_state(make_data(8))
    _compiled_step_loop(enumerate(state.loader), state)
    plain, want = counts(), [p.detach().clone() for p in state.model.parameters()]

    torch._dynamo.reset()
    counters.clear()
    state = make_state(make_data(8))
    guard = tg.Guard(tmp_path / "run", snapshot_every=4)
    _compiled_step_loop(guard.batches(state, total_steps=8), state)
    got = counts()
    # torch's optimizers break the graph before and after the update: the optimizer hooks' taps
    # run there, in a graph of one op each (tests/capture/test_compile_step.py)
    assert got["graph_break"] == plain["graph_break"] and got["recompiles"] == plain["recompiles"]
    assert got["stats"]["unique_graphs"] == plain["stats"]["unique_graphs"] + 2
    assert state.step == 8 and not guard.events and finite(state)
    for p, w in zip(state.model.parameters(), want):
        torch.testing.assert_close(p.detach(), w)  # the same training
    torch._dynamo.reset()
