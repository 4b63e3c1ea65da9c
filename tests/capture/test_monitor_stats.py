"""The on-device layer statistics against a NumPy reference (hypothesis)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.capture._layer_stats import (
    activation_stats,
    grad_stats,
    histogram,
    input_stats,
    sparse_values,
)

shapes = st.lists(st.integers(1, 6), min_size=2, max_size=4)
dtypes = st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16])


@st.composite
def tensors(draw, allow_nonfinite=False):
    shape = draw(shapes)
    dtype = draw(dtypes)
    n = int(np.prod(shape))
    pool = [0.0, 0.0, 1.0, -1.0, 0.5, 2.5, -3.0, 0.999, 100.0]
    if allow_nonfinite:
        pool += [math.nan, math.inf, -math.inf]
    values = draw(st.lists(st.sampled_from(pool) | st.floats(-10, 10), min_size=n, max_size=n))
    t = torch.tensor(values, dtype=torch.float64).reshape(shape).to(dtype)
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)  # a non-contiguous view
    return t


def names_values(vec, names):
    return dict(zip(names, vec.tolist()))


def finished(x, unit_dim, prev, sat):
    """activation_stats as the monitor stores it: raw values finished on the host."""
    raw, names, dead, finish = activation_stats(x, unit_dim, prev, sat)
    return dict(zip(names, finish(raw.tolist()))), dead


@settings(max_examples=150, deadline=None)
@given(x=tensors(), channel_first=st.booleans(), sat=st.sampled_from([None, "tanh", "sigmoid"]))
def test_activation_stats_match_numpy(x, channel_first, sat):
    ref = x.to(torch.float64).numpy()
    unit_dim = 1 if channel_first else -1
    got, dead = finished(x, unit_dim, None, sat)
    tol = 1e-5 if x.dtype in (torch.float32, torch.float64) else 1e-3
    scale = max(1.0, float(np.abs(ref).max()))
    assert got["mean"] == pytest.approx(ref.mean(), abs=tol * scale)
    assert got["std"] == pytest.approx(ref.std(ddof=1) if ref.size > 1 else math.nan, nan_ok=True, abs=tol * scale * 10)
    assert got["min"] == pytest.approx(ref.min()) and got["max"] == pytest.approx(ref.max())
    assert got["zero_frac"] == pytest.approx((ref == 0).mean())
    axis = tuple(d for d in range(ref.ndim) if d != unit_dim % ref.ndim)
    ref_dead = (ref == 0).all(axis=axis)
    assert got["dead_frac"] == pytest.approx(ref_dead.mean())
    assert dead.tolist() == ref_dead.tolist()
    work = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32).numpy()  # the dtype computed in
    if sat == "tanh":
        assert got["sat_frac"] == pytest.approx((np.abs(work) > work.dtype.type(0.99)).mean())
    elif sat == "sigmoid":
        assert got["sat_frac"] == pytest.approx((np.abs(work - work.dtype.type(0.5)) > work.dtype.type(0.49)).mean())
    else:
        assert "sat_frac" not in got
    if ref.ndim == 2 and ref.shape[0] > 1:
        # how much the rows differ, per unit (dim 1 either way), pooled over the units (RMS of the per-unit
        # std); one pass, from the squares about the overall mean: to within 0.2% of the values' spread
        ref_rows = math.sqrt(ref.var(axis=0, ddof=1).mean())
        assert got["row_std"] == pytest.approx(ref_rows, abs=2e-3 * got["std"] + tol * scale * 10)
    else:
        assert "row_std" not in got


def test_identical_rows_have_no_row_spread_whatever_their_values():
    # facebookresearch/dino's DINOHead output (vision_transformer.py) once DINO collapsed: every
    # image got the same vector of 64 logits, spread over its units as before (std 0.02).
    torch.manual_seed(0)
    row = torch.randn(64) * 0.02
    got, _ = finished(row.expand(48, 64).contiguous(), -1, None, None)
    assert got["row_std"] < 1e-6 * got["std"] and got["std"] == pytest.approx(float(row.std()), rel=0.1)
    got, _ = finished(row + 0.02 * torch.randn(48, 64), -1, None, None)
    assert got["row_std"] == pytest.approx(0.02, rel=0.1)


def test_dead_stay_is_relative_to_the_previous_mask():
    prev = torch.tensor([True, True, False, True])
    x = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    got, dead = finished(x, -1, prev, None)
    assert dead.tolist() == [True, False, True, True]
    assert got["dead_stay"] == pytest.approx(2 / 3)  # units 0 and 3 of the 3 previously dead


@settings(max_examples=100, deadline=None)
@given(gs=st.lists(tensors(allow_nonfinite=True), min_size=1, max_size=4))
def test_grad_stats_match_numpy(gs):
    gs = [g.contiguous() for g in gs]
    mat, names, l2 = grad_stats(gs)
    for g, row, norm in zip(gs, mat, l2):
        got = names_values(row, names)
        got["mean_abs"] /= g.numel()  # the host's part
        assert norm.item() == pytest.approx(row[2].item(), rel=1e-6) or not math.isfinite(row[2].item())
        ref = g.to(torch.float64).numpy()
        finite = np.isfinite(ref)
        assert got["nonfinite"] == (~finite).sum()
        if finite.all():
            tol = 1e-5 if g.dtype in (torch.float32, torch.float64) else 1e-2
            assert got["mean_abs"] == pytest.approx(np.abs(ref).mean(), rel=tol, abs=1e-6)
            assert got["max_abs"] == pytest.approx(np.abs(ref).max(), rel=tol)
            assert got["norm"] == pytest.approx(np.sqrt((ref ** 2).sum()), rel=tol, abs=1e-6)
        else:
            assert not math.isfinite(got["mean_abs"])


@settings(max_examples=100, deadline=None)
@given(x=tensors(allow_nonfinite=True), bins=st.integers(2, 12))
def test_histogram_counts_every_finite_value_once(x, bins):
    out = histogram(x, bins).tolist()
    ref = x.to(torch.float64).numpy().ravel()
    finite = ref[np.isfinite(ref)]
    counts = out[2:]
    assert len(counts) == bins and sum(counts) == finite.size
    if finite.size:
        assert out[0] == pytest.approx(finite.min()) and out[1] == pytest.approx(finite.max())
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        if finite.max() - finite.min() < torch.finfo(work).tiny:  # one value, or a subnormal range
            assert counts[0] == finite.size
        else:
            assert counts[0] >= (finite == finite.min()).sum() and counts[-1] >= (finite == finite.max()).sum()


def test_input_stats_per_feature():
    x = torch.tensor([[1.0, 100.0], [3.0, 300.0], [5.0, 500.0]])
    vec, names = input_stats(x)
    got = names_values(vec, names)
    assert got["feat_mean_absmax"] == pytest.approx(300.0)
    assert got["feat_std_max"] == pytest.approx(200.0) and got["feat_std_min"] == pytest.approx(2.0)
    assert input_stats(torch.arange(6).reshape(2, 3)) is None  # token ids: nothing to normalise


@pytest.mark.parametrize("shape, unit_dim", [((600, 512), -1), ((8, 40, 32, 32), 1)])
def test_large_activations_take_the_low_memory_path_with_the_same_answers(shape, unit_dim):
    g = torch.Generator().manual_seed(0)
    x = torch.relu(torch.randn(shape, generator=g))
    x.select(unit_dim % x.dim(), 3).zero_()  # a dead unit
    assert x.numel() > (1 << 18)
    got, dead = finished(x, unit_dim, None, None)
    ref = x.double().numpy()
    axis = tuple(d for d in range(ref.ndim) if d != unit_dim % ref.ndim)
    assert dead.tolist() == (ref == 0).all(axis=axis).tolist() and dead[3]
    assert got["zero_frac"] == pytest.approx((ref == 0).mean())
    assert got["std"] == pytest.approx(ref.std(ddof=1), rel=1e-4)


def test_one_value_has_no_spread_to_measure():
    got, _ = finished(torch.tensor([[0.3]]), -1, None, None)
    assert math.isnan(got["std"]) and got["mean"] == pytest.approx(0.3)


class _ActorCritic(torch.nn.Module):
    """pytorch/examples' reinforcement_learning/actor_critic.py: one state per forward, a value
    head of one unit. Its value head's output is one number per call, whose "std" was 0, and the
    run got "Collapsed activations: layer value_head's outputs have std 0"."""

    def __init__(self):
        super().__init__()
        self.affine1 = torch.nn.Linear(4, 32)
        self.action_head = torch.nn.Linear(32, 2)
        self.value_head = torch.nn.Linear(32, 1)

    def forward(self, x):
        x = torch.relu(self.affine1(x))
        return torch.softmax(self.action_head(x), dim=-1), self.value_head(x)


def test_a_value_head_run_on_one_state_is_not_called_collapsed(tmp_path):
    import trainguard as tg

    torch.manual_seed(0)
    model = _ActorCritic()
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    with tg.Monitor(model, tmp_path / "r", every=5) as mon:
        for _ in range(25):  # episodes of 3 steps, one state per forward
            losses = []
            for _ in range(3):
                probs, value = model(torch.randn(4))
                m = torch.distributions.Categorical(probs)
                a = m.sample()
                ret = torch.randn(())
                losses += [-m.log_prob(a) * (ret - value.item()), torch.nn.functional.smooth_l1_loss(value, ret[None])]
            opt.zero_grad()
            torch.stack(losses).sum().backward()
            opt.step()
    kinds = {f.kind for f in mon.findings if f.is_problem}
    assert "collapsed_activations" not in kinds, [f.title for f in mon.findings]
    rms = tg.open(tmp_path / "r").layer_stats(layer="value_head")
    assert any(r["stat"] == "mean" and r["value"] != 0 for r in rms)


def test_a_criterion_inside_the_model_returning_a_scalar_is_measured(tmp_path, caplog):
    # timm's ClassificationTask (timm/task/task.py) holds its criterion as a submodule: the loss
    # module's output is a 0-d tensor, and "layer hook failed on criterion ... IndexError" was logged.
    import trainguard as tg

    class Task(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.trainable_module = torch.nn.Linear(4, 3)
            self.criterion = torch.nn.CrossEntropyLoss()

        def forward(self, x, y):
            return self.criterion(self.trainable_module(x), y)

    torch.manual_seed(0)
    task = Task()
    opt = torch.optim.SGD(task.parameters(), lr=0.1)
    losses = []
    with tg.Monitor(task, tmp_path / "r", every=2):
        for _ in range(4):
            loss = task(torch.randn(8, 4), torch.randint(0, 3, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert "hook failed" not in caplog.text
    means = [r["value"] for r in tg.open(tmp_path / "r").layer_stats(layer="criterion") if r["stat"] == "mean"]
    assert means == [pytest.approx(losses[0]), pytest.approx(losses[2])]


@pytest.mark.parametrize("sparse_dim", [1, 2])
def test_sparse_values_sum_duplicates_like_coalesce(sparse_dim):
    g = torch.Generator().manual_seed(sparse_dim)
    shape = (5, 4, 3)
    idx = torch.stack([torch.randint(0, n, (30,), generator=g) for n in shape[:sparse_dim]])
    t = torch.sparse_coo_tensor(idx, torch.randn(30, *shape[sparse_dim:], generator=g), shape)
    assert not t.is_coalesced()
    got = sparse_values(t)
    want = t.coalesce().values()
    assert got.shape == t._values().shape
    assert torch.allclose(got[: want.shape[0]], want, atol=1e-6) and not got[want.shape[0]:].any()


def row_codes(x, unit_dim):
    """count_codes of one output, as the monitor counts it: ([perplexity, non-zero rows], rows)."""
    from trainguard.capture._layer_stats import count_codes, row_hashes

    h = row_hashes(x, unit_dim)
    return None if h is None else (count_codes([h])[0], h.shape[0])


def test_row_codes_counts_the_distinct_rows_an_output_takes():

    # a quantizer's output through the straight-through estimator z + (q - z): two codes of RMS
    # ~0.01 and inputs of RMS ~10 round each copy of a code differently (by ~1e-6): still two rows
    torch.manual_seed(0)
    codes = torch.randn(2, 8) * 0.01
    pick = torch.arange(64) % 2
    z = torch.randn(64, 8) * 10
    q = (z + (codes[pick] - z)).reshape(4, 4, 4, 8).permute(0, 3, 1, 2)  # [N, C, H, W], channels first
    (eff, live), n = row_codes(q, 1)
    assert n == 64 and live.item() == 64 and abs(eff.item() - 2) < 1e-3
    # rows that all differ: as many as there are (up to the tolerance's merges)
    (eff, _), n = row_codes(torch.randn(300, 16), -1)
    assert n == 256 and eff.item() > 200
    # all-zero rows (ReLU positions with no unit on) are not codes: the rest are counted
    x = torch.randn(64, 8).relu()
    x[:48] = 0
    (eff, live), _ = row_codes(x, -1)
    assert live.item() == 16 and eff.item() > 14
    assert row_codes(torch.randn(5), -1) is None and row_codes(torch.randn(1, 7), -1) is None


def test_row_codes_of_an_output_with_a_few_inf_rows_count_the_finite_rows_as_they_are():
    # milesial/Pytorch-UNet (@21d7850) under float16 autocast on raw 16-bit images: the first conv's
    # output holds a few +inf among thousands of finite rows, and the monitor called it a codebook
    # collapsed to 1 code (the inf rows set the tolerance that merges rows to inf)
    torch.manual_seed(0)
    x = torch.randn(2, 4, 16, 16)
    (clean, _), _ = row_codes(x, 1)
    x[0, :, 0, 0] = math.inf
    (eff, live), _ = row_codes(x, 1)
    assert live.item() == 255 and eff.item() > 0.9 * clean.item() > 100
