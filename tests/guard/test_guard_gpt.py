"""The guard on a transformer whose attention makes intended -inf every step: the origin it
names for a NaN loss is the harmful value's (the cross-entropy of a fully padded batch), not the
causal mask's -inf. ``TinyGPT`` (tests/true_models.py) is cut down from karpathy/nanoGPT's
model.py; this is the check first made on nanoGPT itself (its GPT, configure_optimizers,
clip_grad_norm_, a batch whose targets are all ignore_index)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import true_models as M
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg
from trainguard.store import open_run

from .conftest import finite

STEPS, PADDED, BS = 20, 12, 4


def cross_entropy_line() -> int:
    lines, start = inspect.getsourcelines(M.TinyGPT.forward)
    return start + next(i for i, text in enumerate(lines) if "F.cross_entropy" in text)


def gpt_state(flash: bool) -> tg.TrainState:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(1, M.VOCAB, (STEPS * BS, M.BLOCK), generator=g)
    targets = torch.roll(idx, -1, dims=1)
    targets[PADDED * BS:(PADDED + 1) * BS] = M.PAD  # every target ignored: the mean of nothing is NaN
    torch.manual_seed(0)
    # nanoGPT's attention dropout: with it SDPA takes its math path, whose causal mask is a -inf
    model = M.TinyGPT(flash, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return tg.TrainState(model=model, optimizer=opt, loader=DataLoader(TensorDataset(idx, targets), batch_size=BS))


@pytest.mark.parametrize("flash", [True, False], ids=["sdpa-is-causal", "masked-fill"])
def test_a_fully_padded_batch_names_the_cross_entropy_not_the_causal_mask(tmp_path, flash):
    state = gpt_state(flash)
    guard = tg.Guard(tmp_path / "run", snapshot_every=10)
    for _step, (idx, targets) in guard.batches(state, total_steps=STEPS):
        loss = state.model(idx, targets)
        state.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(state.model.parameters(), 1.0)
        state.optimizer.step()
    assert state.step == STEPS and finite(state)
    [event] = guard.events
    assert event["step"] == PADDED and event["trigger"] == "nonfinite_loss" and event["action"] == "skip"
    assert [b["batch"] for b in event["skipped"]] == [PADDED]
    link = event["origin"]["origin"]
    assert link["op"].startswith("aten.nll_loss") and link["phase"] == "forward" and link["step"] == PADDED
    assert Path(link["file"]).resolve() == Path(M.__file__).resolve() and link["line"] == cross_entropy_line()
    # the replayed step did see the mask's -inf, and counted it as intended
    with open_run(tmp_path / "run" / "replays" / f"step-{PADDED}") as replay:
        assert any(g["kind"] == "-inf" and g["absorbed_by"] for g in replay.intended()), replay.intended()
