"""Both recorder backends on the same programs: the same records, field for field.

See crosscheck.py for what may differ (only what the dispatch mode itself makes autograd run).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from tests_capture_crosscheck import crosscheck, sgd_program  # noqa: I001 - see conftest (path of this folder)
from torch import nn


def _mlp_adam(**opt_kw):
    def make():
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 3))
        opt = torch.optim.Adam(model.parameters(), **opt_kw)
        x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))

        def program():
            for _ in range(2):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        return program
    return make


def _digits():
    from trainguard.examples import nan_digits

    return lambda: nan_digits.train(steps=3)


def _backward_only_nan():
    # sqrt at 0 is finite forward; its gradient divides by it: +inf, made only in backward.
    w = torch.zeros(3, requires_grad=True)

    def program():
        torch.sqrt(w * w).sum().backward()
    return program


class _Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g


def _custom_function():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    return lambda: _Cube.apply(lin(x)).sum().backward()


def _checkpoint(reentrant):
    def make():
        from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        x = torch.randn(4, 8, requires_grad=True)

        def program():
            # Early stop ends the recomputation once the saved tensors are back, and the mode
            # saves more (its detaches): recompute all of it under both.
            with set_checkpoint_early_stop(False):
                checkpoint(model, x, use_reentrant=reentrant).sum().backward()
        return program
    return make


def _inference():
    lin = nn.Linear(5, 3)
    x = torch.randn(2, 5)

    def program():
        with torch.inference_mode():
            y = lin(x).relu()
            (y * 2).sum()
        with torch.no_grad():
            lin(x).exp()
    return program


def _autocast():
    lin = nn.Linear(8, 2)
    x = torch.randn(4, 8)

    def program():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lin(x).float().sum().backward()
    return program


def _transformer():
    block = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0, norm_first=True)
    opt = torch.optim.AdamW(block.parameters(), foreach=True)
    x = torch.randn(2, 5, 16)

    def program():
        opt.zero_grad()
        block(x).pow(2).mean().backward()
        opt.step()
    return program


def _odd_tensors():
    def program():
        a = torch.arange(12).reshape(3, 4)
        b = a[:, ::2].float().cumsum(0)
        c = torch.randn(4, 4, dtype=torch.float64).t().contiguous()
        d = torch.tensor([True, False]).logical_not()
        e = torch.randn(3, dtype=torch.complex64).abs()
        f = torch.cat([b.flatten(), c.flatten().float()]).split(5)
        torch.stack(list(f[:2])).half().sum()
        return d, e
    return program


def _closure():
    # optimizer.step(closure), as Lightning and LBFGS call it: the closure's forward and backward
    # are not the optimizer phase, the update is.
    def make():
        lin = nn.Linear(4, 2)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(3, 4)

        def closure():
            opt.zero_grad()
            loss = lin(x).pow(2).mean()
            loss.backward()
            return loss

        def program():
            for _ in range(2):
                opt.step(closure)
        return program
    return make


def _compiled():
    # Issue 17's recording inside compiled graphs, under each backend: the graphs' records are
    # made in Python; the native core records the eager ops around them (the loss, the update)
    # and none of the compiler's or the graphs' own.
    def make():
        import trainguard as tg

        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        return sgd_program(model, torch.compile(model, backend=tg.compile_backend("aot_eager")))
    return make


def _flow_methods():
    # normflows' Real NVP (tests/capture/flowmodel.py): most ops run in modules' methods
    # (flow.inverse, q0.log_prob) that no hook announces, named after the module by its frames.
    from tests_capture_flowmodel import NormalizingFlow, two_moons

    model = NormalizingFlow(blocks=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = two_moons(16, torch.Generator().manual_seed(0))

    def program():
        for _ in range(2):
            opt.zero_grad()
            model.forward_kld(x).backward()
            opt.step()
        with torch.no_grad():
            model.forward_kld(x)
    return program


def _function_outside_modules():
    # gpytorch's RBFCovariance: a custom Function's forward (grad off inside) with no module running.
    raw = torch.zeros((), requires_grad=True)
    x = torch.linspace(0, 1, 6)

    def program():
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                k = _Cube.apply(x[:, None] - x[None, :] * nn.functional.softplus(raw))
            if grad:
                k.sum().backward()
    return program


PROGRAMS = {
    "mlp_adam": _mlp_adam(), "mlp_adam_foreach": _mlp_adam(foreach=True), "mlp_adam_fused": _mlp_adam(fused=True),
    "nan_digits": _digits, "backward_only_nan": _backward_only_nan, "custom_function": _custom_function,
    "checkpoint": _checkpoint(False), "checkpoint_reentrant": _checkpoint(True), "inference": _inference,
    "autocast": _autocast, "transformer_foreach": _transformer, "odd_tensors": _odd_tensors,
    "closure": _closure(), "compiled": _compiled(), "flow_methods": _flow_methods,
    "function_outside_modules": _function_outside_modules,
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_same_records_in_full_health(tmp_path, name):
    problems, artefacts, py, nat = crosscheck(PROGRAMS[name], tmp_path, "full_health")
    assert len(nat["records"]) > 5
    assert problems == [], "\n".join(problems[:20])


def test_same_loss_chains_pinned(tmp_path):
    # Issue 15's loss-chain pins (the circular buffer keeps the loss op and what made its input
    # for the first backward passes): the same loss op under both backends, its window pinned.
    problems, _, py, nat = crosscheck(PROGRAMS["mlp_adam"], tmp_path, "full_health")
    assert problems == [], "\n".join(problems[:20])
    assert len(nat["loss_ends"]) == 2 and all(e > 0 for e in nat["loss_ends"])
    loss_ops = {r[0]: r[3] for r in nat["records"]}
    assert [loss_ops[e] for e in nat["loss_ends"]] == ["aten.nll_loss_forward.default"] * 2


@pytest.mark.filterwarnings("ignore")
def test_compiled_graphs_numbered_once_among_the_native_cores_records(tmp_path):
    # The graphs' records take seqs from the core (no two records share one) and the eager ops
    # around them are the core's: both present, each op recorded once.
    problems, _, py, nat = crosscheck(PROGRAMS["compiled"], tmp_path, "full_health")
    assert problems == [], "\n".join(problems[:20])
    for got in (py, nat):
        assert got["sent"] == len(got["records"])
        ops = [r[3] for r in got["records"]]
        assert ops.count("aten.addmm.default") == 4 and ops.count("aten.nll_loss_forward.default") == 2
        assert [r[0] for r in got["records"]] == list(range(len(got["records"])))
    # The compiler's own ops are not recorded (Dynamo's compile lock pauses the core), and AOT's
    # first-call check (a detach under its _AnalyzeCustomOpInputOutputMode) is not "unsure": the
    # call the mode makes is the one recorded.
    assert (nat["run"].meta.get("native_unsure") or 0) == 0


def test_compiled_graphs_numbered_once_when_the_step_hands_records_over(tmp_path, monkeypatch):
    # The optimizer step's hand-over by time (outside any graph call) ships the graphs'
    # summaries; the writer makes their rows off the training thread, where no mode records the
    # stacking (a loaded machine took this path: the harness made the rows under the mode once).
    from types import SimpleNamespace

    from trainguard.capture import _recorder_flush

    clock = itertools.count(1e12, 1e6)  # every step's check finds the hand-over late; a graph call's never does
    monkeypatch.setattr(_recorder_flush, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    problems, _, py, _ = crosscheck(PROGRAMS["compiled"], tmp_path, "full_health")
    assert problems == [], "\n".join(problems[:20])
    assert "aten.stack.default" not in [r[3] for r in py["records"]]


def test_closure_ops_are_forward_and_backward_under_both(tmp_path):
    _, _, py, nat = crosscheck(PROGRAMS["closure"], tmp_path, "full_health")
    for got in (py, nat):
        phases = [r[2] for r in got["records"]]
        assert {"forward", "backward", "optimizer"} <= set(phases)
        assert all(r[2] == "optimizer" for r in got["records"] if r[3] == "aten.add_.Tensor" and r[2] != "backward")


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("mode", ["no_tensor", "curt_health", "concise_health", "shape", "stats", "full_tensor"])
def test_same_records_in_every_mode(tmp_path, mode):
    problems, _, py, nat = crosscheck(PROGRAMS["nan_digits"], tmp_path, mode)
    assert problems == [], "\n".join(problems[:20])
    if mode != "no_tensor" and mode != "shape":
        assert any(r[7] for r in nat["records"])  # the NaN is there, in both


@pytest.mark.filterwarnings("ignore")
def test_same_records_with_deferred_summaries(tmp_path):
    # The accelerator path (device summaries stacked and copied per batch), run on CPU tensors.
    problems, _, py, nat = crosscheck(PROGRAMS["nan_digits"], tmp_path, "stats", strategy="deferred")
    assert problems == [], "\n".join(problems[:20])
    assert any(r[7] is None for r in nat["records"])  # health not known on the training thread


@pytest.mark.filterwarnings("ignore")
def test_same_records_with_filters(tmp_path):
    # Without autograd (the mode's own detaches would shift the numbers of unrecorded producers).
    def make():
        lin = nn.Linear(4, 4)
        x = torch.randn(3, 4)

        def program():
            with torch.no_grad():
                torch.relu(lin(x)).long().float().mm(torch.ones(4, 2)).sum()
        return program
    problems, _, py, nat = crosscheck(make, tmp_path, "full_health", ops=["addmm", "relu", "mm", "_to_copy"],
                                      dtypes=["float32"])
    assert problems == [], "\n".join(problems[:20])
    assert [r[3] for r in nat["records"]] == ["aten.addmm.default", "aten.relu.default", "aten._to_copy.default",
                                              "aten.mm.default"]
    assert py["records"] == nat["records"]


def test_forward_only_program_is_identical_tuple_for_tuple(tmp_path):
    # No autograd graph, so nothing the dispatch mode changes: every tuple, seq included, is equal.
    def make():
        x = torch.randn(6, 6)

        def program():
            with torch.no_grad():
                y = torch.softmax(x @ x.t(), dim=1)
                torch.log(y * 0).sum()
        return program
    problems, artefacts, py, nat = crosscheck(make, tmp_path, "full_health")
    assert artefacts == {"mode_only": 0, "replaced": 0, "plain_only": 0}
    assert py["records"] == nat["records"] and py["stacks"] == nat["stacks"]
