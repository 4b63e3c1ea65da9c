"""The monitor on compiled models: the same graphs, and every layer's statistics at every
``every`` step (the hooks' work runs from inside the compiled code, see _compile_monitor)."""

from __future__ import annotations

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
    _steps(torch.compile(model), model)
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
