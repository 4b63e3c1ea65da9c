"""karpathy/build-nanogpt's ``train_gpt2.py``, run by hand on CPU with trainguard (tiny config):
its ``GPT`` shrunk to one layer, with ``ignore_index=PAD`` in the loss, trained as the script
trains (``torch.compile``, bf16 autocast, AdamW); see tests/build_nanogpt.py. A zero-filled
region of a token shard makes a batch whose every target is padding.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
from build_nanogpt import BLOCK, GPT, LOSS_LINE, PAD, VOCAB, train

import trainguard as tg
from trainguard.analysis import origin
from trainguard.store import open_run


@pytest.fixture(scope="module")
def padded_run(tmp_path_factory):
    torch._dynamo.reset()
    d = tmp_path_factory.mktemp("nanogpt_padding") / "r"
    with tg.record(d):  # the default buffer, as `trainguard run` records
        losses = train()
    torch._dynamo.reset()
    return d, losses


@pytest.mark.timeout(900)
def test_a_compiled_loss_over_a_batch_of_padding_is_explained_as_averaging_over_no_target(padded_run):
    """Eager recording says "nll_loss_forward averaged over no target" for this batch. Compiled by
    Inductor, nll_loss_forward is decomposed (gather, neg, sum over the kept targets, then a
    division by the count of targets kept): the NaN shows at the div, whose numerator has no
    summary of its own. The report said "div made nan from values the compiled graph computed
    without a summary of their own (sum)" and suggested "x / (d + 1e-8)", a change the user
    cannot make inside F.cross_entropy."""
    d, losses = padded_run
    assert math.isnan(losses[2]) and not any(math.isnan(x) for x in losses[:2])
    o = origin(open_run(d))
    link = o.origin
    assert (link.step, link.phase, link.line) == (2, "forward", LOSS_LINE)
    assert "no target" in link.explanation and "ignore_index" in link.explanation, link.explanation
    assert "ignore_index" in o.suggestion and "1e-8" not in o.suggestion, o.suggestion


@pytest.mark.timeout(900)
def test_check_numerics_on_the_compiled_loss_over_padding_says_why(tmp_path):
    """The error names the op, the step and the line; the run it leaves explains why (the why: and
    fix: lines ``trainguard run --check-numerics`` prints under the error)."""
    torch._dynamo.reset()
    with pytest.raises(tg.NonFiniteError) as info:
        with tg.check_numerics(tmp_path / "r"):  # as `trainguard run --check-numerics`
            train()
    torch._dynamo.reset()
    msg = str(info.value)
    assert "in step 2, forward pass, inside the compiled graph" in msg, msg
    assert f"build_nanogpt.py:{LOSS_LINE}" in msg, msg
    # the count of targets, cast to float by prims.convert_element_type, is named as the op
    assert "prims output" not in msg and "convert_element_type output" in msg, msg
    o = origin(open_run(tmp_path / "r"))
    assert "no target" in o.origin.explanation and "1e-8" not in o.suggestion, (o.origin.explanation, o.suggestion)


class DataLoaderLite:
    """build-nanogpt's loader over one in-memory token shard: ``next_batch()`` returns (x, y) and
    advances; wrapped below as a user wraps it for ``loop.batches()``."""

    def __init__(self, tokens: torch.Tensor, B: int, T: int):
        self.tokens, self.B, self.T, self.current_position = tokens, B, T, 0

    def next_batch(self):
        B, T = self.B, self.T
        buf = self.tokens[self.current_position: self.current_position + B * T + 1]
        self.current_position += B * T
        if self.current_position + (B * T + 1) > len(self.tokens):
            self.current_position = 0
        return buf[:-1].view(B, T), buf[1:].view(B, T)


class StepBatches:
    """An endless iterable of steps, ``accum`` micro-batches each, with the loader's position as
    its state: no ``batches_yielded``, no ``len()``."""

    def __init__(self, dl: DataLoaderLite, accum: int):
        self.dl, self.accum = dl, accum

    def __iter__(self):
        while True:
            yield [self.dl.next_batch() for _ in range(self.accum)]

    def state_dict(self):
        return {"pos": self.dl.current_position}

    def load_state_dict(self, s):
        self.dl.current_position = s["pos"]


def test_the_guard_names_a_skipped_batch_of_a_loader_that_does_not_count_its_batches(tmp_path, caplog, capsys):
    """The batch of step 5 is a zero-filled region of the shard: every target is padding, the loss
    NaN. The guard skipped it and said "skipped batch None of epoch 0" (and the report "skipped
    batch None"): the loader cannot say which batch it was, but the step can."""
    import logging

    torch.manual_seed(0)
    tokens = torch.randint(1, VOCAB, (4 * BLOCK * 2 * 12 + 1,), generator=torch.Generator().manual_seed(0))
    tokens[5 * 2 * 4 * BLOCK: 6 * 2 * 4 * BLOCK + 1] = PAD  # step 5's two micro-batches
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = tg.TrainState(model=model, optimizer=opt, loader=StepBatches(DataLoaderLite(tokens, 4, BLOCK), 2))
    guard = tg.Guard(tmp_path / "run", snapshot_every=4)
    with caplog.at_level(logging.WARNING, logger="trainguard.guard"):
        for _, micro in guard.batches(state, total_steps=8):
            opt.zero_grad()
            for x, y in micro:
                _, loss = model(x, y)
                (loss / len(micro)).backward()
            opt.step()
    [event] = guard.events
    assert event["step"] == 5 and event["action"] == "skip"
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "None" not in line and line.endswith("skipped the batch of step 5"), line
    from trainguard.cli import main

    capsys.readouterr()
    assert main(["report", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "skipped the batch of step 5" in out and "None" not in out, out
