"""The guard over a loop that accumulates gradients over micro-batches: a NaN inside a window."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainguard as tg

from .conftest import BS, assert_bitwise, finite, make_data, make_state, params

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


@pytest.fixture
def fresh_accelerate():
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # process-wide: leave none to later tests
    GradientState._reset_state()


def accelerate_state(data):
    from accelerate import Accelerator

    state = make_state(data)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=K)
    model, opt, sched, loader = accelerator.prepare(state.model, state.optimizer, state.scheduler, state.loader)
    return accelerator, tg.TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader,
                                      accelerator=accelerator)


def accelerate_loop(batches, state, accelerator):
    # run_clm_no_trainer.py's loop body, as it is
    for _step, (x, y) in batches:
        with accelerator.accumulate(state.model):
            loss = nn.functional.mse_loss(state.model(x), y)
            accelerator.backward(loss)
            state.optimizer.step()
            state.scheduler.step()
            state.optimizer.zero_grad()


@pytest.mark.parametrize("bad", [22, 23], ids=["first-micro-batch", "second-micro-batch"])
def test_accelerate_accumulate_with_a_nan_mid_window_skips_that_batch_alone(tmp_path, bad, fresh_accelerate):
    # accelerate counts micro-batches in Accelerator.step, which no state_dict holds: after a
    # rewind from an odd count the replayed windows were shifted by one ("losses differ") and
    # training went on with every later window misaligned.
    data = make_data(40, poison_batch=bad)
    accelerator, state = accelerate_state(data)
    guard = tg.Guard(tmp_path / "run", snapshot_every=10)
    accelerate_loop(guard.batches(state, total_steps=30), state, accelerator)
    assert [(e["step"], e["action"]) for e in guard.events] == [(bad, "skip")]
    assert guard.events[0]["replay"]["bitwise_equal"] is True
    keep = [i for i in range(len(data)) if i // BS != bad]
    clean = torch.utils.data.TensorDataset(*(t[keep] for t in data.tensors))
    accelerator, ref = accelerate_state(clean)
    accelerate_loop(zip(range(30), ref.loader), ref, accelerator)
    assert_bitwise(params(ref), params(state))
