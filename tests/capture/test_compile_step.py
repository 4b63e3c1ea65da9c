"""A compiled optimizer step (PyTorch's "compiling the optimizer" recipe: ``torch.compile`` of a
function calling ``opt.step()``) under trainguard: Dynamo makes the same graphs as without it
(trainguard's optimizer hooks are not traced), the step's ops are recorded in the optimizer phase
at their step, steps are counted, and the monitor's optimizer hooks run at every step.

The model runs eagerly and only the step is compiled (one small graph, ``aot_eager``: Dynamo's
counters do not depend on the backend); the last test compiles a plain SGD step with Inductor,
whose ordering of the taps around the update it checks.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import trainguard as tg
from trainguard.capture import _steps
from trainguard.store import open_run

STEPS = 3


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 4))


def _adam(params):
    return torch.optim.Adam(params, lr=0.01)


def _fit(model, backend, steps=STEPS, optimizer=_adam):
    """``steps`` training steps with the optimizer step compiled by ``backend`` (None: eager)."""
    opt = optimizer(model.parameters())
    step = opt.step if backend is None else torch.compile(lambda: opt.step(), backend=backend)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        step()
    return [p.detach().clone() for p in model.parameters()]


def _counts() -> dict:
    out = {k: dict(counters[k]) for k in ("stats", "graph_break", "frames", "recompiles")}
    out["stats"].pop("calls_captured", None)  # the hooks' taps are calls in the graph
    return out


def _same_as_plain(counts, plain):
    """Dynamo's graph breaks and recompiles as without trainguard, and no break in its code. The
    hooks' two taps add two graphs of one op each: torch's optimizers break the graph before
    and after the update (``_use_grad``), and the pre and post hooks run outside it."""
    assert counts["graph_break"] == plain["graph_break"], counters["graph_break"]
    assert counts["recompiles"] == plain["recompiles"]
    assert counts["stats"]["unique_graphs"] == plain["stats"]["unique_graphs"] + 2
    assert not any("trainguard" in reason or "set_in_optimizer" in reason for reason in counts["graph_break"])


def _plain():
    torch._dynamo.reset()
    counters.clear()
    weights = _fit(_net(), "aot_eager")
    return _counts(), weights


@pytest.fixture(scope="module")
def plain():
    out = _plain()
    torch._dynamo.reset()
    return out


def _same_training(weights, want):
    assert len(weights) == len(want)
    for w, v in zip(weights, want):
        torch.testing.assert_close(w, v, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(600)
def test_a_compiled_optimizer_step_under_record_keeps_its_graph_and_its_phase_and_steps(tmp_path, plain):
    plain_counts, plain_weights = plain
    assert plain_counts["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
    counters.clear()
    model = _net()
    with tg.record(tmp_path / "r", buffer=-1):
        weights = _fit(model, tg.compile_backend(inner="aot_eager"))
        assert _steps.current_step() == STEPS  # the compiled step's hooks counted every step
    _same_as_plain(_counts(), plain_counts)
    _same_training(weights, plain_weights)
    with open_run(tmp_path / "r") as run:
        assert run.meta.get("record_errors") is None and run.meta.get("writer_error") is None
        graphs = run.meta["compiled_graphs"]
        [graph] = [g for g in graphs if g["ops"]]  # the update's graph, recorded inside
        assert len(graphs) == 3 and all(g["calls"] == STEPS for g in graphs)  # and the two taps' graphs
        # Every op of the compiled update is recorded in the optimizer phase, at its own step
        # (beside it, aot_eager's runtime copies the results into the parameters and the
        # optimizer's state, eagerly: the same ops at every step).
        per_step = [run.count(step=s, phase="optimizer") for s in range(STEPS)]
        assert per_step == [per_step[0]] * STEPS and per_step[0] >= graph["ops"], (per_step, graph)
        assert run.count(phase="other") == 0
        for s in range(STEPS):
            assert run.count(step=s, phase="forward") > 0 and run.count(step=s, phase="backward") > 0
        # The compiled step's ops read the gradients the eager backward made.
        first = run.executions(0, None, step=1, phase="optimizer")
        producers = {i.get("producer") for d in first for i in run.execution(d["seq"])["inputs"]}
        assert any(p is not None and run.execution(p)["phase"] == "backward" for p in producers)
    torch._dynamo.reset()


def _monitored(tmp, backend):
    torch._dynamo.reset()
    counters.clear()
    model = _net()
    with tg.Monitor(model, tmp, every=1, diagnose=False) as mon:
        weights = _fit(model, backend)
        assert mon.current_step == STEPS
    return _counts(), weights


@pytest.mark.timeout(600)
def test_a_compiled_optimizer_step_under_the_monitor_keeps_its_graph_and_its_statistics(tmp_path, plain):
    plain_counts, plain_weights = plain
    counts, weights = _monitored(tmp_path / "compiled", "aot_eager")
    _same_as_plain(counts, plain_counts)
    _same_training(weights, plain_weights)
    _monitored(tmp_path / "eager", None)
    with open_run(tmp_path / "compiled") as c, open_run(tmp_path / "eager") as e:
        for kind in ("gradient", "update"):
            got = {(r["layer"], r["step"]): r["value"] for r in c.layer_stats(kind=kind, stat="norm")}
            want = {(r["layer"], r["step"]): r["value"] for r in e.layer_stats(kind=kind, stat="norm")}
            assert {s for _, s in want} == set(range(STEPS)), kind
            assert set(got) == set(want), kind
            for key, v in want.items():
                assert got[key] == pytest.approx(v, rel=1e-4, abs=1e-7), (kind, key)
    torch._dynamo.reset()


class PlainSGD(torch.optim.Optimizer):
    """An optimizer whose step does not break the graph (torch's own break around the update):
    the hooks' taps and the update are traced into one graph."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


@pytest.mark.timeout(600)
def test_an_update_traced_with_the_hooks_is_recorded_between_them_and_the_monitor_reads_it(tmp_path):
    """Inductor: the pre tap runs before the update and the post tap after the parameters hold
    the new values; the update and its write-back into the parameters are the optimizer's."""
    torch._dynamo.reset()
    counters.clear()
    model = _net()
    with tg.record(tmp_path / "r", buffer=-1):
        _fit(model, tg.compile_backend(), optimizer=PlainSGD)
        assert _steps.current_step() == STEPS
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    with open_run(tmp_path / "r") as run:
        [graph] = run.meta["compiled_graphs"]
        assert [run.count(step=s, phase="optimizer") for s in range(STEPS)] == [graph["ops"]] * STEPS
        assert run.count(phase="other") == 0
        ops = {d["op"] for d in run.executions(0, None, phase="optimizer")}
        assert "aten.add.Tensor" in ops and "aten.copy_" in ops  # the update and its write-back
    for name, backend in (("compiled", "inductor"), ("eager", None)):
        torch._dynamo.reset()
        model = _net()
        with tg.Monitor(model, tmp_path / name, every=1, diagnose=False):
            _fit(model, backend, optimizer=PlainSGD)
    with open_run(tmp_path / "compiled") as c, open_run(tmp_path / "eager") as e:
        got = {(r["layer"], r["step"]): r["value"] for r in c.layer_stats(kind="update", stat="norm")}
        want = {(r["layer"], r["step"]): r["value"] for r in e.layer_stats(kind="update", stat="norm")}
        assert set(got) == set(want) and {s for _, s in want} == set(range(STEPS))
        for key, v in want.items():
            assert v > 0 and got[key] == pytest.approx(v, rel=1e-4), key
    torch._dynamo.reset()


@pytest.mark.timeout(600)
def test_successive_recordings_do_not_recompile_a_compiled_optimizer_step(tmp_path):
    """The step clock's global optimizer hooks are in the compiled step's guards (Dynamo inlines
    them): registered anew by each recording, they recompiled the step at every recording, and
    from the eighth on it ran eagerly (``recompile_limit``)."""
    torch._dynamo.reset()
    counters.clear()
    model = _net()
    opt = _adam(model.parameters())
    step = torch.compile(lambda: opt.step(), backend=tg.compile_backend(inner="aot_eager"))
    x = torch.randn(8, 10)
    graphs = []
    for i in range(9):
        with tg.record(tmp_path / f"r{i}"):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            step()
        graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert graphs == [graphs[0]] * 9, graphs
