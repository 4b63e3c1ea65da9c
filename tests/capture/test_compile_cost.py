"""What recording inside compiled graphs costs: the summaries it leaves out of the compiled code
(values no eager op returns) and the hand-overs it spares, with the records still those of
eager recording where eager recording has them."""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo

import trainguard as tg
from trainguard.capture._compile import plan_of
from trainguard.store import open_run


def _softmax_step(x, w):
    return (torch.softmax(x, dim=-1) * w).sum()


def _record(tmp_path, name, fn, x0, w):
    torch._dynamo.reset()
    x = x0.clone().requires_grad_()
    with tg.record(tmp_path / name, buffer=-1):
        fn(x, w).backward()
    return open_run(tmp_path / name)


def _unknown(summary: dict) -> bool:
    return all(math.isnan(summary[f]) for f in ("neg", "zero", "pos", "nan"))


def test_values_inside_a_decomposition_get_no_pass_and_its_results_keep_eager_summaries(tmp_path):
    # Inductor's graphs hold softmax as amax, sub, exp, sum, div: the first four are values
    # only the softmax itself reads (no eager op returns them), recorded without a summary pass;
    # div returns what eager's softmax returns and is summarised like it.
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand(8, 16, generator=g) * 6 - 3
    w = torch.randn(8, 16, generator=g)
    compiled = torch.compile(_softmax_step, backend=tg.compile_backend())
    with _record(tmp_path, "eager", _softmax_step, x0, w) as e, _record(tmp_path, "compiled", compiled, x0, w) as c:
        eager = e.executions(0, None, op="aten._softmax", phase="forward")
        fwd = c.executions(0, None, phase="forward")
        bwd = c.executions(0, None, phase="backward")
    by_op = {d["op"]: d for d in fwd}
    assert {"aten.amax", "aten.sub.Tensor", "aten.exp", "aten.div.Tensor"} <= set(by_op), sorted(by_op)
    for op in ("aten.amax", "aten.sub.Tensor", "aten.exp"):
        assert _unknown(by_op[op]["outputs"][0]["summary"]), (op, by_op[op]["outputs"][0]["summary"])
    # Still recorded, with their shapes: the record set does not change, only their summary.
    assert by_op["aten.exp"]["outputs"][0]["shape"] == [8, 16]
    assert len(eager) == 1
    assert by_op["aten.div.Tensor"]["outputs"][0]["summary"] == eager[0]["outputs"][0]["summary"]
    # The op after the softmax and the backward graph's results keep theirs.
    assert not _unknown(by_op["aten.mul.Tensor"]["outputs"][0]["summary"])
    summarised = [d for d in bwd if not _unknown(d["outputs"][0]["summary"])]
    assert summarised and any(d["outputs"][0]["shape"] == [8, 16] for d in summarised)


def _block(dropout=0.0):
    torch.manual_seed(0)
    return torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True,
                                            norm_first=True, dropout=dropout)


def _two_forwards(tmp_path, name, graphs=None, same_input=False):
    """Two calls of a compiled block, then one backward through both (each backward call must
    copy its own forward call's rows), twice. ``same_input``: both calls on one tensor, through
    dropout (their values differ all the same)."""
    from torch._functorch.aot_autograd import make_boxed_func

    def inner(gm, example_inputs):
        if graphs is not None:
            graphs[plan_of(gm).kind] = gm
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    model = _block(0.5 if same_input else 0.0)
    compiled = torch.compile(model, backend=tg.compile_backend(inner=inner))
    g = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g) * 3
    if same_input:
        x2 = x1
    torch.manual_seed(2)  # dropout's masks
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tg.record(tmp_path / name, buffer=-1):
        for _ in range(2):
            opt.zero_grad()
            (compiled(x1).pow(2).mean() + compiled(x2).abs().mean()).backward()
            opt.step()
    with open_run(tmp_path / name) as run:
        return [(d["seq"], d["phase"], d["op"], [o["summary"] for o in d["outputs"]])
                for d in run.executions(0, None)]


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("same_input", [False, True])
def test_backward_rows_of_forward_values_are_the_forward_calls_rows_without_a_pass(tmp_path, monkeypatch, same_input):
    # A linear layer's backward multiplies by t(W), the attention's by views of its saved
    # activations: values the forward call summarised, whose rows the backward copies from it.
    graphs: dict = {}
    copied = _two_forwards(tmp_path, "copied", graphs, same_input)
    plan = plan_of(graphs["backward"])
    assert plan.fw_rows and plan.check is not None
    # No count in the backward graph reads a saved value the forward summarised (t(W) here), nor
    # a view of one.
    summarised = plan_of(graphs["forward"]).value_rows
    saved = {n for n in graphs["backward"].graph.nodes if n.op == "placeholder" and n.name in summarised}
    assert saved
    for node in graphs["backward"].graph.nodes:
        if node.target is torch.ops.aten.lt.Scalar:
            src = node.args[0]
            assert src not in saved and not (src.op == "call_function" and src.args and src.args[0] in saved), src

    # Every row equals the row a pass over the value makes.
    from trainguard.capture import _compile_graph

    monkeypatch.setattr(_compile_graph, "_forward_row", lambda *a: None)
    passes = _two_forwards(tmp_path, "passes", same_input=same_input)
    assert len(copied) == len(passes)
    n_copied = sum(1 for t in plan.ops if any(r is not None and r >= plan.n_rows for r in t.rows))
    assert n_copied >= 4
    for (seq, phase, op, sc), (_, _, op2, sp) in zip(copied, passes):
        assert op == op2
        for a, b in zip(sc, sp):
            assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a), (seq, phase, op, a, b)


def _drains_by_thread(monkeypatch) -> dict:
    """The native core's drains, counted by the thread that made them."""
    import threading

    from trainguard.capture._native import _backend

    counts: dict[str, int] = {}
    original = _backend.NativeBackend.drain

    def drain(self):
        name = threading.current_thread().name
        counts[name] = counts.get(name, 0) + 1
        return original(self)

    monkeypatch.setattr(_backend.NativeBackend, "drain", drain)
    return counts


@pytest.mark.filterwarnings("ignore")
def test_healthy_graph_calls_leave_the_hand_over_to_the_drain_thread(tmp_path, monkeypatch):
    # Before each graph call the training thread drained the native core (the eager ops since the
    # last call: the loss, the optimizer's update) to judge them before the graph's records, and
    # again at backward() from the graph's loss: three hand-overs per step on the training thread.
    # With nothing there that the judge could change (all finite, no taint held), the records wait
    # for the drain thread and are merged in by seq; every record is still there, in order.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    compiled = torch.compile(model, backend=tg.compile_backend("aot_eager"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(compiled(x), y).backward()
        opt.step()

    counts = _drains_by_thread(monkeypatch)
    with tg.record(tmp_path / "r", backend="native", buffer=-1):
        step()
        step()  # compiled, warm
        counts.clear()
        for _ in range(4):
            step()
        on_training_thread = counts.get("MainThread", 0)
    assert on_training_thread == 0, counts
    with open_run(tmp_path / "r") as run:
        records = run.executions(0, None)
    seqs = [d["seq"] for d in records]
    assert seqs == sorted(seqs) and len(seqs) == len(set(seqs))
    ops = [d["op"] for d in records if d["step"] == 3]
    assert ops.count("aten.addmm") == 2 and ops.count("aten.nll_loss_forward") == 1
    assert sum(op.startswith("aten.addcdiv_") for op in ops) == 4  # Adam's update of 4 parameters
    phases = [d["phase"] for d in records if d["step"] == 3]
    # One pass of each phase, in order: the eager loss and update interleaved rightly with the graphs.
    runs = [p for i, p in enumerate(phases) if i == 0 or p != phases[i - 1]]
    assert runs == ["forward", "backward", "optimizer"], runs


@pytest.mark.filterwarnings("ignore")
def test_an_eager_inf_feeding_a_graph_is_judged_before_the_graph(tmp_path, monkeypatch):
    # The exception to the above: an eager -inf (a mask) is judged before the graph that takes
    # it, so that the graph's softmax is seen absorbing it (intended, not a harmful value).
    torch._dynamo.reset()

    def attend(scores):
        return torch.softmax(scores, dim=-1).sum()

    compiled = torch.compile(attend, backend=tg.compile_backend("aot_eager"))
    x = torch.randn(4, 8)
    mask = torch.ones(4, 8, dtype=torch.bool).tril()
    counts = _drains_by_thread(monkeypatch)
    with tg.record(tmp_path / "r", backend="native"):
        for _ in range(3):
            compiled(x.masked_fill(~mask, float("-inf")))
    assert counts.get("MainThread", 0) >= 3
    with open_run(tmp_path / "r") as run:
        intended, harm = run.meta.get("intended"), run.meta.get("first_harm")
    assert harm is None
    assert intended and intended[0]["made_by"] == "aten.masked_fill.Scalar"
    assert intended[0]["absorbed_by"] == "aten._softmax.default" and intended[0]["executions"] == 3


def _one_element_values(x):
    # Every kind of one-element value a graph makes (the bias corrections of a compiled optimizer
    # step, a loss, a count): negative, zero, positive, +-inf and NaN floats, an int and a bool.
    s = x.sum()
    return (s * -1, x[1:2] * 0, x.amax() + 1, x[3] * 1e39, x[3] * -1e39, s * x[4], (x > 0).sum(), (x > 0).any(),
            x.double().sum() + 0.5)


@pytest.mark.parametrize("mode", ["curt_health", "concise_health", "full_health", "stats"])
def test_one_element_values_inside_a_graph_are_summarised_as_eager_records_them(tmp_path, mode):
    x = torch.tensor([1.0, 0.0, -2.0, 3.0, float("nan")])
    compiled = torch.compile(_one_element_values, backend=tg.compile_backend(inner="aot_eager"))
    got = {}
    for name, f in (("eager", _one_element_values), ("compiled", compiled)):
        torch._dynamo.reset()
        with tg.record(tmp_path / name, mode=mode, buffer=-1):
            f(x)
        with open_run(tmp_path / name) as run:
            got[name] = [(d["op"], d["outputs"][0]["summary"]) for d in run.executions(0, None)
                         if d["outputs"] and math.prod(d["outputs"][0]["shape"]) == 1
                         and d["op"].split(".")[1] in ("mul", "add", "sum", "amax", "any")]
    assert len(got["eager"]) >= 9, got["eager"]
    assert len(got["compiled"]) == len(got["eager"]), got
    for (op_e, e), (op_c, c) in zip(got["eager"], got["compiled"]):
        assert op_e.split(".")[1] == op_c.split(".")[1], (op_e, op_c)
        assert e.keys() == c.keys() and all(_same(e[k], c[k]) for k in e), (op_e, e, c)


def _optimizer_graph(tmp_path):
    from torch._functorch.aot_autograd import make_boxed_func

    graphs = []

    def inner(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    model(torch.randn(4, 8)).sum().backward()
    step = torch.compile(opt.step, backend=tg.compile_backend(inner=inner))
    with tg.record(tmp_path / "opt", buffer=-1):
        step()
        step()
    return graphs


def test_a_compiled_optimizer_step_summarises_each_value_in_one_pass_and_a_scalar_by_its_value(tmp_path):
    # A compiled AdamW step over 4 parameters is 23 foreach ops, half of them on the one-element
    # step and bias-correction tensors. Each summarised value costs its counts' comparisons and
    # sums (5 + 5 in full_health) and its share of the "something is non-finite" flag (6), a
    # one-element value only its own value (1, and 2 for the flag): found on a compiled nanochat
    # optimizer step, whose first compile took 518 s recording against 46 s plain, the flag
    # alone adding three nodes per count to every graph.
    from trainguard.capture._compile_summary import SUMMARY_NODE

    graphs = [gm for gm in _optimizer_graph(tmp_path) if plan_of(gm).n_rows]
    assert len(graphs) == 1
    for gm in graphs:
        plan = plan_of(gm)
        numel = {}
        for t in plan.ops:
            for r, (_, shape, _) in zip(t.rows, t.outputs):
                if r is not None and 0 <= r < plan.n_rows and isinstance(shape, (list, tuple)):
                    numel.setdefault(r, math.prod(shape))
        assert len(numel) == plan.n_rows
        singles = sum(1 for n in numel.values() if n == 1)
        assert singles >= 32
        budget = 16 * (plan.n_rows - singles) + 3 * singles + 2
        added = sum(1 for n in gm.graph.nodes if n.meta.get(SUMMARY_NODE))
        assert added <= budget, (added, plan.n_rows, singles)


def test_compiling_the_same_program_again_under_recording_reuses_inductors_cached_graphs(tmp_path, monkeypatch):
    # Each graph's plan (kept on the graph module) held autograd sequence numbers, which count up
    # in a process: Inductor's FX graph cache, which hashes the graph module with its attributes,
    # missed on every compile under recording after the first in a process (a recompile, a
    # guard's replay, a second model; build-nanogpt's one-layer GPT: 27 s of CPU instead of 3 s).
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # empty: nothing to find at first
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    x = torch.randn(4, 6)
    hits = []
    for i in range(3):
        torch._dynamo.reset()
        counters.clear()
        with tg.record(tmp_path / f"r{i}", buffer=-1):
            torch.compile(model)(x).pow(2).sum().backward()
        hits.append(counters["inductor"]["fxgraph_cache_hit"])
        with open_run(tmp_path / f"r{i}") as run:
            assert run.executions(0, None, op="aten.tanh", phase="forward"), i
    torch._dynamo.reset()
    assert hits == [0, 2, 2], hits  # forward and backward graphs: compiled once, then found
