"""Harmful, intended, unknown: the rule table, the sinks, bounded memory, both judging threads."""

from __future__ import annotations

import io
import math
from contextlib import redirect_stdout

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.analysis import origin
from trainguard.capture import _taint
from trainguard.capture._taint import (
    ALLOC,
    COPY,
    DEFAULT,
    FINITE,
    HARMFUL,
    PENDING,
    READ,
    RENORM,
    UNKNOWN,
    VIEW,
    propagate,
)
from trainguard.store import open_run
from trainguard.store._codec import NAN, NEG_INF, POS_INF

INF = float("inf")


@pytest.mark.parametrize(
    ("cls", "in_taint", "health", "want"),
    [
        (DEFAULT, FINITE, 0, (FINITE, None)),
        (DEFAULT, FINITE, POS_INF, (PENDING, 9)),  # born here
        (DEFAULT, FINITE, NAN, (HARMFUL, 9)),  # a NaN is harmful at birth
        (DEFAULT, PENDING, NAN, (HARMFUL, 3)),  # 0 * inf: the inf's origin
        (DEFAULT, PENDING, NEG_INF, (PENDING, 3)),  # passed on
        (DEFAULT, PENDING, 0, (FINITE, None)),  # absorbed
        (DEFAULT, HARMFUL, POS_INF, (HARMFUL, 3)),
        (DEFAULT, UNKNOWN, NAN, (HARMFUL, 9)),  # computing on garbage is a fault
        (VIEW, UNKNOWN, NAN, (UNKNOWN, None)),  # a view of garbage is not evidence
        (COPY, UNKNOWN, NAN, (UNKNOWN, None)),
        (VIEW, PENDING, NEG_INF, (PENDING, 3)),
        (ALLOC, FINITE, NAN, (UNKNOWN, None)),
        (RENORM, PENDING, NAN, (HARMFUL, 9)),  # softmax of a fully masked row
        (RENORM, PENDING, 0, (FINITE, None)),
        (RENORM, HARMFUL, NAN, (HARMFUL, 3)),
        (READ, PENDING, 0, (HARMFUL, 3)),  # the program reads the inf
        (READ, FINITE, 0, (FINITE, None)),
    ],
)
def test_rule_table(cls, in_taint, health, want):
    assert propagate(cls, in_taint, 3 if in_taint in (PENDING, HARMFUL) else None, health, 9) == want


def test_every_class_and_state_has_a_rule():
    for cls in range(len(_taint.CLASS_NAMES)):
        for t in (FINITE, UNKNOWN, PENDING, HARMFUL):
            assert len(_taint.RULES[cls][t]) == 3


def record(tmp_path, fn, **kw):
    with tg.record(tmp_path / "r", buffer=-1, **kw):
        fn()
    return open_run(tmp_path / "r")


def taints(run, op):
    return [e["taint"] for e in run.executions(op=op)]


def test_uninitialised_memory_and_its_views_are_unknown(tmp_path):
    def f():
        bucket = torch.empty(1000)
        view = bucket.as_strided((10, 10), (10, 1), 100)  # what DDP does with its gradient buckets
        view.copy_(torch.ones(10, 10))  # written: from now on real values
        view.mul(2)
        torch.empty(8).copy_(torch.empty(8))  # a copy of garbage is garbage

    run = record(tmp_path, f)
    assert taints(run, "empty.memory_format") == ["unknown"] * 3
    assert taints(run, "as_strided") == ["unknown"]
    assert taints(run, "copy_") == ["finite", "unknown"]
    assert taints(run, "mul.Tensor") == ["finite"]
    (view,) = run.executions(op="as_strided")
    assert all(math.isnan(view["outputs"][0]["summary"][k]) for k in ("nan", "pos_inf", "zero"))
    assert run.alerts()["total"] == 0


@pytest.mark.parametrize("how", ["tolist", "numpy", "print", "item", "format"])
def test_reading_an_inf_makes_it_harmful(tmp_path, how):
    def f():
        big = torch.tensor([1.0, 100.0]).exp() * 1e-30  # +inf, nobody has read it yet
        with redirect_stdout(io.StringIO()):
            {"tolist": lambda: big.tolist(), "numpy": lambda: big.numpy(), "print": lambda: print(big),
             "item": lambda: big[1].item(), "format": lambda: f"{big[1]:.3f}"}[how]()

    run = record(tmp_path, f)
    o = origin(run)
    assert o is not None and o.origin.op == "aten.exp" and o.reason == "read"
    with pytest.raises(tg.NonFiniteError, match="aten.exp produced \\+inf .* which was read by the program"):
        with tg.check_numerics():
            f()


def test_unread_inf_is_not_harmful_and_strict_sees_it(tmp_path):
    def f():
        torch.tensor([1.0, 100.0]).exp().sum()

    run = record(tmp_path, f)
    assert run.alerts()["total"] == 0 and origin(run) is None
    assert [g["absorbed_by"] for g in run.intended()] == [None]
    with tg.check_numerics():
        f()
    with pytest.raises(tg.NonFiniteError, match="aten.exp produced \\+inf"):
        with tg.check_numerics(strict=True):
            f()


def test_inf_written_into_a_parameter_is_harmful(tmp_path):
    m = nn.Linear(2, 2)

    def f():
        m(torch.ones(1, 2))  # parameters are known by name once their module has run
        update = torch.tensor([[0.0, 1.0], [2.0, 3.0]]).reciprocal()  # +inf at [0, 0]
        with torch.no_grad():
            m.weight.add_(update)  # a hand-written update, outside optimizer.step()

    o = origin(record(tmp_path, f))
    assert o.reason == "parameter" and o.origin.op == "aten.reciprocal" and o.chain[0].op == "aten.add_.Tensor"


def test_inf_in_the_optimizer_update_is_harmful(tmp_path):
    m = nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=1e38)

    def f():
        m(torch.ones(1, 2)).sum().backward()
        with torch.no_grad():
            m.weight.grad.mul_(10.0)  # finite, but lr * grad overflows inside step()
        opt.step()

    o = origin(record(tmp_path, f))
    assert o.reason == "optimizer" and o.origin.phase == "optimizer"


def test_the_tensor_backward_runs_from_is_the_loss_whatever_its_first_backward_op(tmp_path):
    """The +inf reaches the loss through a branch without gradient: no backward op belongs to it,
    the first one is mse_loss's (finite); the loss itself is still the sink."""
    m = nn.Linear(2, 1)

    def f():
        penalty = torch.log(torch.zeros(()))  # -inf; no gradient flows back to it
        loss = nn.functional.mse_loss(m(torch.ones(1, 2)), torch.zeros(1, 1)) - penalty  # +inf
        loss.backward()  # every gradient is finite

    o = origin(record(tmp_path, f))
    assert o is not None and o.reason == "loss" and o.origin.op == "aten.log"
    assert o.chain[0].op == "aten.sub.Tensor"
    with pytest.raises(tg.NonFiniteError, match="aten.log"):
        with tg.check_numerics():
            f()


def test_masks_in_the_forward_pass_stay_intended_through_backward(tmp_path):
    x = torch.randn(2, 4, requires_grad=True)

    def f():
        scores = x.masked_fill(torch.tensor([[False, True, False, True]] * 2), -INF)
        torch.softmax(scores, -1).pow(2).sum().backward()
        scores.amax(-1)  # max of a row with -inf: finite here

    run = record(tmp_path, f)
    assert run.alerts()["total"] == 0
    (g,) = run.intended()
    assert g["made_by"] == "aten.masked_fill.Scalar" and g["absorbed_by"] == "aten._softmax.default"
    assert g["values"] == 4 and x.grad is not None and torch.isfinite(x.grad).all()


def _edge_softmax(e, dst, nodes):
    """A softmax over each node's incoming edges, written by hand as GAT code before PyG's
    ``torch_geometric.utils.softmax`` did it: the per-node max starts at ``-inf``
    (``scatter_reduce(..., "amax")``), and a node without incoming edges keeps it."""
    mx = torch.full((nodes,), -INF).scatter_reduce(0, dst, e, "amax", include_self=True)
    a = (e - mx[dst]).exp()
    return a / torch.zeros(nodes).index_add_(0, dst, a)[dst]


@pytest.mark.parametrize("backend", ["python", "native"])
def test_an_inf_autograd_saved_is_not_a_gradient_when_backward_unpacks_it(tmp_path, backend):
    # scatter_reduce saves its -inf output for backward; the dispatch mode's detach that unpacks it
    # runs in the backward pass and was judged a gradient: check_numerics stopped a healthy GAT.
    e = torch.randn(6, requires_grad=True)
    dst = torch.tensor([0, 0, 1, 2, 2, 2])  # nodes 3 and 4: no incoming edge

    def f():
        _edge_softmax(e, dst, 5).pow(2).sum().backward()

    with tg.check_numerics():
        f()
    assert torch.isfinite(e.grad).all()
    run = record(tmp_path, f, backend=backend)
    assert run.meta["backend"] == backend
    assert run.alerts()["total"] == 0 and run.first_harm() is None
    assert [g["made_by"] for g in run.intended()] == ["aten.full.default"]


class _CausalAttention(nn.Module):
    """GPT-2's eager attention in small: scores, a causal ``-inf`` mask, softmax."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, h):
        scores = self.q(h) @ h.transpose(-1, -2)
        causal = torch.ones(3, 3, dtype=torch.bool).tril()
        return torch.softmax(torch.where(causal, scores, torch.full((), -INF)), -1) @ h


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_mask_recomputed_by_activation_checkpointing_stays_intended(tmp_path, reentrant):
    """Checkpointing runs the block's forward again inside the backward pass (transformers'
    ``gradient_checkpointing_enable``): its mask is a forward value there too, not a gradient."""
    torch.manual_seed(0)
    block = _CausalAttention()
    x = torch.randn(2, 3, 4, requires_grad=True)

    def f():
        h = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
        h.pow(2).sum().backward()

    run = record(tmp_path, f)
    assert run.alerts()["total"] == 0 and run.first_harm() is None
    assert [(g["made_by"], g["absorbed_by"]) for g in run.intended()] == [
        ("aten.full.default", "aten._softmax.default")]
    assert torch.isfinite(x.grad).all() and torch.isfinite(block.q.weight.grad).all()
    with tg.check_numerics():
        f()


def _nt_xent(z1, z2, temperature=0.5):
    """SimCLR's NT-Xent as popular repos write it (sthalles/SimCLR, the Lightning SimCLR tutorial):
    the similarity of each sample to itself masked with ``-inf``, then ``cross_entropy``, whose
    ``log_softmax`` makes ``-inf`` there (log of 0) and saves that output for its backward."""
    z = torch.nn.functional.normalize(torch.cat([z1, z2]), dim=1)
    n = z1.shape[0]
    sim = (z @ z.T / temperature).masked_fill(torch.eye(2 * n, dtype=torch.bool), -INF)
    return torch.nn.functional.cross_entropy(sim, torch.cat([torch.arange(n, 2 * n), torch.arange(n)]))


@pytest.mark.parametrize("backend", ["python", "native"])
def test_an_inf_that_autograd_saved_for_backward_is_not_a_gradient(tmp_path, backend):
    """The saved ``log_softmax`` output, unpacked in the backward pass (a ``detach`` the dispatch
    mode sees there), is a forward value its backward absorbs, not a gradient."""
    torch.manual_seed(0)
    enc = nn.Linear(6, 4)
    x1, x2 = torch.randn(3, 6), torch.randn(3, 6)

    def f():
        _nt_xent(enc(x1), enc(x2)).backward()

    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        f()
    run = open_run(tmp_path / "r")
    assert run.alerts()["total"] == 0 and run.first_harm() is None
    assert {(g["made_by"], g["absorbed_by"]) for g in run.intended()} >= {
        ("aten.masked_fill.Scalar", "aten._log_softmax.default")}
    assert torch.isfinite(enc.weight.grad).all()
    with tg.check_numerics():  # `trainguard run --check-numerics` stopped SimCLR at step 0
        f()


@pytest.mark.parametrize("backend", ["python", "native"])
def test_a_plus_inf_into_softmax_is_the_origin_of_its_nan_not_softmax(tmp_path, backend):
    """MoCo's ``logits /= self.T`` (facebookresearch/moco moco/builder.py) with a temperature of 0
    makes +inf and -inf; cross_entropy's log_softmax turns the row into NaN. Softmax absorbs a
    -inf mask by design, never a +inf: the division is the origin, and nothing is intended."""
    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(4, 8, requires_grad=True), dim=1)
    queue = torch.nn.functional.normalize(torch.randn(8, 6), dim=0)

    def f():
        logits = torch.cat([(q * q.detach()).sum(1, keepdim=True), q @ queue], dim=1)
        logits /= 0.0  # T = 0
        torch.nn.functional.cross_entropy(logits, torch.zeros(4, dtype=torch.long)).backward()

    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        f()
    run = open_run(tmp_path / "r")
    first = run.first_harm()
    assert first["op"] == "aten._log_softmax.default" and first["reason"] == "nan"
    assert run.execution(first["origin"])["op"] == "aten.div_.Tensor"
    assert run.intended() == []
    with pytest.raises(tg.NonFiniteError, match=r"^aten\.div_\.Tensor produced"):
        with tg.check_numerics():
            f()


def test_an_inf_gradient_of_a_backward_with_create_graph_is_harmful(tmp_path):
    """Grad mode is on in a backward pass that builds a graph (a gradient penalty): its infinite
    gradients are still gradients, unlike a checkpoint's recomputed forward."""
    x = torch.zeros(3, requires_grad=True)

    def f():
        (g,) = torch.autograd.grad(x.sqrt().sum(), x, create_graph=True)  # d sqrt(x) at 0: +inf
        g.sum().backward()

    o = origin(record(tmp_path, f))
    assert o is not None and o.reason == "gradient" and o.origin.phase == "backward"
    with pytest.raises(tg.NonFiniteError):
        with tg.check_numerics():
            f()


class _AdjointStep(torch.autograd.Function):
    """The adjoint method of rtqichen/torchdiffeq (torchdiffeq/_impl/adjoint.py) solves an ODE
    backwards inside its backward; its step-size controller (torchdiffeq/_impl/rk_common.py) makes
    ``max_step = torch.as_tensor(float('inf'))`` there and clamps each step with it."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        min_step, max_step = torch.as_tensor(0.0), torch.as_tensor(float("inf"))  # no step-size bound
        dt = (g.abs().max() * 0.1).clamp(min_step, max_step)
        return g * 2 * (1 + 0 * dt)


class _InfGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * torch.as_tensor(float("inf"))  # a wrong derivative: +inf


@pytest.mark.parametrize("backend", ["python", "native"])
def test_a_constant_inf_a_custom_backward_absorbs_is_intended(tmp_path, backend):
    """An +inf made from a Python constant in a backward pass is no gradient: a clamp bound that
    clamp absorbs is intended, as in a forward pass; a gradient computed from it stays harmful."""
    w = torch.ones(3, requires_grad=True)
    run = record(tmp_path / "a", lambda: _AdjointStep.apply(w * 1).sum().backward(), backend=backend)
    assert run.first_harm() is None
    assert [(g["made_by"], g["absorbed_by"]) for g in run.intended()] == [("aten.lift_fresh.default", "aten.clamp.Tensor")]

    o = origin(record(tmp_path / "b", lambda: _InfGradient.apply(w * 1).sum().backward(), backend=backend))
    assert o is not None and o.reason == "gradient" and o.origin.op == "aten.lift_fresh"


def test_writer_judges_accelerator_style_records_the_same(tmp_path):
    """With deferred summaries the hot path does not know health: the writer's thread judges."""
    import true_models as M

    runs = {}
    for strategy in ("immediate", "deferred"):
        d = tmp_path / strategy
        with tg.record(d, strategy=strategy):
            M.train_exp()
        runs[strategy] = open_run(d)
    a, b = (origin(runs[s]) for s in ("immediate", "deferred"))
    assert [c.op for c in a.chain] == [c.op for c in b.chain] == [
        "aten.mean", "aten.pow.Tensor_Scalar", "aten.sub.Tensor", "aten.exp"]
    assert a.reason == b.reason == "loss" and a.origin.line == b.origin.line
    for strategy in ("immediate", "deferred"):
        d = tmp_path / f"mask-{strategy}"
        with tg.record(d, strategy=strategy):
            M.train_gpt(2)
        run = open_run(d)
        assert run.alerts()["total"] == 0
        assert [(g["made_by"], g["absorbed_by"], g["values"]) for g in run.intended()] == [
            ("aten.masked_fill.Scalar", "aten._softmax.default", 4 * 4 * 2 * 28)]


def test_memory_stays_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(_taint, "RECORDS_MAX", 50)
    monkeypatch.setattr(_taint, "ORIGINS_MAX", 40)
    monkeypatch.setattr(_taint, "STORM_PINS", 30)
    x = torch.ones(8)
    with tg.record(tmp_path / "r", buffer=100) as rec:
        for step in range(60):
            tg.step(step)
            held = x.masked_fill(x > 0, -INF)  # a new pending origin each step, held past the step
            torch.softmax(held, 0)  # a fully masked row: NaN, harmful
            nan = held * 0
            for _ in range(5):
                nan = nan + 1  # harmful executions: the first of each op type and step is pinned
        assert len(rec.taint.records) <= 50 and len(rec.taint.origins) <= 40
        assert len(rec.taint.states) < 20  # the dead tensors' states are dropped each step
    run = open_run(tmp_path / "r")
    assert run.alerts()["total"] == 60 * 7
    # the buffer, the first chain (4) and at most 30 storm pins
    assert run.count() <= 100 + 4 + 30
    by_step = {s["step"]: s["nonfinite"] for s in run.steps()}
    assert by_step[59] == 7  # counts for every step, stored or not


def test_dead_states_are_dropped_when_the_first_drain_comes_late(tmp_path, monkeypatch):
    """The native core's drain thread may run late (a loaded machine): its first drain then
    judges many steps at once, and the states of the tensors that died in them go with it, as
    the dispatch mode drops them each step (test_memory_stays_bounded, at any time)."""
    from trainguard.capture._native import _backend

    monkeypatch.setattr(_backend.NativeBackend, "_drain_loop", lambda self: self._stop.wait())  # no drain yet
    x = torch.ones(8)
    with tg.record(tmp_path / "r", buffer=100, backend="native") as rec:
        for step in range(60):
            tg.step(step)
            held = x.masked_fill(x > 0, -INF)  # a pending origin each step, dead the next
            nan = torch.softmax(held, 0) + 1  # harmful
        rec.flush()  # the first drain, 60 steps late
        assert len(rec.taint.states) < 20, len(rec.taint.states)
    del nan
    run = open_run(tmp_path / "r")
    assert run.alerts()["total"] == 60 * 2


def test_an_origin_older_than_the_window_is_sent_again_and_kept(tmp_path):
    """The writer and its sink hold buffer + 10,000 executions; the recorder remembers pending
    ones longer and sends them again when they turn harmful."""
    x = torch.ones(1)
    with tg.record(tmp_path / "r", buffer=10):
        big = torch.tensor([100.0]).exp().mul(1e30)  # +inf, made first
        for _ in range(12_000):
            x = x + 1
        big.add(1).item()  # read long after: harmful now
    run = open_run(tmp_path / "r")
    o = origin(run)
    assert [c.op for c in o.chain] == ["aten._local_scalar_dense", "aten.add.Tensor", "aten.mul.Tensor", "aten.exp"]
    assert o.origin.seq < run.executions(run.count() - 1)[0]["seq"] - 12_000
    assert run.execution(o.origin.seq)["taint"] == "harmful"


@pytest.mark.parametrize("backend", ["python", "native"])
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_a_nan_written_by_a_multi_tensor_optimizer_is_traced_to_its_update(tmp_path, impl, backend):
    # Adam with eps=0 over zero gradients divides 0 by 0 in its update. The foreach and fused
    # kernels (foreach is Adam's default for CUDA tensors) return nothing and write the
    # parameters in place: their writes went unrecorded, and the NaN was first seen in the next
    # forward pass, as "t turned finite inputs into nan".
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    opt = torch.optim.Adam(lin.parameters(), eps=0.0, **{impl: True})
    x = torch.randn(4, 3)
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        for _ in range(2):
            opt.zero_grad()
            (lin(x) * 0).sum().backward()
            opt.step()
    o = origin(open_run(tmp_path / "r"))
    assert o.origin.phase == "optimizer" and o.origin.step == 0, (o.origin.op, o.origin.phase)
    assert o.origin.op.startswith("aten._foreach_" if impl == "foreach" else "aten._fused_adam")
    out = open_run(tmp_path / "r").execution(o.origin.seq)["outputs"]
    assert len(out) >= 2 and out[0]["shape"] == [2, 3]  # the parameters it wrote, then more


@pytest.mark.parametrize("impl", ["single", "foreach"])
def test_adams_division_by_a_zero_denominator_is_explained(tmp_path, impl):
    # The update m / (sqrt(v) + eps) is addcdiv; over zero gradients with eps=0 it is 0/0. It
    # was "addcdiv_ turned finite inputs into nan", though the run holds the zero denominators.
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    opt = torch.optim.Adam(lin.parameters(), eps=0.0, foreach=impl == "foreach")
    with tg.record(tmp_path / "r", buffer=-1):
        (lin(torch.randn(4, 3)) * 0).sum().backward()
        opt.step()
    o = origin(open_run(tmp_path / "r"))
    assert "addcdiv" in o.origin.op
    assert "zero" in o.origin.explanation and "0/0" in o.origin.explanation, o.origin.explanation


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("backend", ["python", "native"])
def test_an_inf_written_into_batch_norm_running_stats_is_harmful(tmp_path, backend, affine):
    # From pytorch/examples' imagenet (resnet18, SGD at lr=1e6): a batch whose variance overflows
    # makes running_var +inf while the training-mode output stays finite; the run said "No harmful
    # NaN or Inf" and the model, in eval mode, then gives every input the same output.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, affine=affine), nn.Linear(8, 1))
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        model(torch.randn(16, 4) * 1e20).pow(2).mean().backward()
    assert bool(model[1].running_var.isinf().all())
    first = open_run(tmp_path / "r").first_harm()
    assert first is not None and first["op"].startswith("aten.native_batch_norm")
    o = origin(open_run(tmp_path / "r"))
    assert "running_var" in o.origin.explanation and "variance" in o.origin.explanation, o.origin.explanation


class _Schedule(nn.Module):
    # From lucidrains/denoising-diffusion-pytorch's GaussianDiffusion: the noise schedule's
    # coefficients are buffers made at construction (float64, then float32), and each step gathers
    # them at the sampled timesteps (`extract`) for predict_start_from_noise.
    def __init__(self, steps: int = 5):
        super().__init__()
        alphas_cumprod = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)[1:]  # reaches 0
        self.register_buffer("sqrt_recip_alphas_cumprod", torch.sqrt(1.0 / alphas_cumprod).float())
        self.register_buffer("sqrt_recipm1_alphas_cumprod", torch.sqrt(1.0 / alphas_cumprod - 1).float())
        self.net = nn.Linear(4, 4)

    def forward(self, x_t, t):
        a = self.sqrt_recip_alphas_cumprod.gather(-1, t).reshape(-1, 1)
        b = self.sqrt_recipm1_alphas_cumprod.gather(-1, t).reshape(-1, 1)
        return (a * x_t - b * self.net(x_t)).pow(2).mean()


@pytest.mark.parametrize("backend", ["python", "native"])
def test_an_inf_a_module_holds_in_a_buffer_since_construction_keeps_its_origin(tmp_path, backend):
    # Found on lucidrains/denoising-diffusion-pytorch with a schedule whose alphas_cumprod reaches 0:
    # sqrt(1 / alphas_cumprod) is +inf in a buffer, harmless until a step draws the last timestep.
    # The report said "gather turned finite inputs into +inf" and advised a lower learning rate.
    torch.manual_seed(0)
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        model = _Schedule()
        for last in (3, 3, 4):  # timesteps 0..4; the third step draws the last one
            model(torch.randn(4, 4), torch.tensor([0, 1, 2, last])).backward()
    o = origin(open_run(tmp_path / "r"))
    assert o is not None and o.chain[0].op == "aten.sub.Tensor"  # inf - inf: the NaN
    assert o.origin.op == "aten.reciprocal", (o.origin.op, o.origin.explanation)
    assert o.origin.file.endswith("test_taint.py") and o.origin.function == "__init__"


@pytest.mark.parametrize("backend", ["python", "native"])
def test_an_inf_in_a_buffer_keeps_its_origin_through_a_deepcopy_of_the_module(tmp_path, backend):
    # Found on lucidrains/denoising-diffusion-pytorch: its Trainer keeps an EMA of the model with
    # ema_pytorch's EMA, which is `copy.deepcopy(model)`. Tensor.__deepcopy__ copies a buffer as
    # `new_empty` of it, then `set_` to a copy of its storage (no op in between reads the values):
    # the report named set_ at the EMA line, "set_ made +inf from values the compiled graph
    # computed without a summary of their own (new_empty)", and advised a lower learning rate.
    import copy

    torch.manual_seed(0)
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        model = _Schedule()
        ema = copy.deepcopy(model)
        ema(torch.randn(4, 4), torch.tensor([0, 1, 2, 4])).backward()  # draws the last timestep
    o = origin(open_run(tmp_path / "r"))
    assert o is not None and o.chain[0].op == "aten.sub.Tensor"
    assert o.origin.op == "aten.reciprocal", (o.origin.op, o.origin.explanation)
    assert o.origin.function == "__init__"
    assert "compiled graph" not in o.origin.explanation


def test_check_numerics_names_the_origin_of_an_inf_a_deepcopied_buffer_holds():
    # The same under check_numerics: it named set_ at the deepcopy's line as the op that made +inf.
    import copy

    torch.manual_seed(0)
    with pytest.raises(tg.NonFiniteError) as info:
        with tg.check_numerics():
            model = _Schedule()
            ema = copy.deepcopy(model)
            ema(torch.randn(4, 4), torch.tensor([0, 1, 2, 4]))
    msg = str(info.value)
    assert msg.startswith("aten.reciprocal produced +inf"), msg
    assert " in __init__: " in msg, msg


@pytest.mark.parametrize("backend", ["python", "native"])
def test_the_chain_says_an_op_on_a_buffer_passed_on_the_inf_the_buffer_holds(tmp_path, backend):
    # The same schedule: the origin was right, but the chain's step from the gather to it said
    # "gather turned finite inputs into +inf": its input is the buffer, which has no summary.
    torch.manual_seed(0)
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        model = _Schedule()
        model(torch.randn(4, 4), torch.tensor([0, 1, 2, 4])).backward()
    o = origin(open_run(tmp_path / "r"))
    gathers = [link for link in o.chain if link.op == "aten.gather"]
    assert gathers, [link.op for link in o.chain]
    why = gathers[0].explanation
    assert "turned finite inputs" not in why, why
    assert "buffer sqrt_recip" in why and "passed on" in why, why


@pytest.mark.parametrize("backend", ["python", "native"])
@pytest.mark.parametrize("deepcopy", [False, True])
def test_the_origin_of_an_inf_a_buffer_holds_is_kept_by_a_circular_buffer(tmp_path, backend, deepcopy):
    # `trainguard run --check-numerics` on the same schedule (its default buffer=1000, the EMA's
    # sampling 18,000 ops later): the tracker knew the reciprocal as the origin, but the chain it
    # pinned reaches the origin only through producers, and a buffer is an input by name (or, in
    # a deepcopy, the set_ of a new_empty): the reciprocal was evicted, and the report named set_.
    import copy

    from trainguard.store._codec import EVICTION_SLACK

    torch.manual_seed(0)
    with tg.record(tmp_path / "r", buffer=20, backend=backend):
        model = _Schedule()
        if deepcopy:
            model = copy.deepcopy(model)
        x, t = torch.randn(4, 4), torch.tensor([0, 1, 2, 3])
        with torch.no_grad():
            for _ in range(EVICTION_SLACK // 8):  # finite steps (8 ops each): construction leaves the window
                model(x, t)
        model(torch.randn(4, 4), torch.tensor([0, 1, 2, 4])).backward()
    o = origin(open_run(tmp_path / "r"))
    assert o is not None and o.origin.op == "aten.reciprocal", (o.origin.op, o.origin.explanation)
    assert o.origin.function == "__init__"


def _encode_boxes(gt, anchors):
    """torchvision's ``models/detection/_utils.py`` ``encode_boxes`` in small: the regression targets
    of anchors matched to an image's ground truth; an image without objects matches every anchor to
    a zero box, whose width and height give ``log(0) = -inf`` (two origins, joined by ``cat``)."""
    ew, eh = anchors[:, 2:3] - anchors[:, 0:1], anchors[:, 3:4] - anchors[:, 1:2]
    gw, gh = gt[:, 2:3] - gt[:, 0:1], gt[:, 3:4] - gt[:, 1:2]
    dx, dy = (gt[:, 0:1] - anchors[:, 0:1]) / ew, (gt[:, 1:2] - anchors[:, 1:2]) / eh
    return torch.cat((dx, dy, torch.log(gw / ew), torch.log(gh / eh)), dim=1)


@pytest.mark.parametrize("backend", ["python", "native"])
def test_infinities_of_two_origins_joined_by_one_op_are_counted_where_they_were_absorbed(tmp_path, backend):
    # pytorch/vision's RPN takes the box loss over the positive anchors only: the -inf targets of an
    # image without objects are absorbed by the index. The dh log's were reported apart, as "-inf from
    # log never reached the loss, a gradient, a parameter or a value the program read".
    anchors = torch.tensor([[0.0, 0.0, 8.0, 8.0], [4.0, 4.0, 20.0, 12.0], [2.0, 6.0, 6.0, 30.0]])
    pred = torch.randn(3, 4, requires_grad=True)

    def f():
        targets = _encode_boxes(torch.zeros(3, 4), anchors)  # the image has no objects
        positive = torch.tensor([], dtype=torch.long)
        torch.nn.functional.smooth_l1_loss(pred[positive], targets[positive], reduction="sum").backward()

    run = record(tmp_path, f, backend=backend)
    assert run.alerts()["total"] == 0
    assert run.intended() == [{"kind": "-inf", "made_by": "aten.log.default", "absorbed_by": "aten.index.Tensor",
                               "values": 6, "executions": 2}]


@pytest.mark.parametrize("backend", ["python", "native"])
def test_infinities_of_two_origins_joined_by_one_op_that_reach_the_loss_are_not_counted_intended(tmp_path, backend):
    anchors = torch.tensor([[0.0, 0.0, 8.0, 8.0], [4.0, 4.0, 20.0, 12.0], [2.0, 6.0, 6.0, 30.0]])
    pred = torch.randn(3, 4, requires_grad=True)

    def f():  # every anchor's target in the loss, as a user's RPN loss over all labelled anchors did
        targets = _encode_boxes(torch.zeros(3, 4), anchors)
        torch.nn.functional.smooth_l1_loss(pred, targets, reduction="sum").backward()

    run = record(tmp_path, f, backend=backend)
    assert run.first_harm() is not None and run.intended() == []


def test_origins_joined_with_a_long_lived_one_stay_bounded(tmp_path):
    # A causal mask made once and a padding mask made each step, added before the softmax: every step
    # joins a new origin to the causal mask's, which lives as long as the model.
    x = torch.randn(4, 4, requires_grad=True)
    steps = _taint.JOINED_MAX * 3

    def f():
        causal = torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), -INF)
        for _ in range(steps):
            padding = torch.zeros(4).masked_fill(torch.tensor([False, False, False, True]), -INF)
            torch.softmax(x + causal + padding, -1).sum().backward()

    with tg.record(tmp_path / "r", buffer=-1, backend="python") as rec:
        f()
        joined = dict(rec.taint.joined)
    assert joined and max(len(v) for v in joined.values()) <= _taint.JOINED_MAX
    run = open_run(tmp_path / "r")
    assert run.alerts()["total"] == 0
    assert {g["absorbed_by"] for g in run.intended()} == {"aten._softmax.default"}
    assert sum(g["executions"] for g in run.intended()) == steps + 1


@pytest.mark.parametrize("backend", ["python", "native"])
def test_an_inf_written_through_a_view_of_a_tensor_is_traced_to_the_write(tmp_path, backend):
    """Per-token loss weights with an inf put in by item assignment (a bad batch: an
    inverse-frequency weight of an unseen token), as in karpathy/llm.c train_gpt2.py's GPT.forward
    with its cross_entropy made per token and weighted. ``w[1] = inf`` writes through a select of
    ``w``: the view read later holds the inf that write put there, not one it made."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 5)
    x, y = torch.randn(4, 8), torch.randint(0, 5, (4,))

    def f():
        w = torch.ones(4)
        w[1] = INF  # the write
        per_token = torch.nn.functional.cross_entropy(lin(x), y, reduction="none")
        ((per_token * w.view(-1)).sum() / w.sum()).backward()

    line = f.__code__.co_firstlineno + 2
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        f()
    o = origin(open_run(tmp_path / "r"))
    assert o is not None and o.origin.op in ("aten.lift_fresh", "aten.copy_")
    assert o.origin.line == line
    with pytest.raises(tg.NonFiniteError, match=r"^aten\.(lift_fresh|copy_) produced \+inf"):
        with tg.check_numerics():
            f()


def _replay_buffer_steps(nan_obs_at: int | None = None) -> None:
    # pytorch/rl torchrl/data/replay_buffers/storages.py (LazyTensorStorage, as dqn_cartpole.py uses it):
    # the storage is allocated empty at the first extend, each collected batch written into its next
    # rows (index_put_) and the update samples rows already written. With deterministic algorithms and
    # fill_uninitialized_memory (torch's defaults then), torch.empty fills float memory with NaN.
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    storage, written = None, 0
    for step in range(4):
        obs = torch.randn(10, 4).numpy()
        if step == nan_obs_at:
            obs[3, 2] = float("nan")  # the environment's broken sensor
        batch = torch.tensor(obs)  # read from the gym environment's numpy observation
        if storage is None:
            storage = torch.empty(100, 4)
        storage[torch.arange(written, written + 10)] = batch
        written += 10
        sample = storage[torch.randint(0, written, (16,))]
        loss = net(sample).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.fixture
def nan_filled_empty():
    was, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(was)
    torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.mark.parametrize("backend", ["native", "python"])
def test_rows_written_into_uninitialised_memory_leave_the_rest_unknown(tmp_path, nan_filled_empty, backend):
    # The replay buffer's storage holds the allocation's NaN in the rows not written yet: the report
    # named index_put_ at replay_buffer.extend "in step 0" the first harmful value of a healthy run.
    run = record(tmp_path, _replay_buffer_steps, backend=backend)
    assert taints(run, "index_put_") == ["unknown"] * 4
    assert run.alerts()["total"] == 0 and origin(run) is None


@pytest.mark.parametrize("backend", ["native", "python"])
def test_a_nan_observation_written_into_the_storage_is_traced_to_where_it_was_read(tmp_path, nan_filled_empty,
                                                                                   backend):
    run = record(tmp_path, lambda: _replay_buffer_steps(nan_obs_at=2), backend=backend)
    o = origin(run)
    assert o is not None and o.origin.op == "aten.lift_fresh" and o.origin.step == 2


@pytest.mark.parametrize("backend", ["python", "native"])
def test_a_mask_that_made_a_fully_masked_row_nan_is_not_intended(tmp_path, backend):
    """bentrevett/pytorch-seq2seq legacy/4 (@ b3cd54c) masks its additive attention with
    ``attention.masked_fill(mask == 0, -1e10)``; with ``-inf`` instead and a source of length 0
    in the batch, that row is all ``-inf`` and softmax makes it NaN. The origin is the softmax,
    and the mask's ``-inf`` are no longer "intended, absorbed by softmax" in that step (the report
    said "84 intended -inf from masked_fill, absorbed by softmax" beside the NaN they made); the
    healthy step's mask before it stays intended."""
    torch.manual_seed(0)
    attn, v = nn.Linear(8, 4), nn.Linear(4, 1, bias=False)
    enc = torch.randn(3, 5, 8)  # [batch, src len, hid]

    def f(lengths):
        mask = torch.arange(5) < torch.tensor(lengths)[:, None]
        scores = v(torch.tanh(attn(enc))).squeeze(2)
        scores = scores.masked_fill(mask == 0, -INF)
        a = torch.softmax(scores, dim=1)
        torch.bmm(a.unsqueeze(1), enc).sum().backward()

    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        tg.step(0)
        f([5, 3, 2])  # healthy: 5 masked positions
        tg.step(1)
        f([5, 3, 0])  # the third source is empty: its row is all -inf
    run = open_run(tmp_path / "r")
    first = run.first_harm()
    assert first["op"] == "aten._softmax.default" and first["reason"] == "nan" and first["step"] == 1
    assert [(g["made_by"], g["absorbed_by"], g["values"], g["executions"]) for g in run.intended()] == [
        ("aten.masked_fill.Scalar", "aten._softmax.default", 5, 1)]
