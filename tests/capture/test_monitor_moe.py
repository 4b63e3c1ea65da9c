"""The monitor on a sparse mixture of experts: experts that get no tokens on some steps are
skipped (no call, no gradient), so a layer may first run long after the first recording; an
expert that gets a handful of tokens is measured on a handful of rows."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import trainguard
from trainguard import Monitor


class Expert(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.w1 = nn.Linear(d, h)
        self.act = nn.ReLU()
        self.w2 = nn.Linear(h, d)

    def forward(self, x):
        return self.w2(self.act(self.w1(x)))


class SparseMoe(nn.Module):
    """Top-1 routing as in transformers 4.x ``models/mixtral/modeling_mixtral.py``
    (``MixtralSparseMoeBlock.forward``): a loop over the experts that got tokens, the others
    are not called that step and get no gradient."""

    def __init__(self, d: int = 8, h: int = 16, experts: int = 4):
        super().__init__()
        self.gate = nn.Linear(d, experts)
        self.experts = nn.ModuleList(Expert(d, h) for _ in range(experts))

    def forward(self, x):
        weights = F.softmax(self.gate(x), dim=-1)
        w, sel = weights.max(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            (idx,) = torch.where(sel == e)
            if idx.numel() == 0:
                continue
            out.index_add_(0, idx, expert(x[idx]) * w[idx, None])
        return out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = SparseMoe()
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(x + self.moe(x))


def test_an_expert_first_routed_to_late_keeps_its_place_in_forward_order(tmp_path):
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():  # the router follows the first four features: expert e gets the rows where x[:, e] is largest
        model.moe.gate.weight.copy_(torch.eye(4, 8) * 10)
        model.moe.gate.bias.zero_()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Monitor(model, tmp_path / "run", every=5):
        for step in range(12):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(32, 8, generator=g)
            if step < 7:
                x[:, 3] = -5.0  # no row goes to expert 3 before step 7
            loss = F.cross_entropy(model(x), x[:, :3].argmax(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    order = trainguard.open(tmp_path / "run").meta["monitor"]["order"]
    assert "moe.experts.3.w1" in order
    # expert 3 ran first at step 10, after the head had run: it still comes before the head
    assert order.index("moe.experts.2.w2") < order.index("moe.experts.3.w1") < order.index("head")


def test_an_expert_that_gets_a_row_or_two_is_not_called_dead(tmp_path):
    # davidmrau/mixture-of-experts example.py: 10 experts, top-4 of 5 rows. An expert that gets one
    # row has about half of its ReLU units at 0 "for every sample" of that row: chance, not death.
    # Eight experts over four rows each step, top-1: every expert sees 0-4 rows.
    torch.manual_seed(0)
    moe = SparseMoe(d=8, h=32, experts=8)
    opt = torch.optim.Adam(moe.parameters(), lr=1e-3)
    with Monitor(moe, tmp_path / "run", every=2) as mon:
        for step in range(24):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(4, 8, generator=g)
            loss = (moe(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    rows = {r["value"] for r in trainguard.open(tmp_path / "run").layer_stats(kind="activation")
            if r["layer"].endswith(".act") and r["stat"] == "dead_rows"}
    assert rows and max(rows) <= 4
    assert not [f for f in mon.findings if f.kind == "dead_units"], [f.title for f in mon.findings]


def test_dead_units_of_an_expert_that_gets_many_rows_are_found(tmp_path):
    torch.manual_seed(0)
    moe = SparseMoe(d=8, h=32, experts=2)
    with torch.no_grad():
        moe.experts[1].w1.bias.fill_(-100.0)  # every unit of expert 1 is dead
    opt = torch.optim.SGD(moe.parameters(), lr=1e-3)
    with Monitor(moe, tmp_path / "run", every=2) as mon:
        for step in range(24):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(64, 8, generator=g)
            loss = (moe(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    dead = [f for f in mon.findings if f.kind == "dead_units"]
    assert dead and dead[0].layers == ["experts.1.act"], [f.title for f in mon.findings]


def test_an_expert_routed_to_only_between_recordings_is_not_said_to_never_get_a_gradient(tmp_path):
    # Top-1 of 8 experts over 2 rows: most experts get no row on most steps (no call, grad None),
    # and an expert routed to only at steps the monitor does not record was named among the
    # parameters that "never received a gradient". Expert 7 never gets a row: that one is named.
    torch.manual_seed(0)
    moe = SparseMoe(d=8, h=16, experts=8)
    with torch.no_grad():  # expert e gets the rows where x[:, e] is largest
        moe.gate.weight.copy_(torch.eye(8) * 10)
        moe.gate.bias.zero_()
    opt = torch.optim.Adam(moe.parameters(), lr=1e-3)
    with Monitor(moe, tmp_path / "run", every=4) as mon:  # records steps 0, 4, 8, 12
        for step in range(16):
            x = torch.full((2, 8), -1.0)
            x[0, step % 4] = 1.0  # experts 0-3 in turn: 1, 2 and 3 never at a recorded step
            x[1, 4 + (step % 2)] = 1.0  # expert 4 at even steps, 5 at odd ones
            if step % 4 == 1:
                x[1, 6] = 2.0  # expert 6 at steps 1, 5, 9, 13
            loss = (moe(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    found = [f for f in mon.findings if f.kind == "param_no_gradient"]
    assert found, [f.title for f in mon.findings]
    assert set(found[0].evidence["params"]) == {
        "experts.7.w1.weight", "experts.7.w1.bias", "experts.7.w2.weight", "experts.7.w2.bias"}


def train_routed(cls, tmp_path, starved) -> Monitor:
    """Four experts whose router follows input features 0-3 (an identity gate), 8 steps under a
    monitor recording every 2nd, with the features ``starved`` pushed to -5: their experts get no row."""
    torch.manual_seed(0)
    moe = cls(d=8, h=16, experts=4)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.eye(4, 8) * 10)
        moe.gate.bias.zero_()
    opt = torch.optim.Adam(moe.parameters(), lr=1e-3)
    with Monitor(moe, tmp_path / "run", every=2) as mon:
        for step in range(8):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            x[:, starved] = -5.0
            loss = (moe(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return mon


def test_experts_the_router_never_picks_are_named_as_such(tmp_path):
    # Experts 2 and 3 of four never get a row: they are members of the experts ModuleList whose
    # siblings get gradients, so the advice is about routing, not about a .detach() on the path.
    mon = train_routed(SparseMoe, tmp_path, slice(2, 4))  # the router sends every row to expert 0 or 1
    (found,) = [f for f in mon.findings if f.kind == "param_no_gradient"]
    assert found.evidence["never_routed"] == {"experts": ["2", "3"]}
    assert "experts.2, experts.3" in found.suggestion and "load-balancing" in found.suggestion, found.suggestion


class DispatchMoe(SparseMoe):
    """Dispatch as davidmrau/mixture-of-experts ``moe.py`` (``SparseDispatcher``): the batch is
    split by each expert's row count and every expert is called, on an empty split when it got no
    row (its gradient is then all zero, not None)."""

    def forward(self, x):
        weights = F.softmax(self.gate(x), dim=-1)
        w, sel = weights.max(dim=-1)
        order = torch.argsort(sel)
        sizes = torch.bincount(sel, minlength=len(self.experts)).tolist()
        parts = torch.split(x[order], sizes)
        out = torch.cat([e(part) for e, part in zip(self.experts, parts)]) * w[order, None]
        return torch.zeros_like(x).index_add(0, order, out)


def test_experts_called_on_empty_splits_only_are_named_as_never_routed(tmp_path):
    mon = train_routed(DispatchMoe, tmp_path, 3)  # expert 3 is called on 0 rows every step
    (found,) = [f for f in mon.findings if f.kind == "param_zero_gradient"]
    assert found.evidence["never_routed"] == {"experts": ["3"]}
    assert "experts.3" in found.suggestion and "load-balancing" in found.suggestion, found.suggestion


class Stack(nn.Module):
    """A stack of blocks run one after the other, as transformers' ``LlamaModel.forward``
    (``models/llama/modeling_llama.py``: ``for decoder_layer in self.layers``), with the first
    block's output detached: the bug planted in a huggingface/trl ``DPOTrainer`` run
    (``trl/trainer/dpo_trainer.py``) on a 2-layer random-init Llama."""

    def __init__(self, d: int = 8, blocks: int = 3):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.layers = nn.ModuleList(Expert(d, 16) for _ in range(blocks))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.embed(x)
        for i, block in enumerate(self.layers):
            h = h + block(h)
            if i == 0:
                h = h.detach()
        return self.head(h)


def test_a_block_of_a_layer_stack_cut_off_by_detach_is_not_called_an_unrouted_expert(tmp_path):
    # Every block runs on every row of every step: the one without a gradient is behind a
    # .detach(), not an expert the router never sent a token (it was called, on the whole batch).
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Monitor(model, tmp_path / "run", every=2) as mon:
        for step in range(8):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            loss = F.cross_entropy(model(x), x[:, :3].argmax(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    (found,) = [f for f in mon.findings if f.kind == "param_no_gradient"]
    assert "layers.0.w1.weight" in found.evidence["params"] and "embed.weight" in found.evidence["params"]
    assert "never_routed" not in found.evidence, found.evidence
    assert "router" not in found.suggestion and ".detach()" in found.suggestion, found.suggestion
