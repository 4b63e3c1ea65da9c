"""A NaN that stays in a value training never uses is not the origin of a later NaN loss."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.analysis import origin
from trainguard.store import open_run


def _render(net, colors, rays, z):
    # yenchenlin/nerf-pytorch run_nerf.py raw2outputs, reduced: a ray whose densities are all 0
    # has weights summing to 0, and its disparity is 0/0 = NaN. The training loop drops the
    # disparity (only the colour goes into the loss), so the NaN reaches nothing.
    sigma = torch.relu(net(rays))  # [rays, samples]
    alpha = 1.0 - torch.exp(-sigma * 0.5)
    trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1.0 - alpha + 1e-10], -1), -1)[:, :-1]
    weights = alpha * trans
    rgb = weights @ colors
    depth = (weights * z).sum(-1)
    disp = 1.0 / torch.max(1e-10 * torch.ones_like(depth), depth / weights.sum(-1))  # 0/0 -> NaN
    return rgb, disp


def _train(fault_step: int):
    torch.manual_seed(0)
    net = nn.Linear(3, 8)
    with torch.no_grad():
        net.weight.fill_(0.5)
        net.bias.fill_(-1.0)
    colors = nn.Parameter(torch.rand(8, 3))
    opt = torch.optim.Adam([*net.parameters(), colors], lr=1e-3)
    z = torch.linspace(2.0, 6.0, 8)
    rays = torch.tensor([[-5.0, -5.0, -5.0], [1.0, 2.0, 3.0], [2.0, 1.0, 0.5], [0.5, 0.5, 2.0]])
    for step in range(5):
        target = torch.rand(4, 3)
        if step == fault_step:
            target[1, 0] = float("nan")  # a corrupt target pixel: the loss turns NaN
        rgb, _disp = _render(net, colors, rays, z)
        loss = ((rgb - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net


FAULT_LINE = inspect.getsource(_train).splitlines().index(
    '            target[1, 0] = float("nan")  # a corrupt target pixel: the loss turns NaN') + _train.__code__.co_firstlineno
DISP_LINE = inspect.getsource(_render).splitlines().index(
    "    disp = 1.0 / torch.max(1e-10 * torch.ones_like(depth), depth / weights.sum(-1))  # 0/0 -> NaN"
) + _render.__code__.co_firstlineno


@pytest.mark.parametrize("backend", ["python", "native"])
@pytest.mark.parametrize("buffer", [-1, 200])
def test_the_nan_loss_is_traced_to_its_own_origin_not_to_an_unused_earlier_nan(tmp_path, backend, buffer):
    d = tmp_path / "r"
    with tg.record(d, buffer=buffer, backend=backend):
        _train(fault_step=3)
    run = open_run(d)
    assert run.first_harm()["step"] == 0  # the disparity's NaN, made every step, is still counted
    o = origin(run)
    assert (o.origin.line, o.origin.step) == (FAULT_LINE, 3), (o.origin.op, o.origin.line, o.origin.step)


def test_the_nonfinite_loss_finding_names_the_nan_that_reached_the_loss(tmp_path):
    d = tmp_path / "r"
    with tg.record(d), tg.Monitor(None, d, every=1) as mon:
        _train(fault_step=3)
    nonfinite = next(f for f in mon.findings if f.kind == "nonfinite_loss")
    assert nonfinite.evidence["first_step"] == 3
    assert nonfinite.evidence["origin"]["line"] == FAULT_LINE, nonfinite.title
    assert f":{DISP_LINE}" not in nonfinite.title and f":{DISP_LINE}" not in nonfinite.suggestion


def test_a_nan_that_reached_nothing_is_still_the_origin_when_the_loss_stays_finite(tmp_path):
    d = tmp_path / "r"
    with tg.record(d, buffer=-1):
        _train(fault_step=-1)
    o = origin(open_run(d))
    assert (o.origin.op, o.origin.line, o.origin.step) == ("aten.div.Tensor", DISP_LINE, 0)


def test_the_report_says_the_origin_reached_training_and_names_the_earlier_nan(tmp_path, capsys):
    from trainguard.cli import main

    d = tmp_path / "r"
    with tg.record(d, buffer=-1):
        _train(fault_step=3)
    o = origin(open_run(d)).to_dict()
    assert (o["earlier"]["op"], o["earlier"]["line"], o["earlier"]["step"]) == ("aten.div.Tensor", DISP_LINE, 0)
    assert main(["report", str(d)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "First harmful value:" not in out  # the alerts table's first is the division
    assert "Harmful value that reached training: aten.lift_fresh" in out, out
    assert f"test_origin_side_output.py:{DISP_LINE} in step 0" in out, out


def test_a_link_whose_input_record_is_gone_passed_the_value_on(tmp_path):
    # nerf-pytorch's img2mse, (x - y) ** 2, on rays holding NaN: under the monitor's recording only
    # the first harmful execution of each op type and step is stored, so the pow's input (the
    # sub) is gone; the chain said "pow overflow: an input value too large for a power", which
    # never makes NaN from finite values.
    d = tmp_path / "r"
    with tg.record(d, buffer=-1):
        _train(fault_step=3)
    run = open_run(d)
    chain = origin(run).chain
    pow_link = next(c for c in chain if c.op == "aten.pow.Tensor_Scalar")
    from trainguard.analysis._origin import explain

    gone = [dict(i, producer_op=None, summary=None, description="?") for i in pow_link.inputs]
    text = explain(type(pow_link)(**{**pow_link.__dict__, "inputs": gone}))
    assert "overflow" not in text and "passed on" in text, text


def test_a_first_nan_that_reached_nothing_says_so(tmp_path, capsys):
    # A healthy nerf run: 'trainguard report' showed the disparity's NaN as the first harmful value,
    # with its fix, and nothing saying that the loss, the gradients and the weights never saw it.
    from trainguard.cli import main

    d = tmp_path / "r"
    with tg.record(d, buffer=-1):
        _train(fault_step=-1)
    assert origin(open_run(d)).reached_training is False
    assert main(["report", str(d)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "First harmful value: aten.div.Tensor" in out
    assert "it reached no loss, gradient or parameter" in out, out

    d2 = tmp_path / "r2"
    with tg.record(d2, buffer=-1):
        _train(fault_step=3)
    assert origin(open_run(d2)).reached_training is True


def _sample_pdf(bins, weights, n):
    # yenchenlin/nerf-pytorch@63a5a63 run_nerf_helpers.py sample_pdf (det=True) without its
    # `weights = weights + 1e-5  # prevent nans`: a ray with no density makes pdf 0/0 = NaN.
    pdf = weights / torch.sum(weights, -1, keepdim=True)
    cdf = torch.cumsum(pdf, -1)
    cdf = torch.cat([torch.zeros_like(cdf[..., :1]), cdf], -1)
    u = torch.linspace(0., 1., steps=n).expand(list(cdf.shape[:-1]) + [n]).contiguous()
    inds = torch.searchsorted(cdf, u, right=True)
    inds_g = torch.stack([torch.clamp(inds - 1, min=0), torch.clamp(inds, max=cdf.shape[-1] - 1)], -1)
    matched = [inds_g.shape[0], inds_g.shape[1], cdf.shape[-1]]
    cdf_g = torch.gather(cdf.unsqueeze(1).expand(matched), 2, inds_g)
    bins_g = torch.gather(bins.unsqueeze(1).expand(matched), 2, inds_g)
    denom = cdf_g[..., 1] - cdf_g[..., 0]
    denom = torch.where(denom < 1e-5, torch.ones_like(denom), denom)
    t = (u - cdf_g[..., 0]) / denom
    return bins_g[..., 0] + t * (bins_g[..., 1] - bins_g[..., 0])


PDF_LINE = inspect.getsource(_sample_pdf).splitlines().index(
    "    pdf = weights / torch.sum(weights, -1, keepdim=True)") + _sample_pdf.__code__.co_firstlineno


def _coarse_and_fine_step():
    # nerf-pytorch's render_rays: the coarse pass (its disparity is 0/0 = NaN for the ray with no
    # density, unused), then the fine samples drawn from the coarse weights, whose NaN reaches the
    # loss through the fine pass, all in one step, as in a guard's replay of the failing step.
    torch.manual_seed(0)
    net, fine = nn.Linear(3, 8), nn.Linear(1, 1)
    with torch.no_grad():
        net.weight.fill_(0.5)
        net.bias.fill_(-1.0)
    colors = nn.Parameter(torch.rand(8, 3))
    z = torch.linspace(2.0, 6.0, 8)
    rays = torch.tensor([[-5.0, -5.0, -5.0], [1.0, 2.0, 3.0], [2.0, 1.0, 0.5], [0.5, 0.5, 2.0]])
    rgb, _disp = _render(net, colors, rays, z)
    weights = 1.0 - torch.exp(-torch.relu(net(rays)) * 0.5)
    z_mid = (0.5 * (z[1:] + z[:-1])).expand(4, 7)
    z_samples = _sample_pdf(z_mid, weights[..., 1:-1], 8).detach()
    z_fine, _ = torch.sort(torch.cat([z.expand(4, 8), z_samples], -1), -1)
    depth_fine = (torch.sigmoid(fine(z_fine[..., None]))[..., 0] * z_fine).mean(-1)
    loss = ((rgb - 0.5) ** 2).mean() + ((depth_fine - 4.0) ** 2).mean()
    loss.backward()
    return loss


@pytest.mark.parametrize("backend", ["python", "native"])
def test_a_nan_loss_is_traced_to_its_own_origin_when_the_unused_nan_came_first_in_the_same_step(tmp_path, backend):
    # A guard's replay of nerf-pytorch's failing step (sample_pdf without its 1e-5) records that step
    # alone: the disparity's unused NaN comes first in it, and the guard said "origin: aten.div.Tensor
    # at run_nerf.py:299 (the disparity)" with the fix for that line, not the sample_pdf division
    # that made the loss NaN.
    d = tmp_path / "r"
    with tg.record(d, buffer=-1, backend=backend):
        assert _coarse_and_fine_step().isnan()
    run = open_run(d)
    o = origin(run)
    assert (o.origin.op, o.origin.line) == ("aten.div.Tensor", PDF_LINE), (o.origin.op, o.origin.line)
    assert o.reached_training is True
    assert o.earlier is not None and o.earlier["line"] == DISP_LINE, o.earlier
