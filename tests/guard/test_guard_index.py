"""An index out of range under the guard: one label 4 for a 4-class head (``cross_entropy``'s
``IndexError: Target 4 is out of bounds.``), a token id past an embedding's rows (``index out of
range in self``), a class past ``one_hot``'s ``num_classes``, an index past ``gather``'s dimension.
On CPU the error ended the guarded run at the first batch holding that sample. Inside a guarded
step it is a bad step now: rewound, replayed, the event names the op, the error, the samples and
the value, and the batch is skipped (later ones holding the sample unread); the same error on every
batch (a head with fewer classes than the data by design) still ends the run, with Diverged; and
outside a guarded step it is raised unchanged."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg

C = 4  # classes of the head
BAD = 70  # the sample holding label C


def _classifier_data(n=128, bad=BAD, label=C):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = torch.randint(0, C, (n,), generator=g)
    if bad is not None:
        y[bad] = label
    return TensorDataset(x, y)


def _train_classifier(tmp_path, data, *, how="cross_entropy", head=C, steps=12, ckpt=True, **guard_kw):
    """A tiny MLP classifier under ckpt.resume(..., guard=...) and loop.batches()."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, head))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = tg.TrainState(model=model, optimizer=opt, loader=DataLoader(data, batch_size=16, shuffle=True))
    guard = tg.Guard(tmp_path / "run", snapshot_every=4, **guard_kw)
    if ckpt:
        loop = tg.CheckpointManager(tmp_path / "ckpt", every_steps=1000).resume(state, total_steps=steps, guard=guard)
        batches = loop.batches()
    else:
        batches = guard.batches(state, total_steps=steps)
    for _, (x, y) in batches:
        logits = model(x)
        if how == "cross_entropy":
            loss = F.cross_entropy(logits, y)  # marker: loss line
        elif how == "nll_loss":
            loss = F.nll_loss(logits.log_softmax(-1), y)  # marker: loss line
        elif how == "one_hot":
            loss = -(F.one_hot(y, head) * logits.log_softmax(-1)).sum(-1).mean()  # marker: loss line
        else:  # gather: the log-probability of each sample's label
            loss = -logits.log_softmax(-1).gather(1, y[:, None]).mean()  # marker: loss line
        opt.zero_grad()
        loss.backward()
        opt.step()
    return guard, state


@pytest.mark.parametrize("how,op,error", [
    ("cross_entropy", "F.cross_entropy", "IndexError: Target 4 is out of bounds"),
    ("nll_loss", "F.nll_loss", "IndexError: Target 4 is out of bounds"),
    ("one_hot", "F.one_hot", "RuntimeError: Class values must be smaller than num_classes"),
    ("gather", "Tensor.gather", "RuntimeError: index 4 is out of bounds for dimension 1 with size 4"),
])
def test_a_label_out_of_range_is_a_skipped_batch_naming_its_sample(tmp_path, how, op, error):
    # 8 batches an epoch, 12 steps: the bad sample comes up once in each of two epochs
    guard, state = _train_classifier(tmp_path, _classifier_data(), how=how, ckpt=how == "cross_entropy")
    assert state.step == 12
    assert [e["action"] for e in guard.events] == ["skip"], [e["message"] for e in guard.events]
    event = guard.events[0]
    raised = event["raised"]
    assert raised["op"] == op and raised["error"].startswith(error), raised
    assert raised["index"]["values"] == [C] and raised["index"]["range"] == [0, C], raised["index"]
    assert raised["index"]["in_batch"]["samples"] == [BAD], raised["index"]
    assert BAD in event["skipped"][0]["samples"]
    assert event["origin"]["origin"]["op"] == op and event["origin"]["origin"]["line"] == raised["line"]
    assert f"{op} at " in event["message"] and f"test_guard_index.py:{raised['line']} raised {error}" in event["message"]
    assert f"(its sample {BAD} holds " in event["message"] and f"out of range for {C} " in event["message"]
    # it comes back in the second epoch: skipped unread, no second rewind
    assert guard.rewinds == 1 and [k["known_from_event"] for k in guard.skipped_known] == [1], guard.skipped_known
    assert all(torch.isfinite(p).all() for p in state.model.parameters())


def test_the_report_and_the_ui_event_show_the_index(tmp_path):
    from rich.console import Console
    from starlette.testclient import TestClient

    from trainguard.cli._report import load_report, render_report
    from trainguard.ui import create_app

    _train_classifier(tmp_path, _classifier_data(), steps=6)
    console = Console(record=True, width=300)
    render_report(console, load_report(str(tmp_path / "run")))
    text = console.export_text()
    lines, start = inspect.getsourcelines(_train_classifier)
    line = start + next(i for i, t in enumerate(lines) if "F.cross_entropy(logits, y)" in t)
    assert f"test_guard_index.py:{line} raised IndexError: Target 4 is out of bounds" in text, text
    assert f"-> skipped batch 5 (its sample {BAD} holds target 4)" in text, text
    assert "target 4 is out of range for 4 classes (0 to 3)" in text, text
    with TestClient(create_app(tmp_path)) as c:
        [e] = c.get("/api/runs/run/guard").json()["events"]
    assert e["reason"].startswith("F.cross_entropy at ") and e["reason"].endswith("Target 4 is out of bounds"), e
    assert e["outcome"] == f"skipped batch 5 (its sample {BAD} holds target 4)", e["outcome"]
    assert e["origin"]["origin"]["explanation"] == "target 4 is out of range for 4 classes (0 to 3)"
    assert e["origin"]["origin"]["health"] == [] and len(e["origin"]["chain"]) == 1  # what the UI's card reads


def test_every_batch_failing_ends_the_run_with_a_clear_error(tmp_path):
    # A 3-class head for 4-class data, by design: a quarter of the samples hold label 3, every batch
    # fails. It must stop (not skip forever), saying why.
    with pytest.raises(tg.Diverged) as info:
        _train_classifier(tmp_path, _classifier_data(bad=None), head=3, steps=40)
    event = info.value.event
    assert event["action"] in ("code_bug", "max_rewinds"), event["message"]
    assert "Target 3 is out of bounds" in str(info.value)
    assert "out of range for 3 classes (0 to 2)" in str(info.value), str(info.value)


def test_an_index_error_outside_the_guarded_step_is_raised_unchanged(tmp_path):
    data = _classifier_data()
    guard, state = _train_classifier(tmp_path, data, steps=2, ckpt=False)
    x, y = data.tensors
    with pytest.raises(IndexError, match="Target 4 is out of bounds"):
        F.cross_entropy(state.model(x), y)  # an evaluation after the loop


class _TinyLM(nn.Module):
    """karpathy/nanoGPT model.py (@3adf61e1) in small: token and position embeddings, one MLP
    block, a head over the vocabulary, cross-entropy over the flattened next tokens."""

    def __init__(self, vocab=16, block=8, dim=8):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 16), nn.GELU(), nn.Linear(16, dim))
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))  # marker: wte
        logits = self.lm_head(x + self.mlp(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def test_a_token_id_past_the_embedding_is_a_skipped_batch(tmp_path):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (64, 9), generator=g)
    tokens[21, 3] = 16  # one token id past the vocabulary (a tokenizer with more ids than the model's table)
    torch.manual_seed(0)
    model = _TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = tg.TrainState(model=model, optimizer=opt, loader=DataLoader(TensorDataset(tokens), batch_size=8))
    guard = tg.Guard(tmp_path / "run", snapshot_every=4)
    for _, (tok,) in guard.batches(state, total_steps=8):
        loss = model(tok[:, :-1], tok[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert state.step == 8
    assert [e["action"] for e in guard.events] == ["skip"], [e["message"] for e in guard.events]
    event = guard.events[0]
    assert event["raised"]["op"] == "F.embedding"
    assert event["raised"]["error"] == "IndexError: index out of range in self"
    assert event["raised"]["index"]["in_batch"]["samples"] == [21], event["raised"]["index"]
    assert "index 16 is out of range for 16 embedding rows (0 to 15)" in event["message"], event["message"]
    assert "vocabulary size" in event["origin"]["suggestion"]
    assert event["skipped"][0]["batch"] == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_lower_lr_skips_a_label_out_of_range_keeping_the_rate(tmp_path):
    # no learning rate repairs a bad label: halving it would retry the same batch until max_rewinds
    guard, state = _train_classifier(tmp_path, _classifier_data(), steps=8, ckpt=False, policy="lower_lr")
    assert state.step == 8
    assert [e["action"] for e in guard.events] == ["skip"], [e["message"] for e in guard.events]
    assert "no rate repairs an index out of range" in guard.events[0]["policy_note"]
    assert state.optimizer.param_groups[0]["lr"] == 0.1


def test_max_rewinds_spent_on_bad_labels_says_the_data_holds_many(tmp_path):
    # three samples labelled 4, in batches 0, 2 and 4 (no shuffling): max_rewinds=2 is spent on the
    # first two, and the third ends the run; the message must say why, and which samples
    data = _classifier_data(bad=None)
    data.tensors[1][[5, 37, 69]] = C
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, C))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = tg.TrainState(model=model, optimizer=opt, loader=DataLoader(data, batch_size=16))
    guard = tg.Guard(tmp_path / "run", snapshot_every=4, max_rewinds=2)
    with pytest.raises(tg.Diverged) as info:
        for _, (x, y) in guard.batches(state, total_steps=8):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    event = info.value.event
    assert event["action"] == "max_rewinds" and event["index_samples"] == [5, 37], event
    assert "every rewind went to a batch holding an index out of range (samples 5, 37)" in str(info.value), str(info.value)


def test_a_rerun_into_the_same_run_skips_the_bad_label_unread(tmp_path):
    # the stored event names the sample: a rerun (after a preemption) skips it from the start
    _train_classifier(tmp_path, _classifier_data(), steps=6, ckpt=False)
    guard, state = _train_classifier(tmp_path, _classifier_data(), steps=6, ckpt=False)
    assert state.step == 6 and guard.events == [], [e["message"] for e in guard.events]
    assert [k["known_from_event"] for k in guard.skipped_known] == [1] and BAD in guard.skipped_known[0]["samples"]


def test_a_negative_index_to_index_select_is_a_bad_step_too():
    # index_select says "INDICES element is out of DATA bounds, id=-1 axis_dim=4" for a negative
    # index (and "index out of range in self" past the end): both are an index out of range
    from trainguard.guard import _raising

    _raising.install()
    raised = _raising.Raised()
    _raising.begin(raised)
    try:
        out = torch.randn(3, 4).index_select(1, torch.tensor([2, -1]))
        note = raised.take()
    finally:
        _raising.end()
        _raising.remove()
    assert out.shape == (3, 2) and torch.isnan(out).all()
    assert note["op"] == "Tensor.index_select" and note["index"]["values"] == [-1], note
    assert note["index"]["range"] == [0, 4] and note["index"]["rows"] == [1]
