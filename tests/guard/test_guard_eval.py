"""An evaluation inside the guarded loop body (pytorch/examples' mnist ``test()`` under
``torch.no_grad()``, nanoGPT's ``estimate_loss()`` every ``eval_interval``): a label out of range in
the validation set made its ``nll_loss`` raise inside the guarded step, and the guard counted the
*training* step as bad, rewound, skipped the training batch, and stopped with ``Diverged`` when the
next eval raised the same way. An op under ``no_grad`` changes no parameter: the guard now reports the
eval's fault (the op, the line, the loader, its batch and sample) and training goes on unchanged."""

from __future__ import annotations

import inspect
import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg
from trainguard.guard._events import stored_meta

BAD = 37  # the validation sample labelled 10 for a 10-class head


def _evaluate(model, val_loader):
    """pytorch/examples @ 77f55b9, mnist/main.py ``test()``: summed nll_loss and accuracy under no_grad."""
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in val_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()  # marker: eval loss
            correct += output.argmax(1).eq(target).sum().item()
    model.train()
    return test_loss / len(val_loader.dataset), correct


def _run(tmp_path, bad_label: bool, steps=12):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(96, 12, generator=g), torch.randint(0, 10, (96,), generator=g)
    vx, vy = torch.randn(64, 12, generator=g), torch.randint(0, 10, (64,), generator=g)
    if bad_label:
        vy[BAD] = 10
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 10), nn.LogSoftmax(-1))
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    state = tg.TrainState(model=model, optimizer=opt,
                          loader=DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
    val_loader = DataLoader(TensorDataset(vx, vy), batch_size=16)
    guard = tg.Guard(tmp_path / "run", snapshot_every=4)
    evals = []
    for step, (data, target) in guard.batches(state, total_steps=steps):
        opt.zero_grad()
        F.nll_loss(model(data), target).backward()
        opt.step()
        if step % 4 == 3:
            evals.append(_evaluate(model, val_loader))
    return guard, state, evals


def test_a_bad_label_in_a_no_grad_eval_is_reported_and_training_goes_on(tmp_path, caplog):
    clean_guard, clean, _ = _run(tmp_path / "clean", bad_label=False)
    with caplog.at_level(logging.INFO, logger="trainguard.guard"):
        guard, state, evals = _run(tmp_path / "bad", bad_label=True)
    assert clean_guard.events == []
    assert guard.events == [], [e["message"] for e in guard.events]  # no rewind, no skip, no Diverged
    assert state.step == 12 and len(evals) == 3
    for a, b in zip(state.model.parameters(), clean.model.parameters()):
        assert torch.equal(a, b)  # training is the clean run's, bitwise
    faults = stored_meta(tmp_path / "bad" / "run")["eval_faults"]
    assert faults["count"] == 3 and faults["steps"] == [3, 7, 11], faults
    first = faults["first"]
    lines, start = inspect.getsourcelines(_evaluate)
    line = start + next(i for i, t in enumerate(lines) if "marker: eval loss" in t)
    assert first["op"] == "F.nll_loss" and first["error"].startswith("IndexError: Target 10 is out of bounds")
    assert first["file"].endswith("test_guard_eval.py") and first["line"] == line, first
    assert first["index"]["values"] == [10], first["index"]
    assert first["loader"] == {"name": "val_loader", "batch": BAD // 16, "samples": [BAD]}, first
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("under torch.no_grad()" in w and "val_loader" in w and f"sample {BAD}" in w for w in warnings), warnings


def test_a_label_out_of_range_in_targets_built_under_no_grad_is_still_a_bad_step(tmp_path):
    # Soft targets built under no_grad for the training loss (label smoothing, mixup): one_hot's
    # result is an integer tensor, clamped into range in place of the error, which holds no NaN to
    # show in the loss; training on it would be training on a wrong label, so the step stays bad.
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 12, generator=g), torch.randint(0, 10, (64,), generator=g)
    y[BAD] = 10
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = tg.TrainState(model=model, optimizer=opt, loader=DataLoader(TensorDataset(x, y), batch_size=16))
    guard = tg.Guard(tmp_path / "run", snapshot_every=4)
    for _, (data, target) in guard.batches(state, total_steps=4):
        with torch.no_grad():
            soft = F.one_hot(target, 10).float() * 0.9 + 0.01
        loss = -(soft * model(data).log_softmax(-1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    [event] = guard.events
    assert event["action"] == "skip" and event["raised"]["op"] == "F.one_hot", event["message"]
    assert event["raised"]["index"]["in_batch"]["samples"] == [BAD]
    assert "eval_faults" not in stored_meta(tmp_path / "run")


def test_a_nan_from_a_no_grad_op_that_reaches_the_loss_is_the_steps_fault(tmp_path, caplog):
    # A regression target looked up under no_grad by the label (a per-class embedding): the bad
    # label's NaN stand-in reaches the training loss. That is no eval: the event names the op that
    # raised, as for a label out of range, and no eval fault is logged ("training goes on").
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 12, generator=g), torch.randint(0, 10, (64,), generator=g)
    y[BAD] = 10
    table = torch.randn(10, 4, generator=g)
    torch.manual_seed(0)
    model = nn.Linear(12, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = tg.TrainState(model=model, optimizer=opt, loader=DataLoader(TensorDataset(x, y), batch_size=16))
    guard = tg.Guard(tmp_path / "run", snapshot_every=4)
    with caplog.at_level(logging.INFO, logger="trainguard.guard"):
        for _, (data, target) in guard.batches(state, total_steps=4):
            with torch.no_grad():
                goal = table.index_select(0, target)
            loss = F.mse_loss(model(data), goal)
            opt.zero_grad()
            loss.backward()
            opt.step()
    [event] = guard.events
    assert event["action"] == "skip" and event["raised"]["op"] == "Tensor.index_select", event["message"]
    assert event["raised"]["index"]["in_batch"]["samples"] == [BAD], event["raised"]
    assert event["origin"]["origin"]["op"] == "Tensor.index_select", event["origin"]["origin"]
    assert "eval_faults" not in stored_meta(tmp_path / "run")
    assert not [r for r in caplog.records if "under torch.no_grad()" in r.getMessage()]
