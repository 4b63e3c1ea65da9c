"""Recording inside torch.compile graphs: compiled code stays compiled, every op of its forward
and backward graphs is recorded like an eager op, with summaries computed in the compiled code.

Compiling on CPU with Inductor is slow (seconds per graph, more on a loaded machine): each model
is compiled once per configuration in a module-scoped fixture, and tests that do not need
Inductor itself use the ``aot_eager`` inner compiler.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import trainguard as tg
from trainguard.analysis import origin
from trainguard.capture._compile_graph import module_path, parse_stack_trace
from trainguard.capture._compile_run import convert
from trainguard.store import MODE_FIELDS, open_run

HERE = __file__


def line_of(marker: str) -> int:
    return next(i for i, t in enumerate(open(__file__).read().splitlines(), 1) if marker in t and "line_of" not in t)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        h = self.act(self.fc1(x))  # MARK-FC1
        return self.fc2(h)  # MARK-FC2


def _cnn():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(4 * 3 * 3, 3))


def _block():
    return nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True, norm_first=True,
                                      dropout=0.0)


MODELS = {
    "mlp": (MLP, lambda: torch.randn(6, 12)),
    "cnn": (_cnn, lambda: torch.randn(2, 3, 6, 6)),
    "transformer": (_block, lambda: torch.randn(2, 5, 8)),
}


def _train(run_model, params, x, steps=2):
    opt = torch.optim.SGD(params, lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        loss = run_model(x).pow(2).mean()
        loss.backward()
        opt.step()
    return float(loss)


def _counts() -> dict:
    return {k: dict(counters[k]) for k in ("stats", "graph_break", "frames", "recompiles")}


def _model(name):
    build, data = MODELS[name]
    torch.manual_seed(0)
    model = build()
    torch.manual_seed(1)
    return model, data()


@pytest.fixture(scope="module", params=list(MODELS))
def runs(request, tmp_path_factory):
    """Per model: Dynamo's counters compiled plain and compiled under record (Inductor, the model
    compiled after the recording started), and the same steps recorded eagerly. The plain run
    compiles with ``aot_eager``: Dynamo's graphs, breaks, frames and recompiles do not depend on
    the backend, and one Inductor compilation per model less keeps the suite fast."""
    name = request.param
    tmp = tmp_path_factory.mktemp(f"compile-{name}")
    out = {"name": name}
    torch._dynamo.reset()
    counters.clear()
    model, x = _model(name)
    out["loss_plain"] = _train(torch.compile(model, backend="aot_eager"), model.parameters(), x)
    out["plain"] = _counts()

    torch._dynamo.reset()
    counters.clear()
    model, x = _model(name)
    with tg.record(tmp / "compiled", buffer=-1):
        out["loss_rec"] = _train(torch.compile(model), model.parameters(), x)
    out["recorded"] = _counts()
    out["compiled"] = tmp / "compiled"

    model, x = _model(name)
    with tg.record(tmp / "eager", buffer=-1):
        _train(model, model.parameters(), x)
    out["eager"] = tmp / "eager"
    torch._dynamo.reset()
    return out


@pytest.mark.timeout(900)
def test_graphs_breaks_and_recompiles_are_unchanged_by_recording(runs):
    assert runs["plain"]["stats"]["unique_graphs"] == 1
    assert runs["recorded"] == runs["plain"]
    assert runs["loss_rec"] == pytest.approx(runs["loss_plain"], rel=1e-5)  # the same training
    with open_run(runs["compiled"]) as run:
        assert run.meta.get("record_errors") is None and run.meta.get("writer_error") is None
        kinds = {g["graph"].split()[-1] for g in run.meta["compiled_graphs"]}
        assert kinds == {"forward", "backward"}
        assert not run.meta.get("compiled_opaque")


def _by_key(run, step=0):
    """Executions of ``step`` keyed by (phase, op, module, output shapes), in order."""
    out: dict = {}
    for d in run.executions(0, None, step=step):
        key = (d["phase"], d["op"], d["module"], tuple(tuple(o["shape"]) for o in d["outputs"]))
        out.setdefault(key, []).append(d)
    return out


@pytest.mark.timeout(900)
def test_summaries_inside_the_graph_equal_eager_recording(runs):
    with open_run(runs["compiled"]) as c, open_run(runs["eager"]) as e:
        compiled, eager = _by_key(c), _by_key(e)
    # Keys an op holds alone in both runs (the order of equal-looking ops, q/k/v bias gradients
    # say, differs between the eager and the compiled backward).
    common = [k for k in compiled if len(compiled[k]) == 1 and len(eager.get(k, ())) == 1 and k[1] in ("aten.addmm", "aten.mm", "aten.relu", "aten.convolution",
                                                            "aten.sum.dim_IntList", "aten.max_pool2d_with_indices",
                                                            "aten.mul.Tensor", "aten.add.Tensor")]
    # The key projection's gradients are zero up to rounding (softmax ignores a shift of the
    # keys): their signs are noise, different in every implementation.
    common = [k for k in common if not (k[0] == "backward" and k[2] == "self_attn")]
    phases = {k[0] for k in common}
    assert {"forward", "backward"} <= phases, sorted(compiled)[:40]
    checked = 0
    for key in common:
        for dc, de in zip(compiled[key], eager[key]):
            for oc, oe in zip(dc["outputs"], de["outputs"]):
                sc, se = oc["summary"], oe["summary"]
                assert sc["size"] == se["size"] and sc["nan"] == se["nan"] == 0, key
                assert sc["pos_inf"] == se["pos_inf"] and sc["neg_inf"] == se["neg_inf"], key
                # Fused kernels may round a value near zero differently: counts within 2%.
                for f in ("neg", "zero", "pos"):
                    assert abs(sc[f] - se[f]) <= max(1, 0.02 * sc["size"]), (key, f, sc, se)
                checked += 1
    assert checked >= 4


def test_ops_inside_graphs_have_lines_modules_and_producers(tmp_path):
    torch._dynamo.reset()
    model, x = _model("mlp")
    compiled = torch.compile(model, backend=tg.compile_backend(inner="aot_eager"))
    with tg.record(tmp_path / "r", buffer=-1):
        _train(lambda t: compiled(t * 2.0), model.parameters(), x, steps=1)  # the graph's input made eagerly
    with open_run(tmp_path / "r") as run:
        fwd = [run.execution(d["seq"]) for d in run.executions(0, None, op="addmm", phase="forward")]
        assert [d["module"] for d in fwd] == ["fc1", "fc2"]
        assert [run.user_frame(d["stack_id"])["lineno"] for d in fwd] == [line_of("MARK-FC1"), line_of("MARK-FC2")]
        assert fwd[0]["inputs"][0] == {"slot": 0, "kind": "param", "name": "fc1.bias"}
        # fc2's input is relu's output, an edge of the graph
        relu = run.executions(0, None, op="relu", phase="forward")[0]
        assert any(i.get("producer") == relu["seq"] for i in fwd[1]["inputs"])
        # the graph's input is linked to the eager op that made it
        mul = run.executions(0, None, op="mul.Tensor", phase="forward")[0]
        assert fwd[0]["inputs"][1]["kind"] == "op" and fwd[0]["inputs"][1]["producer"] == mul["seq"]
        bwd = [run.execution(d["seq"]) for d in run.executions(0, None, op="mm", phase="backward")]
        assert bwd and all(d["fwd_seq"] is not None for d in bwd)
        for d in bwd:
            f = run.execution(d["fwd_seq"])
            assert f["phase"] == "forward" and d["module"] == f["module"]
            assert run.user_frame(d["stack_id"])["lineno"] == run.user_frame(f["stack_id"])["lineno"]
        assert {d["module"] for d in bwd} == {"fc1", "fc2"}
        # the optimizer's eager ops link to the gradients the compiled backward made
        opt = run.execution(run.executions(0, None, phase="optimizer")[0]["seq"])
        grad_producer = run.execution(opt["inputs"][1]["producer"])
        assert grad_producer["phase"] == "backward"


def test_a_graph_recorded_again_by_a_second_recording(tmp_path):
    torch._dynamo.reset()
    model, x = _model("mlp")
    compiled = torch.compile(model, backend=tg.compile_backend(inner="aot_eager"))
    for name in ("first", "second"):
        with tg.record(tmp_path / name, buffer=-1, mode="concise_health" if name == "second" else "full_health"):
            _train(compiled, model.parameters(), x, steps=1)
    with open_run(tmp_path / "second") as run:  # module and stack ids are this run's own
        fwd = run.executions(0, None, op="addmm", phase="forward")
        assert [d["module"] for d in fwd] == ["fc1", "fc2"]
        assert run.user_frame(fwd[0]["stack_id"])["lineno"] == line_of("MARK-FC1")
        assert set(fwd[0]["outputs"][0]["summary"]) == {"size", "neg_inf", "pos_inf", "nan"}  # converted
        bwd = run.execution(run.executions(0, None, op="mm", phase="backward")[0]["seq"])
        assert run.execution(bwd["fwd_seq"])["phase"] == "forward"
    torch._dynamo.reset()


# ---------------------------------------------------------------------- a NaN made inside a compiled graph
def cross_entropy(logits, onehot):
    probs = torch.softmax(logits, dim=1)
    return -(onehot * torch.log(probs)).sum(dim=1).mean()  # MARK-LOG


def _zero_prob_batch():
    torch.manual_seed(0)
    logits = torch.randn(8, 4) * 1e4  # softmax underflows to exact zeros
    onehot = nn.functional.one_hot(torch.arange(8) % 4, 4).float()
    return logits.requires_grad_(), onehot


@pytest.mark.timeout(600)
def test_check_numerics_names_the_log_inside_a_compiled_loss():
    torch._dynamo.reset()
    logits, onehot = _zero_prob_batch()
    with pytest.raises(tg.NonFiniteError) as info:
        with tg.check_numerics():
            torch.compile(cross_entropy)(logits, onehot)  # Inductor, instrumented: compiled after the start
    msg = str(info.value)
    assert msg.startswith("aten.log produced -inf"), msg
    assert "inside the compiled graph" in msg
    assert f"test_compile.py:{line_of('MARK-LOG')}" in msg and "torch.log(probs)" in msg
    assert "input 0 = div output from" in msg and "zeros" in msg  # softmax, decomposed by Inductor
    # log's -inf is harmful where onehot * -inf makes NaN: check_numerics stops there, naming both
    assert "which became NaN in aten.mul.Tensor" in msg, msg
    assert info.value.execution["op"] == "aten.mul.Tensor"
    torch._dynamo.reset()


@pytest.mark.timeout(600)
def test_report_traces_a_nan_inside_a_compiled_loss_to_its_line(tmp_path, capsys):
    from trainguard.cli import main

    torch._dynamo.reset()
    logits, onehot = _zero_prob_batch()
    with tg.record(tmp_path / "r", buffer=-1):
        torch.compile(cross_entropy)(logits, onehot).backward()
    torch._dynamo.reset()
    assert main(["report", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "First harmful value: aten.log" in out
    assert f"test_compile.py:{line_of('MARK-LOG')}" in out
    assert "torch.log(probs)" in out and "log of an input with" in out
    assert "recorded op by op" in out


def test_stats_mode_summaries_inside_the_graph(tmp_path):
    torch._dynamo.reset()
    x = torch.tensor([[-2.0, 0.0, 3.0, 1.0]])

    def f(x):
        return torch.exp(x) - 1  # MARK-EXP

    with tg.record(tmp_path / "r", mode="stats", buffer=-1):
        torch.compile(f, backend=tg.compile_backend(inner="aot_eager"))(x)
    with open_run(tmp_path / "r") as run:
        exp = run.executions(0, None, op="exp")[0]["outputs"][0]["summary"]
    want = torch.exp(x)
    assert exp["size"] == 4 and exp["pos"] == 4 and exp["nan"] == 0
    assert exp["min"] == pytest.approx(float(want.min())) and exp["max"] == pytest.approx(float(want.max()))
    assert exp["mean"] == pytest.approx(float(want.mean()))
    assert exp["std"] == pytest.approx(float(want.std(correction=0)))


@pytest.mark.parametrize("mode", ["full_health", "stats"])
def test_constant_fills_are_summarised_at_compile_time_as_eager_records_them(tmp_path, mode):
    # A full's row is built from its fill value when the graph is compiled (no pass over it):
    # the records must say what eager recording measures, NaN/inf fills and float32 rounding too.
    x = torch.tensor([[-2.0, 0.0, 3.0, 1.0]])

    def f(x):
        fills = [torch.full((3, 4), v) for v in (0.0, -2.5, 0.1, float("-inf"), float("inf"), float("nan"))]
        ints = torch.full((2,), 7, dtype=torch.int64)
        return sum(x * t for t in fills), ints

    for name, run_f in (("eager", f), ("compiled", torch.compile(f, backend=tg.compile_backend(inner="aot_eager")))):
        torch._dynamo.reset()
        with tg.record(tmp_path / name, mode=mode, buffer=-1):
            run_f(x)
    got = {}
    for name in ("eager", "compiled"):
        with open_run(tmp_path / name) as run:
            got[name] = [d["outputs"][0]["summary"] for d in run.executions(0, None, op="aten.full")]
    assert len(got["eager"]) == 7
    assert json.dumps(got["compiled"]) == json.dumps(got["eager"])  # NaN moments compare too


@pytest.mark.parametrize("mode,inner", [("full_health", "inductor"), ("concise_health", "aot_eager"),
                                        ("curt_health", "aot_eager")])
def test_selects_covering_a_tensor_are_summarised_in_one_pass_as_eager_records_them(tmp_path, mode, inner):
    # q, k and v of a packed projection (nn.MultiheadAttention's _in_projection_packed): their
    # rows come from one segmented pass over the packed tensor, and must equal eager's.
    x = torch.tensor([[-2.0, 0.0, 3.0, 1.0, 0.5, -0.1]]).repeat(4, 1)
    w = torch.randn(6, 15, generator=torch.Generator().manual_seed(0))
    w[0, :5] = 0.0
    w[:, 5] = float("inf")  # k gets -inf and +inf (and NaN from inf * 0)

    def f(x, w):
        p = (x @ w).unflatten(-1, (3, 5)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        q, k, v = p[0], p[1], p[-1]
        return q * 2, k + 1, v - 1

    for name, run_f in (("eager", f), ("compiled", torch.compile(f, backend=tg.compile_backend(inner=inner)))):
        torch._dynamo.reset()
        with tg.record(tmp_path / name, mode=mode, buffer=-1):
            run_f(x, w)
    got = {}
    for name in ("eager", "compiled"):
        with open_run(tmp_path / name) as run:
            got[name] = [d["outputs"][0]["summary"] for d in run.executions(0, None, op="aten.select")]
    assert len(got["eager"]) == 3
    assert got["compiled"] == got["eager"]
    assert any(s != got["eager"][0] for s in got["eager"][1:])  # the three rows differ


@pytest.mark.parametrize("mode", ["full_health", "curt_health"])
def test_select_backward_rows_derived_from_their_gradient_equal_eager_recording(tmp_path, mode):
    # Inductor decomposes select_backward into select_scatter(zeros, grad): its row is the
    # gradient's plus the zeros around it, with no pass; eager records select_backward itself.
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(4, 5, generator=g) for _ in range(3))
    a[0] = 0.0
    b[1, 1] = float("inf")
    c[2, 2] = float("-inf")
    x0 = torch.randn(3, 4, 5, generator=g)

    def f(x):
        q, k, v = x[0], x[1], x[2]
        return (q * a).sum() + (k * b).sum() + (v * c).sum()

    for name, run_f in (("eager", f), ("compiled", torch.compile(f, backend=tg.compile_backend()))):
        torch._dynamo.reset()
        x = x0.clone().requires_grad_()
        with tg.record(tmp_path / name, mode=mode, buffer=-1):
            run_f(x).backward()
    got = {}
    for name, op in (("eager", "aten.select_backward"), ("compiled", "aten.select_scatter")):
        with open_run(tmp_path / name) as run:
            got[name] = sorted(json.dumps(d["outputs"][0]["summary"]) for d in run.executions(0, None, op=op))
    assert len(got["eager"]) == 3 and len(set(got["eager"])) == 3
    assert got["compiled"] == got["eager"]


# ---------------------------------------------------------------------- compiled before the recording
@pytest.mark.timeout(600)
def test_a_model_compiled_before_recording_is_recorded_whole_and_the_report_says_so(tmp_path, capsys):
    from trainguard.cli import main

    torch._dynamo.reset()
    model, x = _model("mlp")
    compiled = torch.compile(model)
    _train(compiled, model.parameters(), x, steps=1)  # compiled here, with plain Inductor
    counters.clear()
    with tg.record(tmp_path / "r", buffer=-1):
        _train(compiled, model.parameters(), x, steps=2)
    assert not counters["stats"].get("unique_graphs")  # nothing recompiled
    with open_run(tmp_path / "r") as run:
        # Inductor's graph id counts the process's compilations (a cold cache; a warm one returns
        # the id of the first compilation): the id is read from the run, not assumed.
        gid = next(g["graph"] for g in run.meta["compiled_opaque"] if g["graph"].endswith("forward")).split()[0]
        whole = run.executions(0, None, op=f"compiled_graph.{gid} forward")
        assert len(whole) == 2 and run.count(op="addmm") == 0  # not seen inside
        e = run.execution(whole[0]["seq"])
        assert [i.get("name") for i in e["inputs"] if i["kind"] == "param"] == ["fc1.weight", "fc1.bias",
                                                                                 "fc2.weight", "fc2.bias"]
        assert e["outputs"][0]["summary"]["size"] == 6 * 3
        assert run.count(op=f"compiled_graph.{gid} backward", phase="backward") == 2
        assert {g["graph"] for g in run.meta["compiled_opaque"]} == {f"{gid} forward", f"{gid} backward"}
    assert main(["report", str(tmp_path / "r")]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())  # the panel wraps lines
    assert "compiled before the recording started" in out and f"graph {gid} forward (2 calls" in out
    assert "Seen: each call as one execution" in out and "Not seen: the ops inside" in out
    assert main(["report", str(tmp_path / "r"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["compiled"]["opaque_note"].startswith("Seen:") and rep["compiled"]["opaque"][0]["calls"] == 2
    torch._dynamo.reset()


@pytest.mark.timeout(600)
def test_a_nan_from_a_graph_compiled_before_recording_is_found_at_its_call(tmp_path, capsys):
    from trainguard.cli import main

    torch._dynamo.reset()
    loss = torch.compile(cross_entropy)
    ok = torch.randn(8, 4).requires_grad_()
    onehot = _zero_prob_batch()[1]
    loss(ok, onehot).backward()  # compiled here, before the recording, on healthy logits
    with tg.record(tmp_path / "r", buffer=-1):
        loss(*_zero_prob_batch()).backward()  # MARK-OPAQUE-CALL
    torch._dynamo.reset()
    with open_run(tmp_path / "r") as run:
        link = origin(run).origin
        assert link.op.startswith("compiled_graph.") and link.op.endswith("forward"), link.op
        # at the compiled function (its def: nothing finer is known) called from the marked line
        assert (link.file, link.line) == (HERE, line_of("def cross_entropy("))
        frames = [(f["filename"], f["lineno"]) for f in run.stack(run.execution(link.seq)["stack_id"])]
        assert (HERE, line_of("MARK-OPAQUE-CALL")) in frames
    assert main(["report", str(tmp_path / "r")]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "First harmful value: compiled_graph." in out and "Not seen: the ops inside" in out


# ---------------------------------------------------------------------- Dynamo's view of the program
class Breaking(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()  # the user's own graph break
        return self.b(h.relu())  # MARK-B


def _dynamo_counts(fn) -> dict:
    torch._dynamo.reset()
    counters.clear()
    fn()
    return _counts()


def test_a_graph_break_in_user_code_stays_one(tmp_path):
    def steps(record: bool):
        torch.manual_seed(0)
        model = Breaking()
        compiled = torch.compile(model, backend=tg.compile_backend(inner="aot_eager"))
        x = torch.randn(3, 4)
        if record:
            with tg.record(tmp_path / "r", buffer=-1), tg.Monitor(model, tmp_path / "r", every=1, diagnose=False):
                _train(compiled, model.parameters(), x, steps=3)
        else:
            _train(compiled, model.parameters(), x, steps=3)

    plain = _dynamo_counts(lambda: steps(False))
    recorded = _dynamo_counts(lambda: steps(True))
    assert plain["stats"]["unique_graphs"] == 2 and sum(plain["graph_break"].values()) == 1
    # The monitor's taps are ops in the graphs (calls_captured counts them): graphs, breaks,
    # frames and recompiles are the same.
    plain["stats"].pop("calls_captured")
    assert recorded["stats"].pop("calls_captured") > 0
    assert recorded == plain
    with open_run(tmp_path / "r") as run:
        b = run.executions(0, None, op="addmm", module="b", phase="forward")
        assert len(b) == 3 and run.user_frame(b[0]["stack_id"])["lineno"] == line_of("MARK-B")
        assert len(run.meta["compiled_graphs"]) == 4  # two graphs, forward and backward each
        assert {r["layer"] for r in run.layer_stats(kind="activation", stat="mean")} == {"a", "b"}
    torch._dynamo.reset()


@pytest.mark.timeout(600)
def test_check_numerics_keeps_the_graph_and_passes_a_clean_step():
    def steps(check: bool):
        model, x = _model("mlp")
        compiled = torch.compile(model, backend="inductor" if check else "aot_eager")  # checked: Inductor, instrumented
        if check:
            with tg.check_numerics():
                return _train(compiled, model.parameters(), x, steps=2)
        return _train(compiled, model.parameters(), x, steps=2)

    plain = _dynamo_counts(lambda: steps(False))
    checked = _dynamo_counts(lambda: steps(True))
    assert plain["stats"]["unique_graphs"] == 1 and checked == plain
    torch._dynamo.reset()


class Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.proj(x)).cumsum(dim=1)


@pytest.mark.timeout(600)
def test_dynamic_shapes_two_sequence_lengths(tmp_path):
    def steps(record: bool):
        torch.manual_seed(0)
        model = Seq()
        # Inductor under the recording (plain: aot_eager, the same Dynamo decisions); the second
        # length makes the sequence dim dynamic.
        compiled = torch.compile(model, backend="inductor" if record else "aot_eager")
        batches = [torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(2, 9, 4)]
        ctx = tg.record(tmp_path / "r", buffer=-1) if record else None
        if ctx:
            ctx.start()
        for x in batches:
            compiled(x).sum().backward()
        if ctx:
            ctx.stop()

    plain = _dynamo_counts(lambda: steps(False))
    recorded = _dynamo_counts(lambda: steps(True))
    assert plain["stats"]["unique_graphs"] == 2  # static, then dynamic
    assert recorded == plain
    with open_run(tmp_path / "r") as run:
        tanh = run.executions(0, None, op="tanh", phase="forward")
        assert [o["outputs"][0]["shape"] for o in tanh] == [[2, 5, 4], [2, 7, 4], [2, 9, 4]]
        assert [o["outputs"][0]["summary"]["size"] for o in tanh] == [40, 56, 72]
        grads = run.executions(0, None, op="mm", phase="backward")
        assert grads and run.meta.get("record_errors") is None
    torch._dynamo.reset()


# ---------------------------------------------------------------------- the backend on its own
def test_backend_without_recording_returns_what_plain_compile_returns():
    torch._dynamo.reset()
    model, x = _model("mlp")
    ref = model(x)
    ref.sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = torch.compile(model, backend=tg.compile_backend(inner="aot_eager"))(x)
    assert isinstance(out, torch.Tensor) and torch.allclose(out, ref)  # the summary outputs are stripped
    out.sum().backward()
    assert all(torch.allclose(p.grad, g) for p, g in zip(model.parameters(), want))
    torch._dynamo.reset()


def test_backend_rejects_bad_arguments():
    with pytest.raises(ValueError, match="mode must be one of"):
        tg.compile_backend(mode="everything")
    with pytest.raises(ValueError, match="inner must be"):
        tg.compile_backend(inner="tvm")


def test_summary_rows_convert_between_modes():
    full = MODE_FIELDS["full_health"]
    m = [(4.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0), (3.0, 0.0, 0.0, 3.0, 0.0, 1.0, 0.0)]
    assert convert(m, full, MODE_FIELDS["curt_health"]) == [(1.0,), (2.0,)]
    assert convert(m, full, MODE_FIELDS["concise_health"]) == [(4.0, 0, 0, 1), (3.0, 0, 1, 0)]
    stats = convert(m, full, MODE_FIELDS["stats"])
    assert [r[:7] for r in stats] == m and all(math.isnan(v) for r in stats for v in r[7:])


def test_module_paths_and_stack_traces_from_node_metadata():
    assert module_path("L['self'].layers.0.fc") == "layers.0.fc"
    assert module_path("L['self']._modules['enc']._modules['1']") == "enc.1"
    assert module_path("getattr(L['self'].layers, '0').fc") == "layers.0.fc"
    assert module_path("G['model']") == ""
    text = ('  File "/a/train.py", line 10, in step\n    loss = model(x)\n'
            '  File "/a/model.py", line 3, in forward\n    return self.fc(x)\n           ^^^^\n')
    assert parse_stack_trace(text) == (("/a/train.py", 10, "step"), ("/a/model.py", 3, "forward"))
    assert parse_stack_trace(None) == ()


SCRIPT = '''
import torch
from torch import nn

torch.manual_seed(0)
model = torch.compile(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(5, 6)
onehot = nn.functional.one_hot(torch.arange(5) % 3, 3).float()
for step in range(2):
    opt.zero_grad()
    probs = torch.softmax(model(x) * (1.0 if step == 0 else 1e4), dim=1)
    loss = -(onehot * torch.log(probs)).sum(dim=1).mean()
    loss.backward()
    opt.step()
'''


@pytest.mark.timeout(600)
def test_trainguard_run_records_inside_an_unmodified_compiled_script(tmp_path, capsys):
    import json

    from trainguard.cli import main

    torch._dynamo.reset()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert main(["run", "--logdir", str(tmp_path / "r"), "--buffer", "-1", str(script)]) == 0
    torch._dynamo.reset()
    capsys.readouterr()
    assert main(["report", str(tmp_path / "r"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    inside = {g["graph"].split()[-1] for g in rep["compiled"]["recorded_inside"]}
    assert inside == {"forward", "backward"} and not rep["compiled"]["opaque"]
    with open_run(tmp_path / "r") as run:
        addmm = run.executions(0, None, op="addmm", phase="forward")
        assert len(addmm) == 4 and {a["module"] for a in addmm} == {"0", "2"}
        assert run.count(op="mm", phase="backward") >= 4
    # The log is eager in this script; the NaN's origin is found across the compiled graph's output.
    link = rep["origin"]["origin"]
    assert link["op"] == "aten.log" and link["line"] == SCRIPT.splitlines().index(
        "    loss = -(onehot * torch.log(probs)).sum(dim=1).mean()") + 1


@pytest.mark.timeout(600)
def test_ops_first_seen_at_a_graph_break_keep_trainguards_callbacks_out_of_dynamo(tmp_path):
    """The native core asks Python about an op the first time it sees it (its taint class, the
    ops filter, a new stack). At a graph break the op that broke the graph runs eagerly with
    Dynamo's frame callback still set, so that Python code was compiled by Dynamo: found on
    pytorch/examples word_language_model compiled (``Tensor.item()`` breaks its encoder), where
    Dynamo compiled ``op_facts_by_name`` 8 times. Here the break is an op no test has run before
    (a custom op kept out of graphs, named for this process), so the core sees it first there."""
    import os

    @torch.library.custom_op(f"tgtest::twice_{os.getpid()}", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    twice.register_fake(lambda x: torch.empty_like(x))
    op = getattr(torch.ops.tgtest, f"twice_{os.getpid()}").default
    torch._dynamo.disallow_in_graph(op)  # Dynamo breaks the graph there and calls it eagerly

    def f(x):
        return op(x.sin()).cos().sum()

    def trainguard_code_compiled() -> list[str]:
        """trainguard's functions that Dynamo holds compiled code for."""
        import gc
        import types

        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return sorted({fn.__qualname__ for fn in gc.get_objects() if type(fn) is types.FunctionType
                       and (fn.__module__ or "").startswith("trainguard") and _debug_get_cache_entry_list(fn.__code__)})

    torch._dynamo.reset()
    counters.clear()
    plain = torch.compile(f)(torch.randn(8))
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    counters.clear()
    with tg.record(tmp_path / "r", ops=r"aten|tgtest"):
        recorded = torch.compile(f)(torch.randn(8))
    assert trainguard_code_compiled() == []
    assert counters["stats"]["unique_graphs"] == graphs == 2
    torch._dynamo.reset()
    assert recorded.shape == plain.shape
    assert any(e["op"].startswith("tgtest.twice") for e in open_run(tmp_path / "r").executions(0, None))


@pytest.mark.timeout(600)
def test_aot_autograds_first_call_check_of_custom_ops_is_not_an_unrecorded_dispatch_mode(tmp_path):
    """AOT autograd runs the first call of a graph holding a custom op (the monitor's tap, a
    user's op) under its own ``_AnalyzeCustomOpInputOutputMode``, which checks the op's aliasing,
    and rebuilds an output that is a view of an intermediate with ``aten._unsafe_view`` there.
    The native core counted that op as "not recorded: under another dispatch mode" and compiled
    runs with the monitor warned so (found on the Hugging Face Trainer with ``torch_compile=True``,
    traced to that mode with a debug build): the mode is PyTorch's own check."""
    import os

    @torch.library.custom_op(f"tgtest::scale_{os.getpid()}", mutates_args=())
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    scale.register_fake(lambda x: torch.empty_like(x))
    scale.register_autograd(lambda ctx, grad: grad * 3)

    def f(x):
        return scale(x.sin()).cos().view(2, 4)  # a view of an intermediate: AOT's _unsafe_view

    torch._dynamo.reset()
    x = torch.randn(8, requires_grad=True)
    with tg.record(tmp_path / "r"):
        for _ in range(2):
            torch.compile(f)(x).sum().backward()
    torch._dynamo.reset()
    assert "native_unsure" not in open_run(tmp_path / "r").meta


# ---------------------------------------------------------------------- many recordings in one process
def _graphs_per_recording(tmp_path, compiled, x, n=10, between=None) -> list[int]:
    """Dynamo's graph count after each of ``n`` recordings that each run ``compiled`` once
    (and ``between`` after each)."""
    out = []
    for i in range(n):
        with tg.record(tmp_path / f"r{i}"):
            compiled(x).sum().backward()
        if between is not None:
            between(x)
        out.append(counters["stats"]["unique_graphs"])
    return out


@pytest.mark.timeout(600)
def test_successive_recordings_do_not_recompile_a_model_run_only_while_recording(tmp_path):
    """The recorder's global module hooks are in the compiled frame's guards (Dynamo inlines the
    submodules' ``_call_impl``, which reads them): hooks registered anew by each recording made
    every recording recompile the model, and the eighth hit ``recompile_limit`` and ran eagerly."""
    torch._dynamo.reset()
    counters.clear()
    model, x = _model("mlp")
    got = _graphs_per_recording(tmp_path, torch.compile(model, backend=tg.compile_backend("aot_eager")), x)
    torch._dynamo.reset()
    assert got == [got[0]] * len(got), got


@pytest.mark.timeout(600)
def test_successive_recordings_do_not_recompile_a_second_copy_of_a_model_compiled_plain(tmp_path):
    """Two copies of one class share their ``forward``'s code and so its compiled entries: one
    compiled plain and run outside recordings, one compiled with trainguard's backend and run in
    each recording (the plain copy's entry, compiled without hooks, fails on its backend)."""
    torch._dynamo.reset()
    counters.clear()
    (plain, x), (ours, _) = _model("mlp"), _model("mlp")
    plain = torch.compile(plain, backend="aot_eager")
    plain(x)
    ours = torch.compile(ours, backend=tg.compile_backend("aot_eager"))
    got = _graphs_per_recording(tmp_path, ours, x, between=plain)
    torch._dynamo.reset()
    assert got == [got[0]] * len(got), got


@pytest.mark.timeout(600)
def test_recordings_and_monitors_show_a_warning_once_and_hide_torchs_global_hook_warning(tmp_path):
    """Each recording added its warning filter again, and changing the filters makes Python forget
    which warnings it has shown: a warning shown once per line (the default) came back after every
    recording. torch's warning about global hooks and ``torch.compile(module)`` is about
    trainguard's hooks (the extra call for the ``OptimizedModule`` is accounted for): not shown,
    under ``Monitor(None)`` too."""
    import warnings

    torch._dynamo.reset()
    model, x = _model("mlp")
    compiled = torch.compile(model, backend="aot_eager")

    def warn_once():
        warnings.warn("tgtest: the user's own warning", UserWarning, stacklevel=1)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for i in range(5):
            if i:  # the first round compiles (torch's compilers change the filters)
                warn_once()
            with tg.record(tmp_path / f"r{i}"):
                compiled(x).sum().backward()
            with tg.Monitor(None, tmp_path / f"m{i}", every=1, diagnose=False):
                compiled(x).sum().backward()
    torch._dynamo.reset()
    messages = [str(w.message) for w in seen]
    assert messages.count("tgtest: the user's own warning") == 1, messages
    assert not [m for m in messages if "global hooks" in m], messages


def _polar_express(g):
    """karpathy/nanochat's Muon step (nanochat/optim.py, muon_step_fused) run in bf16, cut to one
    Polar Express iteration: the pointwise ops around its matmuls are where Inductor keeps float32."""
    X = g.bfloat16()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-6)
    a, b, c = 8.156554524902461, -22.48329292557795, 15.878769915207462
    A = X @ X.mT
    B = b * A + c * (A @ A)
    X = a * X + B @ X
    return X.float()


def compiled_plain_and_recorded(fn, x, logdir):
    """``fn(x)`` compiled by plain Inductor, then compiled again under ``trainguard.record(logdir)``
    (each from a fresh Dynamo)."""
    torch._dynamo.reset()
    plain = torch.compile(fn, dynamic=False, fullgraph=True)(x)
    torch._dynamo.reset()
    with tg.record(logdir):
        recorded = torch.compile(fn, dynamic=False, fullgraph=True)(x)
    torch._dynamo.reset()
    return plain, recorded


def test_recording_computes_what_the_plain_compiled_graph_computes(tmp_path):
    # Recorded, nanochat's bf16 Muon step updated every weight differently from the plain compiled
    # step (max 4e-4 on a weight of 0.05), and its losses differed from the next step on: the
    # summaries' reads of `X` made Inductor store it in bf16 before `a * X`, which the plain graph
    # computes from float32 (its users, and the locality order that follows from them).
    g = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    plain, recorded = compiled_plain_and_recorded(_polar_express, g, tmp_path / "r")
    assert torch.equal(recorded, plain)
    run = open_run(tmp_path / "r")
    assert run.count(op="aten.bmm") == 3 and not run.alerts()["total"]


def _newton_schulz5(g):
    """KellerJordan/modded-nanogpt's zeropower_via_newtonschulz5 (records/track_1_short/
    2024-10-14_ModernArch/train_gpt2.py) in bf16, one iteration: ``c * A @ B`` is ``(c * A) @ B``."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = g.bfloat16()
    X = X / (X.norm() + 1e-7)
    A = X @ X.T
    B = A @ X
    X = a * X + b * B + c * A @ B
    return X.float()


def test_recording_computes_what_the_plain_compiled_newton_schulz_step_computes(tmp_path):
    # Recorded, the compiled Muon step's orthogonalised update differed from the plain one (max
    # 1.3e-3; 1.95387 against 1.95398 after 30 steps of the tiny GPT): the summaries' reads are
    # extra users that stop one of Inductor's post-grad patterns (with pattern_matcher off, the
    # two agree).
    g = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    plain, recorded = compiled_plain_and_recorded(_newton_schulz5, g, tmp_path / "r")
    assert torch.equal(recorded, plain)
