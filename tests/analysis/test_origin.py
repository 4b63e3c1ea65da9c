"""The walk back to the first NaN/Inf and its explanation."""

from __future__ import annotations

import inspect
import os
import sys

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.analysis import origin
from trainguard.examples import nan_digits
from trainguard.store import open_run


def line_in(module, text: str) -> int:
    return next(i for i, t in enumerate(inspect.getsource(module).splitlines(), 1) if text in t)


def record(tmp_path, fn, mode="full_health"):
    with tg.record(tmp_path / "r", mode=mode, buffer=-1):
        fn()
    return open_run(tmp_path / "r")


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("digits") / "r"
    with tg.record(d, buffer=-1):
        history = nan_digits.train()
    return open_run(d), history


def test_reference_scenario_origin(digits_run):
    run, history = digits_run
    o = origin(run)
    link = o.origin
    assert link.op == "aten.log" and link.phase == "forward"
    assert link.file == nan_digits.__file__ and link.line == line_in(nan_digits, "torch.log(probs)")
    first_nan_step = next(h["step"] for h in history if h["loss"] != h["loss"])
    assert link.step == first_nan_step
    assert link.health == ["-inf"]
    assert link.explanation.startswith("log of an input with") and "zeros -> -inf" in link.explanation
    (inp,) = link.inputs
    assert inp["producer_op"] == "aten._softmax"
    assert inp["line"] == line_in(nan_digits, "torch.softmax(logits")
    assert inp["summary"]["zero"] > 0
    assert "log_softmax" in o.suggestion and "clamp" in o.suggestion
    assert f"{nan_digits.__file__}:{link.line}" in o.summary and "holds" in o.summary


def test_chain_from_a_later_op_explains_0_times_inf(digits_run):
    run, _ = digits_run
    first = run.first_nonfinite()["seq"]
    mul = next(e for e in run.executions(op="mul.Tensor", health="nan") if e["seq"] > first)
    o = origin(run, mul["seq"])
    assert [c.op for c in o.chain] == ["aten.mul.Tensor", "aten.log"]
    assert o.chain[0].explanation == "0 * inf -> NaN: one input holds infinities and the other zeros"
    assert o.origin.seq == first


def test_division_by_zero(tmp_path):
    x = torch.tensor([1.0, 2.0])

    def f():
        d = x - x
        return (x / d).sum().item()  # the program reads the +inf: harmful

    o = origin(record(tmp_path, f))
    assert [c.op for c in o.chain] == ["aten._local_scalar_dense", "aten.sum", "aten.div.Tensor"]
    assert o.reason == "read"
    assert o.origin.op == "aten.div.Tensor"
    assert o.origin.explanation == "division by a zero denominator: 2 zeros in the denominator"
    assert "1e-8" in o.suggestion


def test_division_by_a_count_of_zero_is_told_to_clamp_the_count_not_add_an_epsilon(tmp_path):
    # A loss averaged over the samples a mask selects, planted in timm's train.py: the count is an
    # int64 0 and the fix said "x / (d + 1e-8)", which divides by 1e-8 instead of by 0.
    logits = torch.randn(8, 4, requires_grad=True)
    target = torch.randint(0, 4, (8,))

    def f():
        losses = torch.nn.functional.cross_entropy(logits, target, reduction="none")
        n_valid = (target > 3).sum()
        loss = (losses * (target > 3)).sum() / n_valid
        loss.backward()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten.div.Tensor"
    # (a count of a comparison's mask: the masked-count fix, `mask.sum().clamp_min(1)`, applies)
    assert ("clamp(min=1)" in o.suggestion or "clamp_min(1)" in o.suggestion) and "1e-8" not in o.suggestion, \
        o.suggestion


def test_a_row_of_logs_of_zeros_into_log_softmax_is_not_called_a_masked_row(tmp_path):
    # log(0) makes the -inf, a softmax over the row makes the NaN: the fix is the log's (a
    # clamp), not a mask's (found with torch.compile and activation checkpointing, same eager).
    def f():
        p = torch.zeros(2, 3)
        return torch.log_softmax(torch.log(p), 1).sum().item()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten._log_softmax"
    assert "masked" not in o.origin.explanation and "log of zeros" in o.origin.explanation, o.origin.explanation
    assert "clamp the input before the log" in o.suggestion, o.suggestion


def test_a_log_of_zero_added_to_logits_then_chunked_into_log_softmax_names_the_log(tmp_path):
    # litgpt's pretrain loop with a planted `logits + torch.log(torch.zeros(()))`: its
    # chunked_cross_entropy reshapes the logits and splits them into chunks before cross_entropy, so
    # the -inf reaches log_softmax through an add, a view and a split. The report said "a fully
    # masked row" and told to check the padding or attention mask; there is no mask: the -infs are
    # the log's, and its line is the one to fix.
    logits = torch.randn(2, 4, 8, requires_grad=True)
    targets = torch.randint(0, 8, (2, 4))

    def f():
        x = logits + torch.log(torch.zeros(()))  # the planted log(0)
        chunks = x.reshape(-1, 8).split(4)
        losses = [torch.nn.functional.cross_entropy(c, t, reduction="none")
                  for c, t in zip(chunks, targets.reshape(-1).split(4))]
        torch.cat(losses).mean().backward()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten._log_softmax"
    text = o.origin.explanation
    assert "masked" not in text and "log of zeros" in text and "aten.log" in text, text
    assert f"test_origin.py:{line_in(sys.modules[__name__], 'the planted log(0)')}" in text, text
    assert "clamp" in o.suggestion and "mask" not in o.suggestion, o.suggestion


def test_a_fully_masked_row_of_an_additive_mask_made_by_log_stays_a_masked_row(tmp_path):
    # `scores + mask.log()` with a 0/1 mask (0 and -inf out of the log) is a mask: a row masked
    # whole is the mask's fault, as with masked_fill.
    scores = torch.randn(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])

    def f():
        torch.softmax(scores + mask.log(), 1).sum().backward()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten._softmax"
    assert "fully masked row" in o.origin.explanation and "log of zeros" not in o.origin.explanation, \
        o.origin.explanation


@pytest.mark.parametrize("complement", [False, True])
def test_a_hand_written_binary_cross_entropy_is_told_to_take_the_log_on_the_logits(tmp_path, complement):
    # pytorch/examples dcgan/main.py with nn.BCELoss written out by hand: the discriminator's
    # Sigmoid saturates (exactly 1.0, or 0.0) and log(output) / log(1 - output) is -inf. A clamp
    # hides it; the log of a sigmoid belongs on the logits (F.logsigmoid, BCEWithLogitsLoss).
    disc = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    with torch.no_grad():
        disc[0].weight.fill_(50.0 if complement else -50.0)

    def f():
        output = disc(torch.ones(8, 4)).view(-1, 1).squeeze(1)
        label = torch.zeros(8) if complement else torch.ones(8)
        loss = -(label * torch.log(output) + (1 - label) * torch.log(1 - output)).mean()
        loss.backward()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten.log"
    assert "logsigmoid" in o.suggestion and "binary_cross_entropy_with_logits" in o.suggestion, o.suggestion
    assert ("F.logsigmoid(-x)" in o.suggestion) == complement, o.suggestion


def test_a_log_of_a_softmax_keeps_the_softmax_fix(tmp_path):
    def f():
        logits = torch.tensor([[0.0, -200.0, 5.0]], requires_grad=True)
        torch.log(torch.softmax(logits, 1)).sum().backward()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten.log"
    assert "log_softmax" in o.suggestion and "logsigmoid" not in o.suggestion, o.suggestion


def test_zero_over_zero_under_summaries_without_zero_counts(tmp_path):
    # check_numerics' runs are curt_health: no zero counts. A NaN quotient of finite values is
    # 0/0 (an overflow makes inf, never NaN); it was explained as "the quotient overflowed".
    x = torch.tensor([1.0, 2.0])

    def f():
        d = x - x
        return (d / d).sum().item()

    o = origin(record(tmp_path, f, mode="curt_health"))
    assert o.origin.op == "aten.div.Tensor"
    assert o.origin.explanation.startswith("0/0 -> NaN"), o.origin.explanation


@pytest.mark.parametrize("loss, op", [
    (lambda out, y: torch.nn.functional.nll_loss(out.log_softmax(1), y), "aten.nll_loss_forward"),
    (lambda out, y: torch.nn.functional.mse_loss(out[:, 0], y.float()), "aten.mse_loss"),
    (lambda out, y: out.mean(), "aten.mean"),
])
def test_a_loss_over_an_empty_selection_is_named_so(tmp_path, loss, op):
    # pytorch/examples gat/main.py trains on `idx[1600:]` of a shuffled 2,708-node graph: on a
    # smaller graph that index is empty, and the mean of no values is 0/0 (NaN at step 0).
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    idx = torch.randperm(10)[16:]

    def f():
        out = lin(x)
        loss(out[idx], y[idx]).backward()

    o = origin(record(tmp_path, f))
    assert o.origin.op == op
    assert "0 values" in o.origin.explanation and "empty" in o.origin.explanation
    assert "empty" in o.suggestion and "overflow" not in o.suggestion



def test_an_empty_poisson_batch_made_with_torch_empty_is_an_empty_batch_not_uninitialised_memory(tmp_path):
    # opacus' DPDataLoader (make_private) samples each batch by Poisson sampling and turns an empty
    # one into tensors of 0 rows made with torch.empty (DPDataLoader._make_empty_batch); the mean
    # cross entropy of no samples is 0/0. The report explained it so, but its fix read "write the
    # tensor before anything reads it: torch.zeros ... instead of torch.empty": a tensor of no
    # values holds no uninitialised memory.
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)

    def f():
        x = torch.empty((0, 4), dtype=torch.float32)  # as _make_empty_batch makes them
        y = torch.empty((0,), dtype=torch.int64)
        torch.nn.functional.cross_entropy(lin(x), y).backward()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten.nll_loss_forward"
    assert "0 values" in o.origin.explanation and "uninitialised" not in o.origin.explanation
    assert "the batch is empty" in o.suggestion and "torch.empty" not in o.suggestion, o.suggestion

@pytest.mark.parametrize("mode", ["full_health", "curt_health"])
def test_the_mean_over_an_expert_that_got_no_tokens_is_named_so(tmp_path, mode):
    # davidmrau/mixture-of-experts moe.py: SparseDispatcher.expert_to_gates splits the gates by each
    # expert's token count (torch.split(gates, part_sizes)); with 8 experts and 4 tokens, some parts
    # are empty and a per-expert mean of them is 0/0. The input read was split's output 0 (one
    # token, finite), and the NaN was explained as a mean that overflowed.
    gates = torch.tensor([[0.5], [0.7], [0.2], [0.9]])
    part_sizes = [1, 1, 0, 1, 1, 0, 0, 0]

    def f():
        parts = torch.split(gates, part_sizes, dim=0)
        conf = torch.stack([g.mean() for g in parts])
        return conf.sum().item()

    o = origin(record(tmp_path, f, mode))
    assert o.origin.op == "aten.mean"
    assert "empty" in o.origin.explanation and "overflow" not in o.origin.explanation, o.origin.explanation
    assert "empty" in o.suggestion and "overflow" not in o.suggestion, o.suggestion
    # which of split's outputs this is the run does not say: output 0 is not presented as the input
    assert "1 positive" not in o.origin.inputs[0]["description"], o.origin.inputs[0]["description"]


@pytest.mark.parametrize("mode", ["full_health", "curt_health"])
def test_a_loss_whose_targets_are_all_ignored_is_named_so(tmp_path, mode):
    # A tiny GPT-2 (transformers' GPT2LMHeadModel) given a batch whose labels are all -100 (every
    # position padding): its cross_entropy averages over no target, 0/0. Under curt_health (no
    # zero counts) the integer targets, made before recording, were blamed as "from outside the
    # recording": a NaN from finite log-probabilities is 0/0 all the same, and integers hold none.
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 7)
    x, y = torch.randn(6, 4), torch.full((6,), -100)

    def f():
        torch.nn.functional.cross_entropy(lin(x), y).backward()

    o = origin(record(tmp_path, f, mode))
    assert o.origin.op == "aten.nll_loss_forward"
    assert "ignore_index" in o.origin.explanation and "0/0" in o.origin.explanation
    assert "ignore_index" in o.suggestion and "overflow" not in o.suggestion


@pytest.mark.parametrize("call", ["keyword", "module", "expression"])
def test_an_ignore_index_the_user_set_is_named_by_its_value(tmp_path, call):
    # "every target is ignore_index (-100 unless set)" was said of a loss whose ignore_index the
    # user set: the call's line says the value, or the targets' summary does (all 0 here).
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 7)
    x = torch.randn(6, 4)
    criterion = torch.nn.CrossEntropyLoss(ignore_index=0)
    pad_id = 0

    def f():
        y = torch.zeros(6, dtype=torch.long)  # every position padding
        if call == "keyword":
            torch.nn.functional.cross_entropy(lin(x), y, ignore_index=0).backward()
        elif call == "module":
            criterion(lin(x), y).backward()
        else:
            torch.nn.functional.cross_entropy(lin(x), y.clone(), ignore_index=pad_id).backward()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten.nll_loss_forward"
    assert "-100" not in o.origin.explanation, o.origin.explanation
    want = "ignore_index (pad_id)" if call == "expression" else "ignore_index (0)"
    assert want in o.origin.explanation, o.origin.explanation


@pytest.mark.parametrize("mode", ["full_health", "stats"])
def test_an_ignore_index_passed_by_a_name_of_its_own_is_not_named_by_that_name(tmp_path, mode):
    # lucidrains/x-transformers' AutoregressiveWrapper.forward: ``ignore_index = self.ignore_index``,
    # then ``loss_fn(logits, target, ignore_index = ignore_index)``; with every sequence cut to its
    # first token (``lens`` of 1) no target is left, and the report said "every target is
    # ignore_index (ignore_index)". The value comes from the targets where their summary says it.
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 7)
    x = torch.randn(6, 4)
    ignore_index = -100

    def f():
        target = torch.full((6,), ignore_index)
        loss = torch.nn.functional.cross_entropy(
            lin(x),
            target,
            ignore_index = ignore_index
        )
        loss.backward()

    o = origin(record(tmp_path, f, mode))
    assert "ignore_index (ignore_index)" not in o.origin.explanation, o.origin.explanation
    want = "ignore_index (-100)" if mode == "stats" else "ignore_index (-100 unless set)"
    assert want in o.origin.explanation, o.origin.explanation


def test_an_ignore_index_left_unknown_keeps_the_default_named(tmp_path):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 7)
    x, y = torch.randn(6, 4), torch.full((6,), -100)  # made before the recording: no summary

    def f():
        torch.nn.functional.cross_entropy(lin(x), y).backward()

    o = origin(record(tmp_path, f))
    assert "ignore_index (-100 unless set)" in o.origin.explanation, o.origin.explanation


def test_an_op_that_made_the_nan_itself_is_not_said_to_have_made_it_again(tmp_path, capsys):
    # The report printed "then: it became NaN in aten.sqrt" under the origin aten.sqrt itself.
    from trainguard.cli import main

    x = torch.tensor([1.0, -1.0])

    def f():
        x.sqrt()

    run = record(tmp_path, f)
    o = origin(run)
    assert (o.origin.op, len(o.chain), o.reason) == ("aten.sqrt", 1, "nan")
    assert o.harm is None and "Then" not in o.summary
    assert main(["report", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "First harmful value: aten.sqrt" in out
    assert "then:" not in out and "became NaN" not in out, out



@pytest.mark.parametrize("backend", ["python", "native"])
@pytest.mark.parametrize("expr", ["mul", "add", "mul_inf_zero"])
def test_a_nan_python_number_in_an_expression_is_named_not_called_an_overflow(tmp_path, backend, expr):
    # A sentence-transformers pooling hook that scaled one batch's embeddings by a Python number
    # holding NaN (`emb * float("nan")`; a scale or temperature computed as 0/0 in NumPy is one):
    # the number is no recorded tensor, so the report said "mul turned finite inputs into nan" and
    # "values are overflowing: lower the learning rate or clip gradients".
    x = torch.tensor([[0.5, -1.0], [2.0, 0.0 if expr == "mul_inf_zero" else 3.0]])
    number = {"mul": float("nan"), "add": float("nan"), "mul_inf_zero": float("inf")}[expr]

    def f():
        h = torch.tanh(x)  # a recorded, finite tensor (tanh(0) = 0)
        y = h * number if expr != "add" else h + number
        return y.sum().item()

    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        f()
    o = origin(open_run(tmp_path / "r"))
    assert o.origin.op in ("aten.mul.Tensor", "aten.add.Tensor"), o.origin.op
    assert "Python number" in o.origin.explanation, o.origin.explanation
    assert ("inf" in o.origin.explanation) == (expr == "mul_inf_zero"), o.origin.explanation
    assert "overflow" not in o.origin.explanation and "learning rate" not in o.suggestion, o.suggestion
    assert "math.isfinite" in o.suggestion, o.suggestion

def test_exp_overflow_with_and_without_stats(tmp_path):
    x = torch.tensor([1.0, 812.3])
    o = origin(record(tmp_path / "a", lambda: torch.exp(x * 1).sum().item(), mode="stats"))
    assert o.origin.explanation == "exp overflow: input max 812.3"
    o = origin(record(tmp_path / "b", lambda: torch.exp(x * 1).sum().item()))
    assert o.origin.explanation == "exp overflow: an input value too large for float32 (above about 88.7)"


@pytest.mark.parametrize("dtype, limit", [(torch.float32, "1.84e+19"), (torch.float16, "256"),
                                          (torch.bfloat16, "1.84e+19")])
def test_a_square_overflow_names_the_squares_limit_not_exps(tmp_path, dtype, limit):
    # Polynomial features (tests/guard/conftest.py's PolyNet): x.pow(2) of an input of 1e20 was
    # explained with exp's threshold, "above about 88.7 for exp in float32".
    x = torch.tensor([1.0, 1e20 if dtype != torch.float16 else 300.0]).to(dtype)
    o = origin(record(tmp_path / "a", lambda: x.pow(2).sum().item()))
    name = str(dtype).removeprefix("torch.")
    assert o.origin.explanation == (f"pow overflow: an input value too large for a power in {name} "
                                    f"(x**2 passes its largest value above about {limit})")
    # and the fix is not exp's "subtract the maximum first ... x.clamp(max=80)"
    assert "clamp(max=80)" not in o.suggestion and "logsumexp" not in o.suggestion, o.suggestion
    assert "normalise" in o.suggestion and "float64" in o.suggestion, o.suggestion
    o = origin(record(tmp_path / "b", lambda: torch.exp2(x * 200).sum().item()))
    bound = {torch.float32: "128", torch.float16: "16", torch.bfloat16: "128"}[dtype]
    assert o.origin.explanation == f"exp2 overflow: an input value too large for {name} (above about {bound})"


@pytest.mark.parametrize("mode", ["full_health", "stats"])
def test_a_negative_power_of_a_zero_degree_is_not_called_an_overflow(tmp_path, mode):
    # Kipf & Welling's normalisation written by hand (PyG's gcn_norm guards it with masked_fill):
    # the degree of an isolated node is 0, and 0 ** -0.5 is inf; 0 * inf at the aggregation.
    dst = torch.tensor([0, 1, 1, 2])  # node 3: no edge

    def f():
        deg = torch.zeros(4).index_add_(0, dst, torch.ones(4))
        dinv = deg.pow(-0.5)
        agg = torch.zeros(4).index_add_(0, dst, dinv[dst])
        return (dinv * agg).sum().item()

    o = origin(record(tmp_path, f, mode=mode))
    assert o.origin.op == "aten.pow.Tensor_Scalar"
    assert o.origin.explanation == "pow of an input with 1 zero -> +inf: a negative power of 0 (1 / 0)"
    assert "clamp" in o.suggestion and "masked_fill" in o.suggestion and "x.clamp(max=80)" not in o.suggestion


def test_backward_sqrt_at_zero(tmp_path):
    w = torch.zeros(3, requires_grad=True)

    def f():
        torch.sqrt(w * 1).sum().backward()

    o = origin(record(tmp_path, f))
    assert o.origin.phase == "backward"
    assert o.origin.forward_op["op"] == "aten.sqrt"
    assert o.origin.explanation.startswith("the gradient of sqrt is")
    assert "sqrt(x + 1e-12)" in o.suggestion


def test_a_gradient_penalty_over_a_flat_critic_is_told_to_take_the_norm_with_an_epsilon(tmp_path):
    # caogang/wgan-gp gan_toy.py's calc_gradient_penalty, `gradients.norm(2, dim=1)`, where the
    # critic is flat (every ReLU dead): the norm of a zero gradient has a NaN gradient. The fix
    # names the norm written with its epsilon, not a sqrt the code does not call.
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
    with torch.no_grad():
        critic[0].bias.fill_(-100.0)

    def f():
        mid = torch.randn(8, 2).requires_grad_(True)
        grads = torch.autograd.grad(critic(mid), mid, torch.ones(8, 1), create_graph=True)[0]
        ((grads.norm(2, dim=1) - 1) ** 2).mean().backward()

    o = origin(record(tmp_path, f))
    assert o.origin.phase == "backward" and o.origin.forward_op["op"] == "aten.linalg_vector_norm"
    assert "(x ** 2).sum(dim) + 1e-12" in o.suggestion, o.suggestion


class _AdjointEuler(torch.autograd.Function):
    """The adjoint method of rtqichen/torchdiffeq (torchdiffeq/_impl/adjoint.py), cut down to one
    Euler step: the forward solves without a graph; the backward runs the vector field again under
    enable_grad and takes its vector-Jacobian product with torch.autograd.grad."""

    @staticmethod
    def forward(ctx, func, y0, *params):
        ctx.func = func
        ctx.save_for_backward(y0, *params)
        with torch.no_grad():
            return y0 + func(y0)

    @staticmethod
    def backward(ctx, g):
        y0, *params = ctx.saved_tensors
        with torch.enable_grad():
            y = y0.detach().requires_grad_(True)
            f = ctx.func(y)
            vjp = torch.autograd.grad(f, (y, *params), g, allow_unused=True)
        return (None, g + vjp[0], *vjp[1:])


@pytest.mark.parametrize("backend", ["python", "native"])
def test_backward_sqrt_at_zero_in_an_adjoint_backward(tmp_path, backend):
    """A neural ODE's adjoint re-runs its vector field inside a backward pass: a NaN made by the
    backward of that re-run's sqrt is traced to the vector field's line, like an eager backward."""
    lin = nn.Linear(2, 2)

    def field(y):
        return lin(torch.sqrt(y.abs()))  # sqrt at 0: its gradient is inf, times abs' 0 -> NaN

    y0 = torch.tensor([[1.0, 0.0]])

    def f():
        _AdjointEuler.apply(field, y0, *lin.parameters()).pow(2).sum().backward()

    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        f()
    o = origin(open_run(tmp_path / "r"))
    assert o.origin.phase == "backward"
    assert o.origin.forward_op is not None and o.origin.forward_op["op"] == "aten.sqrt"
    assert o.origin.explanation.startswith("the gradient of sqrt is")
    assert o.origin.line == field.__code__.co_firstlineno + 1


_TOY_COUPLING = """\
import torch


def inverse(z, scale_net):
    scale = scale_net(z)
    return z * torch.exp(-scale)  # no tanh: the scale is unbounded
"""


def test_an_origin_inside_an_installed_library_names_the_library_line(tmp_path, monkeypatch):
    """normflows' AffineCoupling.inverse (VincentStimper/normalizing-flows,
    normflows/flows/affine/coupling.py, scale_map="exp") takes exp of an unbounded scale inside
    the installed package, called as a method (no module hook): the report's line is the user's
    call, and the library line where exp overflowed is named too."""
    pkg = tmp_path / "site-packages" / "toyflows"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "coupling.py").write_text(_TOY_COUPLING)
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    from toyflows import coupling

    z = torch.ones(4, 1)

    def f():
        return coupling.inverse(z, lambda v: -100 * v).sum().item()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten.exp" and o.origin.function == "f"
    lib = o.origin.library
    assert (lib["path"], lib["line"], lib["function"]) == ("toyflows/coupling.py", 6, "inverse"), lib
    assert "inside toyflows/coupling.py:6 in inverse" in o.summary


def test_a_constant_inf_the_code_writes_is_not_blamed_on_the_data(tmp_path):
    """normflows' Uniform base distribution (VincentStimper/normalizing-flows,
    normflows/distributions/base.py, Uniform.log_prob) writes ``log_p[out_of_range] = -np.inf``:
    a flow trained on data outside [low, high] has an infinite loss. The -inf is the code's own
    constant, not bad data: the fix says to keep it out of the loss."""
    lin = nn.Linear(2, 1)
    z = torch.tensor([[0.5, 0.2], [3.0, 0.1]])  # the second sample lies outside [-1, 1]

    def f():
        log_p = lin(z).squeeze(1) * 0
        out_range = torch.any((z < -1) | (z > 1), dim=-1)
        log_p[out_range] = -float("inf")
        (-log_p.mean()).backward()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten.lift_fresh" and o.reason == "loss"
    assert "already held" not in o.suggestion
    assert "support" in o.suggestion and "torch.where" in o.suggestion

    # a batch read into a tensor with a NaN in it is the data's, as before
    rows = [[1.0, float("nan")], [0.5, 0.2]]
    o = origin(record(tmp_path / "data", lambda: lin(torch.tensor(rows)).sum().item()))
    assert "already held" in o.suggestion


def test_nonfinite_input_data(tmp_path):
    bad = torch.tensor([1.0, float("nan")])
    o = origin(record(tmp_path, lambda: bad * 2))
    assert o.origin.op == "aten.mul.Tensor"
    assert "already held NaN" in o.suggestion
    # its input was made before the recording: its values were never summarised, not "finite"
    assert "finite inputs" not in o.origin.explanation
    assert "input 0" in o.origin.explanation and "outside the recording" in o.origin.explanation


def test_a_zero_denominator_made_by_a_difference_in_bfloat16_says_to_compute_it_in_float32(tmp_path):
    # A diffusion loss weighted by the SNR of each sample's timestep, alphas_cumprod / (1 - alphas_cumprod),
    # with the model and its schedule buffer cast to bfloat16 (the SNR weighting of lucidrains'
    # denoising_diffusion_pytorch.py and diffusers' compute_snr, computed at run time): alphas_cumprod
    # at small t is 0.9999, which bfloat16 rounds to 1, so 1 - a is 0. "x / (d + 1e-8)" only moves
    # the inf to 1e8; the difference must be taken in float32.
    alphas_cumprod = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64), 0).to(torch.bfloat16)

    def snr():
        a = alphas_cumprod[torch.tensor([0, 1, 500, 999])]
        return (a / (1 - a)).sum().item()

    o = origin(record(tmp_path, snr))
    assert o.origin.op == "aten.div.Tensor"
    assert "float32" in o.suggestion and "bfloat16" in o.suggestion, o.suggestion


def test_nonfinite_input_data_times_a_recorded_coefficient_is_not_called_an_overflow(tmp_path):
    # Found with trainguard's guard on the diffusers unconditional training loop, one training image
    # NaN: the replay records the step, not the batch made before it, and DDPMScheduler.add_noise
    # (src/diffusers/schedulers/scheduling_ddpm.py) multiplies it by sqrt(alphas_cumprod[t]), which
    # the step gathered. The explanation said the batch held the NaN; the fix said "values are
    # overflowing: lower the learning rate or clip gradients".
    bad = torch.rand(2, 3, 4, 4) * 2 - 1
    bad[1, 0, 2, 2] = float("nan")
    alphas_cumprod = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), dim=0)

    def add_noise():
        t = torch.tensor([10, 500])
        noise = torch.randn(2, 3, 4, 4)
        sqrt_alpha_prod = (alphas_cumprod[t] ** 0.5).flatten()[:, None, None, None]
        sqrt_one_minus_alpha_prod = ((1 - alphas_cumprod[t]) ** 0.5).flatten()[:, None, None, None]
        return sqrt_alpha_prod * bad + sqrt_one_minus_alpha_prod * noise

    o = origin(record(tmp_path, lambda: add_noise().mean().item()))
    assert o.origin.op == "aten.mul.Tensor"
    assert "outside the recording" in o.origin.explanation, o.origin.explanation
    assert "already held NaN" in o.suggestion and "learning rate" not in o.suggestion, o.suggestion


@pytest.mark.parametrize("backend", ["python", "native"])
def test_a_view_of_stale_memory_from_before_the_recording_that_is_overwritten_is_no_alert(tmp_path, backend):
    # Found on pytorch/examples' FSDP2 model under trainguard.Guard with two gloo ranks: the replay records
    # from the failing step on, and FSDP2 frees and allocates again its unsharded parameters' storage outside
    # any op; after the NaN step the allocator handed back NaN, which FSDP2 views and then fills by the
    # all-gather (split_with_sizes_copy, out=). The view was called the origin ("view made nan from input 0,
    # which came from outside the recording") on both ranks, instead of the rank's division by zero.
    stale = torch.full((2, 4), float("nan"))

    def step():
        rows = stale.view(8)
        rows.copy_(torch.arange(8.0))  # filled before anything reads it
        return (stale * 2).sum().item()

    with tg.record(tmp_path / "run", backend=backend, buffer=-1, mode="full_health"):
        assert step() == 56.0
    with open_run(tmp_path / "run") as run:
        assert run.alerts()["total"] == 0 and run.first_harm() is None


@pytest.mark.parametrize("backend", ["python", "native"])
def test_a_view_of_data_from_before_the_recording_holding_nan_is_the_origin(tmp_path, backend):
    bad = torch.tensor([[1.0, float("nan")]])
    with tg.record(tmp_path / "run", backend=backend, buffer=-1, mode="full_health"):
        (bad.view(2) * 2).sum()
    with open_run(tmp_path / "run") as run:
        o = origin(run)
    assert o.origin.op == "aten.view"
    assert "outside the recording" in o.origin.explanation and "already held NaN" in o.suggestion


@pytest.mark.parametrize("layer", ["conv", "linear"])
def test_nonfinite_input_data_into_an_accumulating_op_is_not_called_an_overflow(tmp_path, layer):
    # Found with trainguard's guard on pytorch/tutorials pruning_tutorial.py's LeNet, one training
    # sample NaN: the replay records the step, not the batch made before it, and the conv was said
    # to overflow "from finite inputs", with "lower the learning rate" as the fix.
    torch.manual_seed(0)
    net = torch.nn.Conv2d(1, 2, 3) if layer == "conv" else torch.nn.Linear(4, 2)
    bad = torch.randn(2, 1, 4, 4) if layer == "conv" else torch.randn(2, 4)
    bad[1] = float("nan")
    o = origin(record(tmp_path, lambda: net(bad).sum().backward()))
    assert "finite inputs" not in o.origin.explanation and "outside the recording" in o.origin.explanation
    assert "already held NaN" in o.suggestion and "learning rate" not in o.suggestion


@pytest.mark.parametrize("op", ["pow", "exp"])
def test_nan_input_data_into_an_exp_or_power_is_not_called_an_overflow(tmp_path, op):
    # Found with trainguard's guard on two gloo ranks of tests/guard's PolyNet (the first op of its
    # forward is x.pow(2)), one sample of rank 1's batch NaN, as a corrupt record of pytorch/examples'
    # ddp-tutorial-series data set: the replay records the step, not the batch made before it, and
    # the origin read "pow overflow: an input value too large for a power in float32". From finite
    # inputs these ops overflow to inf; a NaN came with the input.
    bad = torch.ones(4, 3)
    bad[2, 1] = float("nan")
    o = origin(record(tmp_path, lambda: getattr(bad, op)(*([2] if op == "pow" else [])).sum().item()))
    assert "overflow" not in o.origin.explanation, o.origin.explanation
    assert "outside the recording" in o.origin.explanation and "already held NaN" in o.suggestion


def test_a_nan_written_from_python_is_named_a_constant(tmp_path):
    # Found on pytorch/examples' dcgan with a dataset item holding ``x[0, 0, 0] = float('nan')``:
    # the origin is the op that turns the Python float into a tensor, which made nothing itself.
    def fn():
        x = torch.rand(2, 3)
        x[0, 1] = float("nan")
        (x * 2).sum()

    link = origin(record(tmp_path, fn)).origin
    assert "lift_fresh" in link.op
    assert "finite inputs" not in link.explanation and "Python constant" in link.explanation


def test_a_nan_written_into_a_sample_is_told_to_repair_the_data_not_a_log_prob_sentinel(tmp_path):
    # A QAT script in the style of PyTorch's eager-mode QAT tutorial (tiny CNN on 28x28 samples)
    # with one sample holding ``x[100, 0, 3, 4] = float('nan')``, read in the same step: the fix
    # read "a log-probability of 0 for a sample outside a bounded support ... a Gaussian base for
    # a flow", the text for normflows' -inf sentinel. A NaN is no sentinel: repair the sample.
    def fn():
        x = torch.rand(8, 1, 28, 28)
        x[5, 0, 3, 4] = float("nan")
        torch.nn.functional.conv2d(x, torch.ones(2, 1, 3, 3)).sum().item()

    o = origin(record(tmp_path, fn))
    assert "lift_fresh" in o.origin.op
    assert "support" not in o.suggestion and "repair or drop that sample" in o.suggestion, o.suggestion


def test_clean_run_has_no_origin(tmp_path):
    assert origin(record(tmp_path, lambda: torch.ones(3).exp())) is None


def test_an_overflow_in_float32_is_not_told_to_compute_in_float32(tmp_path):
    # From pytorch/examples' super_resolution (Adam at lr=1e30): conv2 overflowed in float32 and the
    # fix read "... or compute this op in float32", which it already was.
    def overflow(dtype):
        conv = torch.nn.Conv2d(4, 4, 3).to(dtype)
        with torch.no_grad():
            conv.weight.fill_(1e30 if dtype == torch.float32 else 1e4)
        # in step 1, after an update (made by hand here): step 0's forward would say no update made the overflow
        return lambda: (tg.step(), conv(torch.full((1, 4, 8, 8), 1e10 if dtype == torch.float32 else 1e3,
                                                   dtype=dtype)).sum().item())

    o = origin(record(tmp_path / "f32", overflow(torch.float32)))
    assert o.origin.op == "aten.convolution" and o.origin.explanation.startswith("overflow in convolution")
    assert "lower the learning rate" in o.suggestion and "float32" not in o.suggestion, o.suggestion
    o = origin(record(tmp_path / "f16", overflow(torch.float16)))
    assert o.origin.op == "aten.convolution" and "compute this op in float32" in o.suggestion, o.suggestion


@pytest.mark.parametrize("mode", ["full_health", "curt_health"])
def test_the_std_of_a_single_value_is_named_bessels_correction(tmp_path, mode):
    # From pytorch/examples' reinforcement_learning/reinforce.py, which normalises an episode's
    # returns with `(returns - returns.mean()) / (returns.std() + eps)`: an episode of one step
    # makes the std 0/0 (it divides by N - 1). The fix read "values are overflowing".
    eps = torch.finfo(torch.float32).eps

    def episode():
        returns = torch.randn(1)
        return ((returns - returns.mean()) / (returns.std() + eps)).sum().item()

    o = origin(record(tmp_path, episode, mode=mode))
    link = o.origin
    _, first = inspect.getsourcelines(episode)
    assert link.op == "aten.std.correction" and link.line == first + 2
    assert "1 value" in link.explanation and "N - 1" in link.explanation, link.explanation
    assert "correction=0" in o.suggestion and "overflowing" not in o.suggestion, o.suggestion


def test_the_variance_over_rows_of_one_value_is_named_bessels_correction(tmp_path):
    x = torch.randn(4, 1)
    o = origin(record(tmp_path, lambda: torch.var(x * 1, dim=1).sum().item()))
    assert o.origin.op == "aten.var.correction"
    assert "1 value" in o.origin.explanation and "N - 1" in o.origin.explanation, o.origin.explanation
    assert "correction=0" in o.suggestion


def test_the_gradient_of_std_over_a_constant_row(tmp_path):
    # A layer norm written by hand, `(h - h.mean(-1)) / h.std(-1).clamp(min=1e-5)`: a row whose
    # values are all equal has std 0, and std's backward divides by it (0/0) even though the
    # forward clamps it. The fix read "values are overflowing".
    h = torch.zeros(2, 8)
    h[0] = torch.randn(8)
    h.requires_grad_(True)

    def f():
        y = (h - h.mean(-1, keepdim=True)) / h.std(-1, keepdim=True).clamp(min=1e-5)
        y.pow(2).mean().backward()

    o = origin(record(tmp_path, f))
    link = o.origin
    assert link.phase == "backward" and link.forward_op["op"] == "aten.std.correction"
    assert "the same" in link.explanation and "std" in link.explanation, link.explanation
    assert ".var(" in o.suggestion and "overflowing" not in o.suggestion, o.suggestion


def _scan_with_a_dropped_minus():
    """johnma2006/mamba-minimal model.py's selective scan (B = C = 1) with the sign of A dropped,
    ``A = torch.exp(A_log)`` for ``-torch.exp(A_log)``: each position multiplies the state by
    exp(delta * A) > 1, and it overflows within a few positions of the first forward."""
    torch.manual_seed(0)
    a_log = torch.nn.Parameter(torch.log(torch.arange(1, 9.0)).repeat(4, 1))  # (d_in, n), as mamba's A_log
    u, delta = torch.randn(2, 64, 4), torch.nn.functional.softplus(torch.randn(2, 64, 4))
    delta_a = torch.exp(delta.unsqueeze(-1) * torch.exp(a_log))
    delta_b_u = delta.unsqueeze(-1) * u.unsqueeze(-1)
    x, ys = torch.zeros(2, 4, 8), []
    for i in range(64):
        x = delta_a[:, i] * x + delta_b_u[:, i]  # SCAN LINE
        ys.append(x.sum(-1))
    torch.stack(ys, 1).pow(2).mean().backward()


def test_an_overflow_in_the_first_forward_is_not_blamed_on_the_learning_rate(tmp_path):
    """Before any optimizer step the weights are the initial ones: no learning rate made the
    values this large (the fix said "lower the learning rate or clip gradients"). The state fed
    back through the same line is a recurrence whose factor grows it geometrically."""
    o = origin(record(tmp_path, _scan_with_a_dropped_minus))
    assert (o.origin.op, o.origin.step, o.origin.phase) == ("aten.mul.Tensor", 0, "forward")
    lines, first = inspect.getsourcelines(_scan_with_a_dropped_minus)
    assert o.origin.line == first + next(i for i, t in enumerate(lines) if "# SCAN LINE" in t)
    assert "lower the learning rate" not in o.suggestion and "clip" not in o.suggestion, o.suggestion
    assert "before any optimizer step" in o.suggestion and "geometrically" in o.suggestion, o.suggestion


@pytest.mark.parametrize("buffer", [-1, 50])
def test_the_recurrence_is_named_at_the_input_it_feeds_back(tmp_path, buffer):
    """``trainguard run`` keeps the newest 1,000 executions: the loop's earlier passes, which
    show the line feeding its own output back, are gone by the time it overflows (the mamba scan
    said nothing of the loop then); the stored source line, ``x = ... * x + ...`` in a ``for``,
    tells it. The fed-back value is ``x``, input 1 of the mul, not ``delta_a[:, i]``."""
    with tg.record(tmp_path / "r", buffer=buffer):
        _scan_with_a_dropped_minus()
    o = origin(open_run(tmp_path / "r"))
    assert o.origin.op == "aten.mul.Tensor"
    assert "input 1 is made by this same line" in o.suggestion and "geometrically" in o.suggestion, o.suggestion


@pytest.mark.parametrize("spelling", ["log1p", "log(1 + exp)"])
def test_log_of_one_plus_exp_is_told_to_use_softplus(tmp_path, spelling):
    # pytorch/examples mnist_forward_forward/main.py's loss, log1p(exp(cat([-g_pos + threshold,
    # g_neg - threshold]))), overflows at --threshold 100; the fix said to subtract the maximum or
    # clamp, where softplus computes the same without overflow.
    def loss():
        z = torch.cat([-torch.ones(4) + 100.0, torch.ones(4) - 100.0])
        out = torch.log1p(torch.exp(z)) if spelling == "log1p" else torch.log(1 + torch.exp(z))
        out.mean().item()

    o = origin(record(tmp_path, loss))
    assert o.origin.op == "aten.exp"
    assert "torch.nn.functional.softplus" in o.suggestion, o.suggestion


def _preference_loss(beta=50.0):
    # huggingface/trl trl/trainer/dpo_trainer.py's sigmoid loss, -F.logsigmoid(beta * delta), written
    # as -log(sigmoid(beta * delta)): a swapped pair whose margin the policy already pushed the
    # other way (beta * delta = -3,000) has a sigmoid of exactly 0 in float32, and its log is -inf.
    delta = torch.tensor([2.0, 1.5, -60.0, 0.5], requires_grad=True)
    loss = -torch.log(torch.sigmoid(beta * delta)).mean()
    loss.backward()


def test_log_of_a_sigmoid_is_told_to_use_logsigmoid(tmp_path):
    # The fix said to clamp the input or use log_softmax; F.logsigmoid computes the same exactly,
    # where a clamp bounds the loss and zeroes the gradient of the pairs that need it most.
    o = origin(record(tmp_path, _preference_loss))
    assert o.origin.op == "aten.log"
    assert "F.logsigmoid(x)" in o.suggestion and "log_softmax" not in o.suggestion, o.suggestion
    with pytest.raises(tg.NonFiniteError) as info:
        with tg.check_numerics(tmp_path / "c"):
            _preference_loss()
    assert str(info.value).startswith("aten.log produced -inf in step 0")
    assert "F.logsigmoid(x)" in origin(open_run(tmp_path / "c")).suggestion  # the fix `trainguard run` prints


class _LogitScale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self):
        return self.logit_scale.exp()


@pytest.mark.parametrize("in_module", [True, False])
def test_exp_of_a_learned_log_scale_is_told_to_clamp_the_parameter(tmp_path, in_module):
    # open_clip's CLIP/SigLIP: logit_scale is a parameter used as logit_scale.exp(), clamped to
    # [0, ln 100] after each optimizer step (open_clip_train/train.py). Without the clamp and with a
    # high rate the update pushes it past 88.7 and exp overflows; the fix said to subtract the
    # maximum or clamp the input, where the input is the parameter the optimizer grew.
    model = _LogitScale()
    opt = torch.optim.SGD(model.parameters(), lr=100.0)

    def train():
        for _ in range(2):
            scale = model() if in_module else model.logit_scale.exp()  # a bare parameter has no name
            loss = -scale * 0.5  # the loss falls as the scale grows
            opt.zero_grad()
            loss.backward()
            opt.step()

    o = origin(record(tmp_path, train))
    assert o.origin.op == "aten.exp" and o.origin.step == 1
    assert "optimizer.step()" in o.suggestion and "clamp_(0, math.log(100))" in o.suggestion, o.suggestion
    assert "subtract the maximum" not in o.suggestion, o.suggestion
    assert ("model.logit_scale.clamp_" in o.suggestion) == in_module, o.suggestion


class _Decay(nn.Module):
    """A selective-scan layer's decay, as alxndrTL/mamba.py's MambaBlock.ssm writes it:
    A = -torch.exp(self.A_log), deltaA = torch.exp(delta * A), delta = softplus(...)."""

    def __init__(self):
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(4, 2))

    def forward(self, x, delta):
        A = -torch.exp(self.A_log)
        return x * torch.exp(delta.unsqueeze(-1) * A).sum(-1)


class _Scan(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Decay(), _Decay()])

    def forward(self, x, delta):
        for layer in self.layers:
            x = layer(x, delta)
        return x


def test_exp_of_a_log_decay_in_a_module_list_is_told_in_python_it_can_run(tmp_path):
    # mambapy's LM with a rate too high for A_log (layers.N.mixer.A_log): exp(A_log) overflows,
    # A = -inf, and delta * A is 0 * -inf where softplus underflowed to 0. The fix said to run
    # `model.layers.1.A_log.clamp_(0, math.log(100))`, a SyntaxError, and called A_log a log-scale
    # "as CLIP's logit_scale", whose clamp at 0 from below forbids the slow decays A_log < 0 makes.
    model = _Scan()
    opt = torch.optim.SGD(model.parameters(), lr=1000.0)
    x = torch.ones(3, 4)
    delta = nn.functional.softplus(torch.tensor([[-200.0], [0.0], [1.0]]).expand(3, 4))

    def train():
        for _ in range(2):
            loss = model(x, delta).sum()  # falls as A_log grows: the decay forgets faster
            opt.zero_grad()
            loss.backward()
            opt.step()

    o = origin(record(tmp_path, train))
    assert o.origin.op == "aten.exp" and o.origin.step == 1 and o.origin.module == "layers.0"
    code = o.suggestion.split("`")[1]
    assert code.startswith("with torch.no_grad(): model.layers[0].A_log.clamp_("), o.suggestion
    compile(code, "<fix>", "exec")  # the code the fix gives runs as written
    assert "decay" in o.suggestion and "logit_scale" not in o.suggestion, o.suggestion
    assert "clamp_(max=" in code, o.suggestion  # only from above: exp must stay finite


def test_exp_of_a_log_scale_initialised_too_large_is_told_to_initialise_it_lower(tmp_path):
    # open_clip's CLIP with "init_logit_scale": 100 in its model config (mlfoundations/open_clip,
    # src/open_clip/model.py: self.logit_scale = nn.Parameter(torch.ones([]) * init_logit_scale)):
    # exp overflows in the first forward pass, before any optimizer step, and open_clip's clamp after
    # the step comes too late. The fix said the optimizer grew the parameter and to clamp it after
    # each step, where its initial value is the cause.
    model = _LogitScale()
    with torch.no_grad():
        model.logit_scale.fill_(100.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train():
        loss = -model() * 0.5  # (a bare parameter never updated is, to the recorder, an input tensor)
        opt.zero_grad()
        loss.backward()
        opt.step()

    o = origin(record(tmp_path, train))
    assert o.origin.op == "aten.exp" and o.origin.step == 0
    assert "optimizer grew" not in o.suggestion, o.suggestion
    assert "initial value" in o.suggestion and "log(1 / 0.07)" in o.suggestion, o.suggestion
    assert "clamp_(0, math.log(100))" in o.suggestion, o.suggestion
    assert "model.logit_scale" in o.suggestion, o.suggestion


@pytest.mark.parametrize("count", [
    lambda mask: mask.sum(),
    # transformers' Trainer: num_items_in_batch, a label count (added up over the accumulated
    # micro-batches, divided among the processes) that LabelSmoother divides by
    lambda mask: (mask.sum() + 0) / 1,
])
def test_a_mean_over_a_mask_that_kept_nothing_is_named_so(tmp_path, count):
    # Seq2seq losses written by hand, and transformers' LabelSmoother (label_smoothing_factor under
    # Seq2SeqTrainer), divide a masked sum by the count of labels that are not -100: a batch whose
    # labels are all -100 is 0/0. It was told to add an epsilon to the denominator (found on a tiny
    # T5 fine-tuned with Seq2SeqTrainer and label smoothing, every label masked).
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 7)
    x, y = torch.randn(6, 4), torch.full((6,), -100)

    def f():
        nll = -lin(x).log_softmax(-1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        mask = y.ne(-100)
        ((nll * mask).sum() / count(mask)).backward()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten.div.Tensor"
    assert "counts" in o.origin.explanation and "aten.ne.Scalar" in o.origin.explanation, o.origin.explanation
    assert "clamp_min(1)" in o.suggestion and "1e-8" not in o.suggestion, o.suggestion


# cornellius-gp/gpytorch's gpytorch/kernels/kernel.py (``x1.div(self.lengthscale)``) and
# rbf_kernel.py, reduced: an installed package's kernel whose softplus lengthscale underflowed to
# 0. The op runs inside the package; the user's line only calls it, and "x / (d + 1e-8)" cannot
# be written into a package: the report must name the package's line as well.
GP_KERNEL = '''
import torch
from torch import nn


class RBFKernel(nn.Module):
    def __init__(self):
        super().__init__()
        self.raw_lengthscale = nn.Parameter(torch.zeros(1, 1))

    def forward(self, x1, x2):
        lengthscale = nn.functional.softplus(self.raw_lengthscale)
        x1_ = x1.div(lengthscale)
        x2_ = x2.div(lengthscale)
        return torch.exp(-0.5 * torch.cdist(x1_, x2_).pow(2))
'''


def test_an_origin_inside_an_installed_package_names_the_package_line(tmp_path, monkeypatch):
    pkg = tmp_path / "site-packages" / "fakegp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels.py").write_text(GP_KERNEL)
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    from fakegp.kernels import RBFKernel

    def train():
        kernel = RBFKernel()
        with torch.no_grad():
            kernel.raw_lengthscale.fill_(-200.0)  # softplus(-200) is 0 in float32
        x = torch.linspace(0, 1, 8)[:, None]
        k = kernel(x, x)  # the user's line
        return k + torch.eye(8)

    o = origin(record(tmp_path, train))
    link = o.origin
    assert link.op == "aten.div.Tensor"
    assert link.file == __file__ and link.line == line_in(sys.modules[__name__], "k = kernel(x, x)")
    assert link.library is not None, link
    assert link.library["file"].endswith("fakegp/kernels.py") and link.library["line"] == 13, link.library
    assert link.library["code"] == "x1_ = x1.div(lengthscale)", link.library
    assert "fakegp/kernels.py:13" in o.summary, o.summary


def test_an_inf_written_into_the_data_set_is_told_to_repair_the_data(tmp_path):
    """pytorch/ignite's examples/mnist/mnist.py on a synthetic data set with one sample written
    to +inf (``x[5, 3] = float("inf")``) before training: the origin is that write (a constant
    the code wrote), and the fix told to keep a log-probability sentinel out of the loss or to
    change a flow's base distribution. The value sat in the data set until a later step's batch
    read it: the fix is about the data."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def f():
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        x[5, 3] = float("inf")
        for xb, yb in torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten.lift_fresh" and o.origin.step == 0 and o.chain[0].step == 2, o.summary
    assert "support" not in o.suggestion and "torch.where" not in o.suggestion, o.suggestion
    assert "sample" in o.suggestion and "doctor" in o.suggestion, o.suggestion



def test_an_inf_written_into_a_full_batch_graph_read_in_the_same_step_is_about_the_data(tmp_path):
    """pytorch_geometric's examples/gat.py (full-batch node classification, one graph, one step per
    epoch) on a synthetic graph with one node feature written to +inf before training
    (``data.x[3, 0] = float("inf")``): the first epoch is step 0, as the write, and the fix read "a
    log-probability of 0 for a sample outside a bounded support ... a Gaussian base for a flow".
    The value went into the model's forward (dropout's 0 * inf made the NaN in Net): it is the data's."""
    x = torch.randn(6, 4)
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 0]])

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x, edge_index):
            x = nn.functional.dropout(x, p=0.5, training=self.training)
            h = self.lin(x)
            return torch.zeros_like(h).index_add_(0, edge_index[1], h[edge_index[0]])

    torch.manual_seed(0)
    model = Net()

    def f():
        x[3, 0] = float("inf")
        nn.functional.cross_entropy(model(x, edge_index), torch.tensor([0, 1, 0, 1, 0, 1])).backward()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten.lift_fresh" and o.origin.step == o.chain[0].step == 0, o.summary
    assert "support" not in o.suggestion and "torch.where(torch.isfinite(log_p)" not in o.suggestion, o.suggestion
    assert "sample" in o.suggestion and "doctor" in o.suggestion, o.suggestion

def test_a_nan_a_dataset_writes_into_its_sample_is_about_the_data_not_a_flow(tmp_path):
    """facebookresearch/detr's train_one_epoch (engine.py) over a data set whose __getitem__ writes
    a NaN pixel into the image it makes (``img[0, 10, 10] = float("nan")``, a corrupt image): the
    one-value lift_fresh was taken for a constant the code keeps in its loss (a flow's log-density
    sentinel), though the DataLoader fetched it as a sample in the same step. The fix is about the
    data."""

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, idx):
            img = torch.randn(3, 8, 8)
            if idx == 2:
                img[0, 1, 1] = float("nan")
            return img, idx % 2

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))

    def f():
        for x, y in torch.utils.data.DataLoader(Images(), batch_size=2):
            nn.functional.cross_entropy(model(x), y).backward()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten.lift_fresh" and o.origin.function == "__getitem__", o.summary
    assert "support" not in o.suggestion and "torch.where(torch.isfinite(log_p)" not in o.suggestion, o.suggestion
    assert "sample" in o.suggestion and "doctor" in o.suggestion, o.suggestion


def test_a_sample_converted_from_numpy_is_called_data_not_a_python_constant(tmp_path):
    """skorch's NeuralNetClassifier on NumPy arrays (its README example) with X[100, 3] = np.inf:
    skorch's Dataset hands out NumPy rows, which the DataLoader's collate turns into tensors
    (lift_fresh of 20 values). The explanation called that row "a Python constant"."""
    import numpy as np

    X = np.random.default_rng(0).standard_normal((8, 20)).astype(np.float32)
    X[5, 3] = np.inf
    model = nn.Linear(20, 2)

    def f():
        loader = torch.utils.data.DataLoader([(X[i], i % 2) for i in range(8)], batch_size=4)
        for xb, yb in loader:
            nn.functional.cross_entropy(model(xb), yb).backward()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten.lift_fresh" and o.origin.outputs[0]["shape"] == [20], o.summary
    assert "Python constant" not in o.origin.explanation, o.origin.explanation
    assert "NumPy" in o.origin.explanation and "data" in o.origin.explanation, o.origin.explanation
    assert "already held" in o.suggestion


def test_a_zero_std_inside_torch_distributions_names_the_std_not_an_epsilon_the_user_cannot_add(tmp_path):
    """cleanrl's ppo_continuous_action.py (vwxyzjn/cleanrl) with its log-std collapsed (exp of
    -120 is 0 in float32) and argument validation off, as RL code often turns it: Normal.log_prob
    divides by 2 * scale**2 = 0. The division is torch's own line: the fix was "x / (d + 1e-8)"."""
    torch.distributions.Distribution.set_default_validate_args(False)
    actor_mean = nn.Linear(3, 1)
    actor_logstd = nn.Parameter(torch.full((1, 1), -120.0))
    obs = torch.randn(4, 3)

    def f():
        action_mean = actor_mean(obs)
        action_std = torch.exp(actor_logstd.expand_as(action_mean))
        probs = torch.distributions.Normal(action_mean, action_std)
        action = probs.sample()
        (-probs.log_prob(action).sum(1).mean()).backward()

    try:
        o = origin(record(tmp_path, f))
    finally:
        torch.distributions.Distribution.set_default_validate_args(True)
    assert o.origin.op == "aten.div.Tensor" and o.origin.function == "f"
    lib = o.origin.library
    assert (lib["path"], lib["function"]) == ("torch/distributions/normal.py", "log_prob"), lib
    assert "scale" in o.suggestion and "std" in o.suggestion and "clamp" in o.suggestion, o.suggestion
    assert "d + 1e-8" not in o.suggestion, o.suggestion


def test_a_negative_scale_inside_torch_distributions_is_told_to_keep_the_scale_positive_not_to_clamp_a_log(tmp_path):
    """pyro-ppl/pyro's examples/vae/vae.py guide, `pyro.sample("latent", dist.Normal(z_loc, z_scale))`,
    with the scale driven negative and validation off (`pyro.enable_validation(False)`): the ELBO's
    Normal.log_prob takes `self.scale.log()` of 128 negative values. The log is torch's own line;
    the fix read "clamp the input before the log ... use torch.log_softmax or F.cross_entropy",
    advice for a log the user never wrote."""
    torch.distributions.Distribution.set_default_validate_args(False)
    fc22 = nn.Linear(8, 4)
    hidden = torch.randn(32, 8)

    def f():
        z_loc = torch.zeros(32, 4)
        z_scale = torch.exp(fc22(hidden)) - 10.0  # the scale driven negative
        q = torch.distributions.Normal(z_loc, z_scale)
        z = q.rsample()
        (-q.log_prob(z).sum()).backward()

    try:
        o = origin(record(tmp_path, f))
    finally:
        torch.distributions.Distribution.set_default_validate_args(True)
    assert o.origin.op == "aten.log" and o.origin.function == "f"
    lib = o.origin.library
    assert (lib["path"], lib["function"]) == ("torch/distributions/normal.py", "log_prob"), lib
    assert "torch/distributions/normal.py" in o.suggestion and "scale" in o.suggestion, o.suggestion
    assert "softplus" in o.suggestion and "validat" in o.suggestion, o.suggestion
    assert "log_softmax" not in o.suggestion and "torch.log(p.clamp" not in o.suggestion, o.suggestion


def test_an_observation_from_numpy_holding_inf_is_told_to_check_where_the_array_is_made(tmp_path):
    """cleanrl's dqn.py (vwxyzjn/cleanrl) with an environment whose sensor reads +inf once: the
    acting step's `q_network(torch.Tensor(obs))` converts the observation. The fix blamed "the data
    or the parameters" and "the previous step", and pointed at `trainguard doctor`, which has no
    data set to validate in an RL loop: the array was non-finite before torch saw it."""
    import numpy as np

    q_network = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    obs = np.random.default_rng(0).standard_normal((1, 4)).astype(np.float32)
    obs[0, 1] = np.inf  # a broken sensor

    def f():
        q_values = q_network(torch.Tensor(obs))
        q_values.max().item()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten.lift_fresh" and o.origin.line == line_in(sys.modules[__name__], "q_values = q_network(torch.Tensor(obs))")
    assert "already held" in o.suggestion and "parameters" not in o.suggestion, o.suggestion
    assert "environment" in o.suggestion and "np.isfinite" in o.suggestion, o.suggestion


def test_an_exp_overflow_of_a_log_std_read_through_expand_is_told_to_bound_the_parameter(tmp_path):
    """cleanrl's ppo_continuous_action.py (vwxyzjn/cleanrl) at lr=20: Adam grew `actor_logstd` past
    88 and `torch.exp(self.actor_logstd.expand_as(action_mean))` overflowed. The exponent is a learned
    log-std read through expand_as, and the fix was "subtract the maximum first (logsumexp / softmax
    do)", which has no maximum to subtract here."""
    torch.manual_seed(0)
    actor_mean = nn.Linear(3, 1)
    actor_logstd = nn.Parameter(torch.zeros(1, 1))
    opt = torch.optim.Adam([*actor_mean.parameters(), actor_logstd], lr=20.0)
    obs = torch.randn(8, 3)

    def f():
        for _ in range(8):
            action_mean = actor_mean(obs)
            action_std = torch.exp(actor_logstd.expand_as(action_mean))  # LOG_STD_EXP
            entropy_loss = -torch.log(action_std).mean()  # an entropy bonus alone: the std grows without bound
            opt.zero_grad()
            entropy_loss.backward()
            opt.step()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten.exp" and o.origin.line == line_in(sys.modules[__name__], "# LOG_STD_EXP")
    assert "maximum" not in o.suggestion and "clamp_" in o.suggestion and "log-scale" in o.suggestion, o.suggestion


def test_a_missing_value_in_a_csv_a_dataloader_fetched_is_told_to_repair_the_data_set(tmp_path):
    """thuml/Time-Series-Library's Dataset_Custom (data_provider/data_loader.py) over an ETT-format
    CSV with one empty cell: pandas reads it as NaN, sklearn's StandardScaler keeps it, and every
    window over that row hands it to the DataLoader's collate. The fix said to repair the values
    "(np.nan_to_num, a gymnasium observation wrapper)": nothing about the data set or the file.
    (NumPy stands in for pandas and sklearn, which the tests do not install: genfromtxt reads the
    empty cell as NaN too, and the scaler's NaN-ignoring mean and std keep it.)"""
    import io

    import numpy as np

    rows = "\n".join(f"2016-07-01 {h:02d}:00:00,{np.sin(h):.3f},{'' if h == 12 else f'{np.cos(h):.3f}'},{h % 5}"
                     for h in range(24))
    raw = np.genfromtxt(io.StringIO("date,HUFL,HULL,OT\n" + rows), delimiter=",", skip_header=1, usecols=(1, 2, 3))
    assert np.isnan(raw).sum() == 1
    data = (raw - np.nanmean(raw, 0)) / np.nanstd(raw, 0)  # StandardScaler().fit_transform

    class Windows(torch.utils.data.Dataset):
        def __len__(self):
            return len(data) - 8

        def __getitem__(self, i):
            return data[i:i + 6], data[i + 6:i + 8]

    model = nn.Sequential(nn.Flatten(), nn.Linear(18, 6))

    def f():
        for x, y in torch.utils.data.DataLoader(Windows(), batch_size=4):
            nn.functional.mse_loss(model(x.float()), y.float().flatten(1)).backward()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten.lift_fresh", o.summary
    assert "gymnasium" not in o.suggestion and "data set" in o.suggestion, o.suggestion
    assert "missing value" in o.suggestion and "__getitem__" in o.suggestion, o.suggestion


# What torch_geometric/template.py writes for a MessagePassing layer (nn/conv/propagate.jinja,
# cut down): the collect step gathers the source rows, the user's message runs, and the
# aggregation (here a mean written as a sum over a count) reduces them onto the target nodes.
_PYG_PROPAGATE = """\
import torch


def propagate(self, edge_index, x):
    x_j = x.index_select(0, edge_index[0])
    msg = self.message(x_j)
    index = edge_index[1]
    out = x.new_zeros(x.size(0), x.size(1)).index_add_(0, index, msg)
    count = x.new_zeros(x.size(0)).index_add_(0, index, torch.ones_like(index, dtype=x.dtype))
    return out / count.view(-1, 1)
"""


def test_an_origin_inside_pygs_generated_propagate_is_the_users_call_not_the_temp_file(tmp_path):
    """PyG's MessagePassing renders ``propagate`` into a module in the temp dir (tempfile's
    NamedTemporaryFile, prefix ``{cls.__module__}_{cls.__name__}_propagate_``) and imports it. A
    node with no incoming edge made 0 / 0 there, and the origin named
    /tmp/..._HandConv_propagate_<8 chars>.py:10 as the user's line, a file the user never wrote."""
    import importlib.util
    import tempfile

    with tempfile.NamedTemporaryFile("w", prefix=f"{__name__}_HandConv_propagate_", suffix=".py",
                                     delete=False) as f:
        f.write(_PYG_PROPAGATE)
    try:
        spec = importlib.util.spec_from_file_location("pyg_generated_propagate", f.name)
        generated = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(generated)

        class HandConv(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def message(self, x_j):
                return x_j

            def forward(self, x, edge_index):
                return generated.propagate(self, edge_index, x=self.lin(x))

        conv = HandConv()
        edge_index = torch.tensor([[0, 1, 2], [1, 2, 0]])  # node 3 has no incoming edge
        x = torch.randn(4, 4)

        o = origin(record(tmp_path, lambda: conv(x, edge_index).sum().backward()))
    finally:
        os.unlink(f.name)
    assert o.origin.op == "aten.div.Tensor"
    assert (o.origin.file, o.origin.line) == (__file__, HandConv.forward.__code__.co_firstlineno + 1), o.summary
    assert o.origin.module == "", o.origin.module


def test_a_nan_held_already_is_not_said_to_become_nan_in_the_view_that_passes_it_on(tmp_path):
    # nerf-pytorch's render(): `rays_o, rays_d = rays` (unbind) then `torch.reshape(rays_o, [-1, 3])`
    # on a ray batch holding NaN from outside the recording (the guard's replay of a corrupt batch):
    # the report said "then: it became NaN in aten.view", though the unbind's output held it already.
    rays = torch.randn(2, 4, 3)
    rays[0, :2] = float("nan")

    def f():
        ro, _rd = rays
        ro = torch.reshape(ro, [-1, 3]).float()
        (ro * 2).sum().item()

    o = origin(record(tmp_path, f))
    assert [c.op for c in o.chain] == ["aten.view", "aten.unbind.int"]
    assert "became NaN" not in o.harm and "became NaN" not in o.summary, o.harm
    assert o.harm.startswith("it became harmful in aten.view"), o.harm


def test_a_run_check_numerics_stopped_at_the_nan_does_not_say_training_never_used_it(tmp_path):
    # litgpt's loop with a planted log(0) under `trainguard run --check-numerics`: check_numerics
    # stops at the log_softmax that made the NaN, so the recording ends there. The report said "it
    # reached no loss, gradient or parameter by the end of the recording: training never used it",
    # of the NaN that was the loss's: the run stopped before the loss could be computed.
    logits = torch.randn(4, 8, requires_grad=True)

    def f():
        x = logits + torch.log(torch.zeros(()))
        torch.nn.functional.cross_entropy(x, torch.zeros(4, dtype=torch.long)).backward()

    with pytest.raises(tg.NonFiniteError):
        with tg.check_numerics(tmp_path / "r", mode="full_health"):
            f()
    o = origin(open_run(tmp_path / "r"))
    assert o.origin.op == "aten._log_softmax"
    assert o.reached_training is None, o.reached_training


@pytest.mark.parametrize("buffer", [-1, 8])
def test_a_nan_in_a_batch_a_dataloader_worker_built_is_told_to_check_the_data(tmp_path, buffer):
    """fastai's DataLoader (and any torch DataLoader with num_workers > 0) builds each batch in a
    worker process: it reaches the recorded process as ``aten.set_`` onto the shared memory it came
    in. A NaN in one sample was explained as "set_ reduced an empty input to nan: input 0
    (aten.empty.memory_format) holds 0 values, and the mean of no values is 0/0", fixed with "the
    batch is empty" (the whole recording), or "set_ turned finite inputs into nan" (a circular buffer
    that evicted the empty tensor, as `trainguard run` records by default). From a fastai
    ``Learner.fit_one_cycle`` over ``DataLoaders.from_dsets`` with one NaN pixel in 512 samples."""
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    x[37, 2] = float("nan")
    model = nn.Linear(4, 1)

    def f():
        dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, num_workers=1)
        for xb, yb in dl:
            nn.functional.mse_loss(model(xb), yb).backward()

    with tg.record(tmp_path / "r", buffer=buffer):
        f()
    o = origin(open_run(tmp_path / "r"))
    assert o.origin.op.startswith("aten.set_.source_Storage"), o.summary
    why = o.origin.explanation
    assert "empty" not in why and "turned finite inputs" not in why, why
    assert "DataLoader worker" in why, why
    assert "empty" not in o.suggestion and "num_workers=0" in o.suggestion and "data set" in o.suggestion, o.suggestion


def test_an_overflow_in_a_loop_that_clips_is_not_told_to_clip(tmp_path):
    # diffusers' hand-written DDPM loop clips its gradients (clip_grad_norm_, max_norm=1.0); an
    # overflow there was told "lower the learning rate or clip gradients (torch.nn.utils.clip_grad_norm_)".
    # Here a rate far too high (1e20) moves a clipped Linear to 1e20 and its next forward overflows.
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=1e20)

    def train():
        for _ in range(2):
            loss = lin(torch.full((2, 4), 1e19)).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lin.parameters(), max_norm=1.0)
            opt.step()
            opt.zero_grad()
            loss.item()

    o = origin(record(tmp_path, train))
    assert o.origin.step == 1 and o.origin.explanation.startswith("overflow"), o.summary
    assert "lower the learning rate" in o.suggestion, o.suggestion
    assert "clip gradients (torch.nn.utils.clip_grad_norm_)" not in o.suggestion, o.suggestion
    assert "already clips" in o.suggestion and "max_norm=1" in o.suggestion, o.suggestion


def test_an_exp_used_as_a_scale_is_told_to_bound_the_scale(tmp_path):
    # VincentStimper/normalizing-flows' AffineCouplingBlock.inverse (normflows/flows/affine/coupling.py:156,
    # `z2 = (z2 - shift) * torch.exp(-scale_)`) with the scale net's last bias at -100: the fix said "subtract
    # the maximum first (logsumexp / softmax do) or clamp the input, e.g. x.clamp(max=80)", a softmax's fix.
    torch.manual_seed(0)
    scale_net = nn.Linear(2, 2)
    with torch.no_grad():
        scale_net.bias.fill_(-100.0)

    def inverse():
        z = torch.randn(8, 2)
        z1, z2 = z[:, :1], z[:, 1:]
        scale = scale_net(z)[:, 1:]
        z = torch.cat([z1, z2 * torch.exp(-scale)], 1)
        # the base distribution's log-probability, as torch.distributions.Normal.log_prob divides by the scale
        return (-0.5 * ((z - 0.0) / 1.0) ** 2).sum().item()

    o = origin(record(tmp_path / "flow", inverse))
    assert o.origin.op == "aten.exp", o.summary
    assert "logsumexp" not in o.suggestion and "tanh" in o.suggestion, o.suggestion

    def masked_softmax():  # exp times a mask, summed, divided: a softmax by hand, whose fix stays
        x = torch.full((2, 4), 100.0)
        e = torch.exp(x) * torch.ones(2, 4)
        return (e / e.sum(1, keepdim=True)).sum().item()

    o = origin(record(tmp_path / "softmax", masked_softmax))
    assert o.origin.op == "aten.exp" and "logsumexp" in o.suggestion, o.suggestion


def test_a_power_that_overflowed_after_updates_is_not_told_to_normalise_the_data_first(tmp_path):
    # gpytorch's exact GP at lr=10: the RBF kernel's lengthscale collapsed towards 0, x / lengthscale
    # grew and its square overflowed in step 12. The fix said "normalise the input (data straight from
    # a loader ...)". Here a divisor the updates drove to 1e-25, in step 2.
    ls = nn.Parameter(torch.tensor(1.0))
    opt = torch.optim.SGD([ls], lr=1.0)
    x = torch.linspace(-1, 1, 8)

    def train():
        for target in (1.0, 1e-25, None):
            d = (x / ls).pow(2)
            if target is None:
                d.sum().item()
                break
            opt.zero_grad()
            ((ls - target) ** 2).backward()
            opt.step()
            with torch.no_grad():
                ls.fill_(target)  # where the updates took it over many steps

    o = origin(record(tmp_path, train))
    assert o.origin.op == "aten.pow.Tensor_Scalar" and o.origin.step == 2, o.summary
    assert not o.suggestion.startswith("an input holds values too large to raise to this power in its dtype: "
                                       "normalise the input"), o.suggestion
    assert "learning rate" in o.suggestion, o.suggestion


def test_a_float16_overflow_under_autocast_leads_with_the_dtype_not_the_learning_rate(tmp_path):
    # milesial/Pytorch-UNet train.py (@21d7850) with --amp in float16 on raw 16-bit images (0..65535):
    # the first conv overflowed float16 at step 8 and the fix began "lower the learning rate", where
    # float32 or bfloat16 hold the value (the GradScaler finding of the same run said bf16)
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False)
    with torch.no_grad():
        conv.weight.abs_()  # weights grown by the first updates: 27 inputs near 30,000 sum past 65504
    x = torch.rand(1, 3, 8, 8) * 65535

    def step():
        tg.step()  # after an update: step 0's forward would say no update made the overflow
        with torch.autocast("cpu", dtype=torch.float16):
            conv(x).float().sum().item()

    o = origin(record(tmp_path, step))
    assert o.origin.op == "aten.convolution", o.origin
    s = o.suggestion
    assert s.startswith("values overflow float16") and "bfloat16" in s and "compute this op in float32" in s, s


def test_a_nan_image_the_script_crashed_on_is_not_called_unused(tmp_path):
    """facebookresearch/detr @ 29901c5 (engine.py's train_one_epoch, models/matcher.py) with a
    corrupt image: its NaN went through the model's forward and into generalized_box_iou's
    ``assert (boxes1[:, 2:] >= boxes1[:, :2]).all()`` (util/box_ops.py), which a comparison
    absorbs, so no loss, gradient or parameter was reached, and the script crashed there. The
    report said "training never used it", of the value the script had just crashed on."""
    import subprocess

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, idx):
            img = torch.randn(3, 4, 4)
            if idx == 5:
                img[0, 1, 1] = float("nan")
            return img

    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def f():
        for x in torch.utils.data.DataLoader(Images(), batch_size=2):
            boxes = model(x).sigmoid()
            xyxy = torch.cat([boxes[:, :2] - boxes[:, 2:] / 2, boxes[:, :2] + boxes[:, 2:] / 2], dim=1)
            if not (xyxy[:, 2:] >= xyxy[:, :2]).all():  # generalized_box_iou's assert
                raise AssertionError
            opt.zero_grad()
            nn.functional.l1_loss(boxes, torch.full_like(boxes, 0.5)).backward()
            opt.step()

    with pytest.raises(AssertionError):
        record(tmp_path, f)
    run = open_run(tmp_path / "r")
    o = origin(run)
    assert o.reached_training is False and o.crashed is not None, o.summary
    assert o.crashed["step"] == 2 and o.crashed["error"] == "AssertionError", o.crashed
    assert "crashed in step 2" in o.summary, o.summary
    out = subprocess.run([sys.executable, "-m", "trainguard", "report", str(tmp_path / "r")], capture_output=True,
                         text=True, env={**os.environ, "COLUMNS": "200"}).stdout
    assert "training never used it" not in out, out
    assert "the script crashed in step 2 (AssertionError)" in out, out


def _raw2alpha_without_relu():
    # yenchenlin/nerf-pytorch@63a5a63 run_nerf.py raw2outputs with raw2alpha's act_fn=F.relu dropped
    # (raw2alpha = lambda raw, dists: 1. - torch.exp(-raw * dists)): a negative raw density at the last
    # sample, whose distance is 1e10, makes exp(+huge) = inf.
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    pts = torch.randn(4, 8, 3)
    z_vals = torch.linspace(2.0, 6.0, 8).expand(4, 8)
    dists = z_vals[..., 1:] - z_vals[..., :-1]
    dists = torch.cat([dists, torch.Tensor([1e10]).expand(dists[..., :1].shape)], -1)
    raw = net(pts)[..., 0]
    alpha = 1. - torch.exp(-raw * dists)
    weights = alpha * torch.cumprod(torch.cat([torch.ones((4, 1)), 1. - alpha + 1e-10], -1), -1)[:, :-1]
    loss = ((weights.sum(-1) - 1.0) ** 2).mean()
    loss.backward()


def test_exp_of_a_negated_density_is_told_to_keep_the_density_non_negative(tmp_path):
    # The fix said "subtract the maximum first (logsumexp / softmax do) or clamp the input, e.g.
    # x.clamp(max=80)": a clamped exponent leaves alpha = 1 - e^80 and trains on negative densities.
    o = origin(record(tmp_path, _raw2alpha_without_relu))
    assert o.origin.op == "aten.exp"
    assert "F.relu" in o.suggestion and "softplus" in o.suggestion, o.suggestion
    assert "logsumexp" not in o.suggestion, o.suggestion


class _Evicted:
    """A run as a long recording under `trainguard run --monitor` leaves it (nerf's raw2alpha at step 0
    of 60): only the executions in ``keep`` are stored, the negation before the exp's input is gone."""

    def __init__(self, run, keep):
        self._run, self._keep = run, set(keep)

    def __getattr__(self, name):
        return getattr(self._run, name)

    def execution(self, seq):
        if seq not in self._keep:
            raise KeyError(seq)
        e = dict(self._run.execution(seq))
        e["inputs"] = [i if i.get("producer") in self._keep else dict(i, producer_digest=None) for i in e["inputs"]]
        return e


def test_exp_of_a_negated_density_is_told_so_when_the_negation_was_evicted(tmp_path):
    from trainguard.analysis._origin import negated_exponent

    run = record(tmp_path, _raw2alpha_without_relu)
    exp = origin(run).origin
    product = run.execution(exp.seq)["inputs"][0]["producer"]
    assert negated_exponent(run, exp)
    assert negated_exponent(_Evicted(run, {exp.seq, product}), exp)  # read off the stored line


def test_a_parameter_that_held_nan_before_the_recording_is_not_said_to_be_made_of_finite_inputs(tmp_path):
    # facebookresearch/dino @ 7c446df5: a guard rewind that left the EMA teacher (outside the TrainState)
    # NaN; the replay's recording began with it. The origin read "t turned finite inputs into nan": the
    # transpose of the teacher's weight, which never makes a NaN, of an input no recording summarised.
    torch.manual_seed(0)
    student, teacher = nn.Linear(4, 4), nn.Linear(4, 4)
    with torch.no_grad():
        teacher.weight[1, 2] = float("nan")
    opt = torch.optim.SGD(student.parameters(), lr=0.1)

    def step():
        x = torch.randn(8, 4)
        with torch.no_grad():
            t = teacher(x).softmax(-1)
        loss = -(t * student(x).log_softmax(-1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    o = origin(record(tmp_path, step))
    why = o.origin.explanation
    assert "finite inputs" not in why, why
    assert "parameter" in why and "held" in why and "before the recording" in why, why


def test_a_schedule_table_from_numpy_with_an_inf_entry_is_told_of_the_table_not_of_the_data(tmp_path):
    """facebookresearch/DiT's diffusion/gaussian_diffusion.py @ ed81ce2 keeps its schedule as NumPy
    arrays and reads them per batch with `_extract_into_tensor` (`th.from_numpy(arr)...[timesteps]`).
    With betas_for_alpha_bar's max_beta at 1.0 alphas_cumprod is 0 at the last step, and
    sqrt(1 / alphas_cumprod) holds +inf there: only a batch that draws t = T-1 goes NaN. The origin
    called the table "the data" and the fix pointed at a data set, an environment, a gymnasium wrapper."""
    import numpy as np

    betas = np.linspace(1e-4, 0.02, 10)
    betas[-1] = 1.0  # max_beta=1.0: alphas_cumprod[-1] == 0
    alphas_cumprod = np.cumprod(1.0 - betas)
    with np.errstate(divide="ignore"):
        sqrt_recip_alphas_cumprod = np.sqrt(1.0 / alphas_cumprod)
        sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / alphas_cumprod - 1)
    torch.manual_seed(0)
    model = nn.Conv2d(4, 4, 3, padding=1)

    def extract(arr, timesteps, shape):  # _extract_into_tensor
        res = torch.from_numpy(arr).to(device=timesteps.device)[timesteps].float()
        while len(res.shape) < len(shape):
            res = res[..., None]
        return res + torch.zeros(shape)

    def f():
        for t in (torch.tensor([1, 3]), torch.tensor([9, 2])):  # the second batch draws the last step
            x_t = torch.randn(2, 4, 8, 8)
            eps = model(x_t)
            pred_xstart = (extract(sqrt_recip_alphas_cumprod, t, x_t.shape) * x_t
                           - extract(sqrt_recipm1_alphas_cumprod, t, x_t.shape) * eps)
            pred_xstart.pow(2).mean().backward()

    o = origin(record(tmp_path, f))
    assert o.origin.op == "aten.lift_fresh" and o.origin.function == "extract", o.summary
    assert "lookup table" in o.origin.explanation and "the data" not in o.origin.explanation, o.origin.explanation
    assert "data set" not in o.suggestion and "environment" not in o.suggestion, o.suggestion
    assert "alphas_cumprod" in o.suggestion and "max_beta" in o.suggestion, o.suggestion
