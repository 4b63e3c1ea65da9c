"""A guarded loop that skips non-finite losses itself (normflows' notebook:
``if ~(torch.isnan(loss) | torch.isinf(loss)): loss.backward(); optimizer.step()``): nothing was
updated at such a step, so the guard must not rewind or skip it again, but it must say so: before,
the guard logged nothing and its run held no trace of the skipped steps."""

from __future__ import annotations

import logging

import torch
from torch import nn

import trainguard as tg
from trainguard.store import open_run

from .conftest import finite, line_of, make_data, make_state


def skip_loop(batches, state, log=None):
    seen, log = [], [] if log is None else log
    for step, (x, y) in batches:
        seen.append(step)
        loss = nn.functional.mse_loss(state.model(x), y)
        if ~(torch.isnan(loss) | torch.isinf(loss)):  # SKIP_LINE
            state.optimizer.zero_grad()
            loss.backward()
            state.optimizer.step()
            state.scheduler.step()
        log.append(loss.item())  # a log line after the check: not where the loop skips
    return seen


def test_steps_the_loop_skips_itself_are_logged_and_stored_not_rewound(tmp_path, caplog):
    state = make_state(make_data(40, poison_batch=12))  # x = 1e20: the loss is inf at step 12
    guard = tg.Guard(tmp_path / "run", snapshot_every=10)
    with caplog.at_level(logging.WARNING, logger="trainguard.guard"):
        seen = skip_loop(guard.batches(state, total_steps=40), state)
    assert seen == list(range(40)) and finite(state)
    assert guard.events == [] and guard.rewinds == 0  # the loop handled it: nothing to rewind
    assert guard.loop_skipped["count"] == 1 and guard.loop_skipped["first"]["step"] == 12
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert line.startswith("trainguard: step 12: the loop skipped this step itself: its loss was nan")
    assert "test_guard_loop_skips.py:" in line and "--check-numerics" in line
    with open_run(tmp_path / "run") as run:
        stored = run.meta["guard"]["loop_skipped"]
        assert stored["count"] == 1 and stored["steps"] == [12]
        assert stored["first"]["loss"] != stored["first"]["loss"] and stored["first"]["check"] == "isnan"
        assert stored["first"]["line"] == line_of("SKIP_LINE", skip_loop)


def test_a_monitor_beside_the_guard_keeps_the_loops_step_numbers(tmp_path):
    state = make_state(make_data(30, poison_batch=7))
    guard = tg.Guard(tmp_path / "run", snapshot_every=10)
    with tg.Monitor(state.model, tmp_path / "mon", every=5):
        skip_loop(guard.batches(state, total_steps=30), state)
    with open_run(tmp_path / "mon") as run:
        assert [s for s, _ in run.scalars("loss")["loss"]] == [s for s in range(30) if s != 7]
        assert [s for s, _ in run.scalars("skipped")["skipped"]] == [7]
        assert run.meta["monitor"]["skipped_iterations"]["count"] == 1
        kinds = [f["kind"] for f in run.findings()]
    assert "iterations_skipped" in kinds
    assert guard.loop_skipped["count"] == 1
