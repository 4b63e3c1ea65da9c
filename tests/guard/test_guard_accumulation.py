"""The guard over a loop that accumulates gradients over micro-batches: a NaN inside a window."""

from __future__ import annotations

import pytest
from torch import nn

import trainguard as tg

from .conftest import assert_bitwise, finite, make_data, make_state, params

# The loop of huggingface/transformers examples/pytorch/language-modeling/run_clm_no_trainer.py run
# with --gradient_accumulation_steps 2 (`with accelerator.accumulate(model)`), written out by hand:
# every micro-batch adds its gradients, the optimizer steps and zeroes them every K micro-batches.
K = 2


def accumulate(batches, state):
    for step, (x, y) in batches:
        loss = nn.functional.mse_loss(state.model(x), y) / K
        loss.backward()
        if (step + 1) % K == 0:
            state.optimizer.step()
            state.scheduler.step()
            state.optimizer.zero_grad()


def accumulate_without(data, total_steps, bad_batch, **kw):
    """The unguarded loop that never sees batch ``bad_batch``: what skipping it means."""
    state = make_state(data, **kw)
    batches = [b for i, b in enumerate(state.loader) if i != bad_batch][:total_steps]
    accumulate(enumerate(batches), state)
    return state


@pytest.mark.parametrize("bad", [22, 23], ids=["first-micro-batch", "second-micro-batch"])
def test_a_nan_inside_an_accumulation_window_skips_that_batch_alone(tmp_path, bad):
    # run_clm_no_trainer.py with a guard and a poisoned batch: the recorded failing step left its
    # NaN gradients in .grad (accumulate() zeroes them only when the optimizer steps), the rewind
    # kept them, and the next, healthy batch "failed the same way": a second skip, or five rewinds
    # blamed on a healthy step and Diverged.
    data = make_data(40, poison_batch=bad)
    state = make_state(data)
    guard = tg.Guard(tmp_path / "run", snapshot_every=10)
    accumulate(guard.batches(state, total_steps=30), state)
    assert [(e["step"], e["action"]) for e in guard.events] == [(bad, "skip")]
    assert guard.events[0]["replay"]["bitwise_equal"] is True
    assert state.step == 30 and finite(state)
    assert_bitwise(params(accumulate_without(data, 30, bad)), params(state))
