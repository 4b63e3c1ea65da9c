"""The monitor on compiled models: the same graphs, and every layer's statistics at every
``every`` step (the hooks' work runs from inside the compiled code, see _compile_monitor)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import trainguard as tg
from trainguard.store import open_run


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 16)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


LAYERS = {"fc1", "act", "fc2"}


def _steps(run_model, model, n=5):
    torch.manual_seed(1)
    x, y = torch.randn(8, 10), torch.randint(0, 4, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(n):
        opt.zero_grad()
        nn.functional.cross_entropy(run_model(x), y).backward()
        opt.step()


def _counts() -> dict:
    out = {k: dict(counters[k]) for k in ("stats", "graph_break", "frames", "recompiles")}
    out["stats"].pop("calls_captured", None)  # the taps are calls in the graph
    return out


def _monitored(tmp, backend, compiled_first=False):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net()
    compiled = torch.compile(model, backend=backend)
    with tg.Monitor(compiled, tmp, every=2, diagnose=False):
        _steps(compiled, model)
    return _counts()


@pytest.fixture(scope="module")
def inductor_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mon")
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net()
    _steps(torch.compile(model, backend="aot_eager"), model)  # Dynamo's counts do not depend on the backend
    plain = _counts()
    monitored = _monitored(tmp / "compiled", "inductor")
    torch.manual_seed(0)
    model = Net()
    with tg.Monitor(model, tmp / "eager", every=2, diagnose=False):
        _steps(model, model)
    torch._dynamo.reset()
    return plain, monitored, tmp / "compiled", tmp / "eager"


@pytest.mark.timeout(600)
def test_monitor_keeps_the_graphs(inductor_runs):
    plain, monitored, _, _ = inductor_runs
    assert plain["stats"]["unique_graphs"] == 1
    assert monitored == plain


@pytest.mark.timeout(600)
def test_every_layer_at_every_recording_step_as_in_eager(inductor_runs):
    _, _, compiled, eager = inductor_runs
    with open_run(compiled) as c, open_run(eager) as e:
        got = {(r["layer"], r["step"], r["stat"]): r["value"] for r in c.layer_stats(kind="activation")}
        want = {(r["layer"], r["step"], r["stat"]): r["value"] for r in e.layer_stats(kind="activation")}
        assert {(layer, step) for layer, step, _ in got} == {(la, s) for la in LAYERS for s in (0, 2, 4)}
        assert set(got) == set(want)
        for key, v in want.items():
            assert got[key] == pytest.approx(v, rel=1e-4, abs=1e-6), key
        inputs = {r["step"] for r in c.layer_stats(kind="input")}
        assert inputs == {0, 2, 4}
        assert {r["step"] for r in c.layer_stats(kind="gradient", stat="norm")} == {0, 2, 4}
        assert len(c.scalars()["loss"]) == 5


def test_monitor_finds_a_compiled_model_by_itself(tmp_path):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net()
    compiled = torch.compile(model, backend="aot_eager")
    with tg.Monitor(None, tmp_path / "m", every=2, diagnose=False) as mon:
        _steps(compiled, model, n=4)
        assert set(mon.layers) == LAYERS  # the model's own names, not _orig_mod.*
    # Its global discovery hook stays once Dynamo compiled (Dynamo guards on global hooks).
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
    with open_run(tmp_path / "m") as run:
        assert {(r["layer"], r["step"]) for r in run.layer_stats(kind="activation", stat="mean")} == {
            (la, s) for la in LAYERS for s in (0, 2)}
    torch._dynamo.reset()


def test_successive_monitors_that_find_a_compiled_model_do_not_recompile_it(tmp_path):
    """Each ``Monitor(None)`` registered a global discovery pre-hook of its own, under a new id
    in a dict Dynamo guards on: every monitor recompiled the model, from the eighth on eagerly."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net()
    compiled = torch.compile(model, backend="aot_eager")
    graphs = []
    for i in range(9):
        with tg.Monitor(None, tmp_path / f"m{i}", every=2, diagnose=False):
            _steps(compiled, model, n=2)
        graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert graphs == [1] * 9, graphs
    with open_run(tmp_path / "m8") as run:  # the last one still sees inside the compiled code
        assert {r["layer"] for r in run.layer_stats(kind="activation", stat="mean")} == LAYERS


def test_record_and_monitor_together_keep_the_graph(tmp_path):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net()
    compiled = torch.compile(model, backend="aot_eager")
    _steps(compiled, model, n=3)
    plain = _counts()

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net()
    with tg.record(tmp_path / "r", buffer=-1):
        compiled = torch.compile(model, backend=tg.compile_backend(inner="aot_eager"))
        with tg.Monitor(compiled, tmp_path / "r", every=1, diagnose=False):
            _steps(compiled, model, n=3)
    assert _counts() == plain
    with open_run(tmp_path / "r") as run:
        assert run.count(op="tanh", phase="forward") == 3
        assert {r["layer"] for r in run.layer_stats(kind="activation")} == LAYERS
    torch._dynamo.reset()


class LossInForward(nn.Module):
    """A model that computes its own loss, as karpathy/nanoGPT's GPT.forward(idx, targets) does:
    the monitor's wrapped functional loss is traced into the compiled graph."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x, targets=None):
        logits = self.fc2(torch.tanh(self.fc1(x)))
        loss = None if targets is None else nn.functional.cross_entropy(logits, targets)
        return logits, loss


def _train_and_evaluate(run_model, model, steps=4):
    """Training steps with a no-grad evaluation (model.eval(), as nanoGPT's estimate_loss) after
    every second one."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
    xv, yv = torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        opt.zero_grad()
        run_model(x, y)[1].backward()
        opt.step()
        if s % 2 == 1:
            model.eval()
            with torch.no_grad():
                run_model(xv, yv)
            model.train()


def _loss_in_forward_run(tmp, compiled: bool, monitor: bool):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = LossInForward()
    run_model = torch.compile(model, backend="aot_eager") if compiled else model
    with tg.Monitor(run_model, tmp, every=2, diagnose=False) if monitor else contextlib.nullcontext():
        _train_and_evaluate(run_model, model)
    return _counts()


def test_a_loss_computed_inside_a_compiled_forward_keeps_the_graphs_and_its_validation_loss(tmp_path):
    plain = _loss_in_forward_run(None, compiled=True, monitor=False)
    monitored = _loss_in_forward_run(tmp_path / "compiled", compiled=True, monitor=True)
    _loss_in_forward_run(tmp_path / "eager", compiled=False, monitor=True)
    torch._dynamo.reset()
    assert monitored == plain
    with open_run(tmp_path / "compiled") as c, open_run(tmp_path / "eager") as e:
        want = e.scalars("val_loss").get("val_loss", [])
        got = c.scalars("val_loss").get("val_loss", [])
        assert len(want) == 2
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5)
        assert len(c.scalars("loss")["loss"]) == len(e.scalars("loss")["loss"]) == 4


@pytest.mark.timeout(600)
def test_a_compiled_submodule_keeps_its_layers_names(tmp_path):
    """``model.net = torch.compile(net)`` makes ``net`` an OptimizedModule holding the layers under
    ``_orig_mod``: the monitor names them as the model does (``net.fc1``), as the recorder does,
    not ``net._orig_mod.fc1`` (found on tests/integrations/lit_mlp.py with its net compiled)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Module()
    model.net = torch.compile(Net(), backend="aot_eager")
    model.forward = lambda x: model.net(x)
    with tg.Monitor(model, tmp_path / "m", every=2, diagnose=False):
        _steps(model, model, n=3)
    torch._dynamo.reset()
    stats = open_run(tmp_path / "m").layer_stats()
    assert {r["layer"] for r in stats if r["kind"] == "activation"} == {f"net.{name}" for name in LAYERS}
    assert {r["layer"] for r in stats if r["kind"] == "weight"} >= {"net.fc1.weight", "net.fc2.bias"}
