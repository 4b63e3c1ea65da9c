"""The monitor on a recommender with sparse gradients: what it copies to measure an update (an
embedding table can be most of a model's memory) and that the update statistics stay exact."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from torch import nn

from trainguard import Monitor
from trainguard.store import open_run

ROWS = (4000, 30)


def stats_of(run, step: int, layer: str, kind: str) -> dict[str, float]:
    return {r["stat"]: r["value"] for r in run.layer_stats(layer=layer, kind=kind) if r["step"] == step}


class TinyDLRM(nn.Module):
    """facebookresearch/dlrm dlrm_s_pytorch.py's DLRM_Net in small: ``nn.EmbeddingBag(mode="sum",
    sparse=True)`` tables (a large one and a small one), a bottom MLP for the dense features,
    their dot interactions and a top MLP."""

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(n, 4, mode="sum", sparse=sparse) for n in ROWS)
        self.bot_l = nn.Sequential(nn.Linear(6, 4), nn.ReLU())
        self.top_l = nn.Sequential(nn.Linear(4 + 3, 1), nn.Sigmoid())

    def forward(self, x, offsets, indices):
        feats = [self.bot_l(x)] + [e(i, o) for e, i, o in zip(self.emb_l, indices, offsets)]
        t = torch.stack(feats, dim=1)
        z = torch.bmm(t, t.transpose(1, 2))
        li, lj = torch.tril_indices(3, 3, offset=-1)
        return self.top_l(torch.cat([feats[0], z[:, li, lj]], dim=1))


def dlrm_batch(step: int):
    """Two lookups per sample; the large table's indices repeat within the batch (duplicates in its
    sparse gradient) and change from step to step."""
    g = torch.Generator().manual_seed(step)
    x = torch.rand(8, 6, generator=g)
    big = torch.randint(0, ROWS[0], (8,), generator=g).repeat_interleave(2)
    indices = [big, torch.randint(0, ROWS[1], (16,), generator=g)]
    offsets = [torch.arange(0, 16, 2)] * 2
    return x, offsets, indices, torch.rand(8, 1, generator=g)


def copies_of(t: torch.Tensor) -> int:
    """Dense tensors of ``t``'s shape and dtype alive now, other than ``t`` and its gradient: copies of it."""
    return sum(1 for o in gc.get_objects()
               if type(o) is torch.Tensor and o is not t and o is not t.grad and o.layout == torch.strided
               and o.shape == t.shape and o.dtype == t.dtype)


def copies_during_updates(model: TinyDLRM, logdir) -> dict[int, int]:
    """Copies of the large table alive as each of three SGD steps begins, monitored every 2 steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    table = model.emb_l[0].weight
    held: dict[int, int] = {}
    opt.register_step_pre_hook(lambda o, args, kwargs: held.__setitem__(len(held), copies_of(table)))
    with Monitor(model, logdir, every=2, diagnose=False):
        for step in range(3):
            x, offsets, indices, y = dlrm_batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x, offsets, indices), y).backward()
            opt.step()
    return held


def _assert_update_norms(path, ref: dict[int, float]) -> None:
    """The run's update norms of emb_l.0.weight are the ones measured by hand at each step."""
    with open_run(path) as run:
        for step, norm in ref.items():
            got = {r["stat"]: r["value"] for r in run.layer_stats(layer="emb_l.0.weight", kind="update")
                   if r["step"] == step}
            assert got["norm"] == pytest.approx(norm, rel=1e-5), step

def test_an_update_copies_no_embedding_table_whose_gradient_is_sparse(tmp_path):
    """A step changes the rows of a sparse-gradient table its batch looked up: the monitor copies
    those rows to measure the update, not the table (a recommender's tables are gigabytes)."""
    held = copies_during_updates(TinyDLRM(), tmp_path / "run")
    assert held == {0: 0, 1: 0, 2: 0}, "copies of the table held during the updates of steps 0-2"


def test_the_first_recording_holds_one_copy_of_the_weights(tmp_path):
    """At the first step the monitor does not know yet whether an optimizer or the loop's own code
    will update: it copied the weights after backward() for an update by hand, and again for the
    optimizer, holding two copies of every weight during the update."""
    held = copies_during_updates(TinyDLRM(sparse=False), tmp_path / "run")
    assert held == {0: 1, 1: 0, 2: 1}, "copies of the (dense-gradient) table held during the updates of steps 0-2"


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.5),
    lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9),  # its sparse momentum keeps moving earlier rows
    lambda ps: torch.optim.Adagrad(ps, lr=0.3),
], ids=["sgd", "sgd-momentum", "adagrad"])
def test_update_statistics_of_sparse_tables_are_exact(tmp_path, make):
    model = TinyDLRM()
    opt = make(model.parameters())
    ref = {}
    with Monitor(model, tmp_path / "run", every=1, diagnose=False):
        for step in range(4):
            x, offsets, indices, y = dlrm_batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x, offsets, indices), y).backward()
            before = [e.weight.detach().clone() for e in model.emb_l]
            opt.step()
            for k, (e, w) in enumerate(zip(model.emb_l, before)):
                u = torch.linalg.vector_norm(e.weight.detach() - w).item()
                ref[step, k] = (u, u / torch.linalg.vector_norm(w).item())
    with open_run(tmp_path / "run") as run:
        for (step, k), (norm, ratio) in ref.items():
            got = {r["stat"]: r["value"] for r in run.layer_stats(layer=f"emb_l.{k}.weight", kind="update")
                   if r["step"] == step}
            assert got["norm"] == pytest.approx(norm, rel=1e-5), (step, k)
            assert got["ratio"] == pytest.approx(ratio, rel=1e-5), (step, k)


def test_update_statistics_of_sparse_tables_under_sparse_adam(tmp_path):
    """SparseAdam for the tables, Adam for the rest (the recommenders' usual pair)."""
    model = TinyDLRM()
    tables = [p for n, p in model.named_parameters() if n.startswith("emb_l")]
    dense = [p for n, p in model.named_parameters() if not n.startswith("emb_l")]
    opts = [torch.optim.SparseAdam(tables, lr=0.05), torch.optim.Adam(dense, lr=0.05)]
    ref = {}
    with Monitor(model, tmp_path / "run", every=1, diagnose=False):
        for step in range(3):
            x, offsets, indices, y = dlrm_batch(step)
            for o in opts:
                o.zero_grad()
            nn.functional.mse_loss(model(x, offsets, indices), y).backward()
            before = model.emb_l[0].weight.detach().clone()
            for o in opts:
                o.step()
            ref[step] = torch.linalg.vector_norm(model.emb_l[0].weight.detach() - before).item()
    _assert_update_norms(tmp_path / "run", ref)


def test_update_statistics_of_a_sparse_table_updated_by_hand(tmp_path):
    """No optimizer: the loop adds the sparse gradient to the table itself."""
    model = TinyDLRM()
    ref = {}
    with Monitor(model, tmp_path / "run", every=1, diagnose=False):
        for step in range(3):
            x, offsets, indices, y = dlrm_batch(step)
            model.zero_grad()
            nn.functional.mse_loss(model(x, offsets, indices), y).backward()
            before = model.emb_l[0].weight.detach().clone()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.5)
            ref[step] = torch.linalg.vector_norm(model.emb_l[0].weight.detach() - before).item()
    _assert_update_norms(tmp_path / "run", ref)



def test_a_missing_zero_grad_of_the_sparse_optimizer_is_found(tmp_path):
    """SparseAdam for the tables, Adam for the rest, and the loop zeroes only Adam's gradients: the
    tables' sparse gradients pile up (each step appends its rows: SparseAdam steps on the sum of
    every batch so far, and the gradient grows without end)."""
    model = TinyDLRM()
    tables = [p for n, p in model.named_parameters() if n.startswith("emb_l")]
    dense = [p for n, p in model.named_parameters() if not n.startswith("emb_l")]
    sparse_opt, dense_opt = torch.optim.SparseAdam(tables, lr=0.01), torch.optim.Adam(dense, lr=0.01)
    with Monitor(model, tmp_path / "run", every=2) as mon:
        for step in range(24):
            x, offsets, indices, y = dlrm_batch(step)
            dense_opt.zero_grad()  # sparse_opt.zero_grad() forgotten
            nn.functional.mse_loss(model(x, offsets, indices), y).backward()
            sparse_opt.step()
            dense_opt.step()
    with open_run(tmp_path / "run") as run:
        stale = {r["step"]: r["value"] for r in run.layer_stats(layer="emb_l.0.weight", kind="gradient", stat="stale")}
    assert stale and all(v == 1.0 for s, v in stale.items() if s > 0), stale
    found = [f for f in mon.findings if f.kind == "gradients_accumulating"]
    assert found, [(f.kind, f.title) for f in mon.findings]
    assert "SparseAdam" in found[0].title + found[0].suggestion
    assert "emb_l.0.weight" in str(found[0].evidence)


def test_sparse_embedding_gradients_count_in_the_gradient_norm_and_the_layer_stats(tmp_path):
    model = TinyDLRM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_norms, ref_emb = [], []
    with Monitor(model, tmp_path / "run", every=1, diagnose=False):
        for step in range(3):
            x, offsets, indices, y = dlrm_batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x, offsets, indices), y).backward()
            if step == 2:  # an overflowing gradient reaches only an embedding table
                model.emb_l[1].weight.grad = model.emb_l[1].weight.grad * 1e39
            assert model.emb_l[0].weight.grad.is_sparse
            dense = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in model.parameters()]
            ref_norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in dense])).item())
            ref_emb.append(model.emb_l[0].weight.grad.to_dense())
            opt.step()
    with open_run(tmp_path / "run") as run:
        norms = [v for _, v in run.scalars("grad_norm")["grad_norm"]]
        assert norms[:2] == pytest.approx(ref_norms[:2], rel=1e-5)
        assert not math.isfinite(norms[2]) and not math.isfinite(ref_norms[2])
        for step in range(2):
            got = stats_of(run, step, "emb_l.0.weight", "gradient")
            g = ref_emb[step]
            assert got["norm"] == pytest.approx(torch.linalg.vector_norm(g).item(), rel=1e-5)
            assert got["max_abs"] == pytest.approx(g.abs().max().item(), rel=1e-6)
            assert got["mean_abs"] == pytest.approx(g.abs().mean().item(), rel=1e-5)
            assert got["nonfinite"] == 0
        assert stats_of(run, 2, "emb_l.1.weight", "gradient")["nonfinite"] > 0
