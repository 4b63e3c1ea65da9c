"""``trainguard monitor``, ``trainguard diagnose``, ``trainguard export tensorboard`` and the
findings view, end to end on a tiny real training script."""

from __future__ import annotations

import io
import json
import math
import textwrap

import pytest
from rich.console import Console

from trainguard.cli import main
from trainguard.cli._findings_view import findings_json, render_findings, render_findings_table
from trainguard.store import Finding, open_run

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        model[0].bias.fill_(-float(sys.argv[1]))  # a large negative bias kills the ReLU units
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    for step in range(60):
        x = torch.randn(32, 6, generator=g)
        y = x[:, :3].argmax(1)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    """
)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_monitor_prints_findings_and_stores_them(script, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["monitor", "--logdir", str(run_dir), "--every", "5", "--histograms", str(script), "50"]) == 0
    out = capsys.readouterr().out
    assert "dead_units" in out and "fix:" in out and "revive_dead_units" in out
    # the flat loss is a symptom, kept as info and shown under its cause
    assert out.index("ERROR") < out.index("explains:") < out.index("(explained by dead_units)")
    run = open_run(run_dir)
    stored = [f["kind"] for f in run.findings(source="monitor")]
    assert "dead_units" in stored
    assert run.histograms(layer="1")


def test_diagnose_json_and_threshold_overrides(script, tmp_path, capsys):
    run_dir = tmp_path / "run"
    main(["monitor", "--logdir", str(run_dir), "--every", "5", "--json", str(script), "0"])
    healthy = json.loads(capsys.readouterr().out)
    assert healthy["verdict"] == "healthy" and [f["kind"] for f in healthy["findings"]] == ["healthy"]

    assert main(["diagnose", str(run_dir), "--json", "--set", "loss_min_progress=0.99", "--write"]) == 0
    strict = json.loads(capsys.readouterr().out)
    assert strict["verdict"] == "warning" and strict["findings"][0]["kind"] == "loss_not_decreasing"
    assert [f["kind"] for f in open_run(run_dir).findings(source="monitor")] == ["loss_not_decreasing"]

    assert main(["diagnose", str(run_dir), "--list-thresholds", "--set", "dead_units_warn=0.3"]) == 0
    table = capsys.readouterr().out
    assert "dead_units_warn" in table and "(default 0.5)" in table


def test_monitor_runs_a_module_as_python_m_does(script, tmp_path, capsys, monkeypatch):
    # open_clip trains with `python -m open_clip_train.main --model ... --lr ...` (mlfoundations/open_clip,
    # src/open_clip_train/main.py): `trainguard monitor -m open_clip_train.main ...` stopped with
    # "unrecognized arguments: -m", while `trainguard run -m` took it.
    (tmp_path / "train_mod.py").write_text(SCRIPT + "print('args', sys.argv[1:], __name__)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir = tmp_path / "run"
    assert main(["monitor", "--logdir", str(run_dir), "--every", "5", "-m", "train_mod", "50", "--lr", "1"]) == 0
    out = capsys.readouterr().out
    assert "args ['50', '--lr', '1'] __main__" in out and "dead_units" in out
    assert "dead_units" in [f["kind"] for f in open_run(run_dir).findings(source="monitor")]
    assert main(["monitor", "--logdir", str(tmp_path / "x"), "-m", "no_such_module_here"]) == 2
    assert "no module named 'no_such_module_here'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["diagnose", "{tmp}/missing"], "no such run directory"),
        (["diagnose", "{run}", "--set", "bogus=1"], "unknown threshold 'bogus'"),
        (["diagnose", "{run}", "--set", "dead_units_warn"], "--set needs NAME=VALUE"),
        (["monitor", "--logdir", "{tmp}/x", "{tmp}/nope.py"], "no such script"),
        (["export", "tensorboard", "{tmp}/missing", "{tmp}/out"], "no such run directory"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(script, tmp_path, capsys, argv, message):
    run_dir = tmp_path / "run"
    main(["monitor", "--logdir", str(run_dir), "--json", str(script), "0"])
    capsys.readouterr()
    argv = [a.format(tmp=tmp_path, run=run_dir) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2


def test_export_tensorboard_is_read_back_by_tensorboard(script, tmp_path, capsys):
    from tensorboard.backend.event_processing import event_accumulator as ea

    run_dir, out_dir = tmp_path / "run", tmp_path / "tb"
    main(["monitor", "--logdir", str(run_dir), "--every", "5", "--histograms", "--json", str(script), "3"])
    capsys.readouterr()
    assert main(["export", "tensorboard", str(run_dir), str(out_dir)]) == 0
    assert "histograms" in capsys.readouterr().out

    acc = ea.EventAccumulator(str(out_dir), size_guidance={ea.SCALARS: 0, ea.HISTOGRAMS: 0, ea.TENSORS: 0})
    acc.Reload()
    run = open_run(run_dir)
    loss = run.scalars("loss")["loss"]
    events = acc.Scalars("loss")
    assert [e.step for e in events] == [s for s, _ in loss]
    assert [e.value for e in events] == pytest.approx([v for _, v in loss], rel=1e-6)
    dead = run.layer_stats(layer="1", kind="activation", stat="dead_frac")
    assert [e.value for e in acc.Scalars("activation/1/dead_frac")] == pytest.approx([r["value"] for r in dead])
    hist = run.histograms(layer="1", kind="activation")[0]
    tb_hist = acc.Histograms("activation/1")[0]
    assert tb_hist.step == hist["step"]
    assert list(tb_hist.histogram_value.bucket) == pytest.approx(hist["counts"])
    assert tb_hist.histogram_value.num == sum(hist["counts"])
    text = acc.Tensors("trainguard/findings")[0].tensor_proto.string_val[0].decode()
    assert "dead_units" in text


def test_findings_view_orders_and_formats():
    findings = [
        Finding(kind="loss_spike", severity="warning", title="spike", evidence={"ratio": 12.345678}, steps=(3, 3)),
        {"kind": "nonfinite_loss", "severity": "critical", "title": "nan at 7", "evidence": {"value": math.nan},
         "suggestion": "clamp", "steps": [7, 9], "layers": ["fc1"], "id": 1, "created": 0.0, "source": "monitor"},
        Finding(kind="params_frozen", severity="info", title="frozen", evidence={"params": [f"p{i}" for i in range(9)]}),
    ]
    buf = io.StringIO()
    render_findings(Console(file=buf, width=200, color_system=None), findings)
    text = buf.getvalue()
    assert text.index("CRITICAL") < text.index("WARNING") < text.index("INFO")
    assert "steps 7-9 · layers fc1" in text and "value: nan" in text and "ratio: 12.3" in text
    assert "... and 3 more" in text and "fix: clamp" in text
    panel = io.StringIO()
    Console(file=panel, width=200, color_system=None).print(render_findings_table(findings))
    assert "findings" in panel.getvalue().splitlines()[0] and "nan at 7" in panel.getvalue()
    data = findings_json(findings)
    assert data["verdict"] == "critical" and data["counts"] == {"info": 1, "warning": 1, "error": 0, "critical": 1}
    assert data["findings"][0]["evidence"]["value"] == "NaN"
    json.dumps(data)


def test_a_script_that_crashes_is_diagnosed_as_crashed(tmp_path, capsys):
    crashing = tmp_path / "crash.py"
    crashing.write_text(SCRIPT.replace("    opt.step()\n", "    opt.step()\n    if step == 40:\n"
                                                          "        raise RuntimeError('disk full')\n"))
    d = tmp_path / "run"
    assert main(["monitor", "--logdir", str(d), "--json", str(crashing), "0"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["findings"][0]["kind"] == "script_crashed"
    assert "step 41: RuntimeError: disk full" in out["findings"][0]["title"]  # step 40 was complete
    assert out["verdict"] != "healthy"
    run = open_run(d)
    assert (run.status, run.meta["error"], run.meta["crash_step"]) == ("crashed", "RuntimeError: disk full", 41)


def test_a_script_that_exits_non_zero_is_kept(tmp_path, capsys):
    exits = tmp_path / "exits.py"
    exits.write_text(SCRIPT + "raise SystemExit(3)\n")
    d = tmp_path / "run"
    assert main(["monitor", "--logdir", str(d), "--json", str(exits), "0"]) == 3
    out = json.loads(capsys.readouterr().out)
    assert out["findings"][0]["kind"] == "script_crashed" and "exited with code 3" in out["findings"][0]["title"]
    run = open_run(d)
    assert (run.status, run.meta["exit_code"]) == ("exited", 3)


# pytorch/examples mnist_forward_forward/main.py's pattern: each layer trains itself with its own
# optimizer, and calls self.forward(x) directly, so no module is ever called as module(x).
FORWARD_FORWARD = textwrap.dedent("""
    import torch
    from torch import nn

    class Layer(nn.Linear):
        def __init__(self, n_in, n_out):
            super().__init__(n_in, n_out)
            self.opt = torch.optim.Adam(self.parameters(), lr=0.03)

        def forward(self, x):
            return torch.relu(torch.mm(x / (x.norm(2, 1, keepdim=True) + 1e-4), self.weight.T) + self.bias)

        def fit(self, pos, neg, epochs):
            for _ in range(epochs):
                loss = torch.log1p(torch.exp(torch.cat([-self.forward(pos).pow(2).mean(1) + 2,
                                                        self.forward(neg).pow(2).mean(1) - 2]))).mean()
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
            return self.forward(pos).detach(), self.forward(neg).detach()

    torch.manual_seed(0)
    pos, neg = torch.randn(64, 20), torch.randn(64, 20)
    for layer in [Layer(20, 16), Layer(16, 16)]:
        pos, neg = layer.fit(pos, neg, 15)
""")


def test_a_script_that_calls_forward_directly_is_told_why_nothing_was_seen(tmp_path, capsys):
    script = tmp_path / "ff.py"
    script.write_text(FORWARD_FORWARD)
    assert main(["monitor", "--logdir", str(tmp_path / "run"), "--json", str(script)]) == 0
    out = json.loads(capsys.readouterr().out)
    f = out["findings"][0]
    assert f["kind"] == "no_model_called", f
    assert f["evidence"]["backward_calls"] == 30
    assert ".forward(" in f["title"] and "layer(x)" in f["suggestion"]


# cornellius-gp/gpytorch's gpytorch/module.py: ``Module.__call__`` runs ``self.forward(...)`` itself,
# so no nn.Module hook ever runs for a GP model, its kernel or its likelihood; the model below is
# examples/01_Exact_GPs/Simple_GP_Regression.ipynb (ExactGP, RBF kernel, Gaussian likelihood, Adam
# on the exact marginal log likelihood) with that __call__, the kernel written out.
GPYTORCH_EXACT_GP = textwrap.dedent("""
    import math
    import torch
    from torch import nn

    class Module(nn.Module):
        def __call__(self, *inputs, **kwargs):
            return self.forward(*inputs, **kwargs)

    class ExactGP(Module):
        def __init__(self, train_x):
            super().__init__()
            self.train_x = train_x
            self.raw_lengthscale = nn.Parameter(torch.zeros(()))
            self.raw_outputscale = nn.Parameter(torch.zeros(()))
            self.raw_noise = nn.Parameter(torch.zeros(()))
            self.mean = nn.Parameter(torch.zeros(()))

        def forward(self, x):
            ls = nn.functional.softplus(self.raw_lengthscale)
            d2 = (x[:, None] - x[None, :]).pow(2) / ls.pow(2)
            k = nn.functional.softplus(self.raw_outputscale) * torch.exp(-0.5 * d2)
            return self.mean.expand(len(x)), k + nn.functional.softplus(self.raw_noise) * torch.eye(len(x))

    def neg_mll(mean, cov, y):
        chol = torch.linalg.cholesky(cov)
        r = torch.cholesky_solve((y - mean)[:, None], chol)[:, 0]
        logdet = 2 * chol.diagonal().log().sum()
        return 0.5 * ((y - mean) @ r + logdet + len(y) * math.log(2 * math.pi)) / len(y)

    torch.manual_seed(0)
    x = torch.linspace(0, 1, 30)
    y = torch.sin(x * 2 * math.pi) + 0.2 * torch.randn(30)
    model = ExactGP(x)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for i in range(30):
        opt.zero_grad()
        loss = neg_mll(*model(x), y)
        loss.backward()
        opt.step()
""")


def test_a_model_whose_class_overrides_call_is_still_monitored(tmp_path, capsys):
    script = tmp_path / "gp.py"
    script.write_text(GPYTORCH_EXACT_GP)
    assert main(["monitor", "--logdir", str(tmp_path / "run"), "--json", str(script)]) == 0
    out = json.loads(capsys.readouterr().out)
    kinds = [f["kind"] for f in out["findings"]]
    assert "no_model_called" not in kinds, out["findings"]
    loss = open_run(tmp_path / "run").scalars("loss").get("loss", [])
    assert [s for s, _ in loss] == list(range(30)), loss
    assert all(math.isfinite(v) for _, v in loss) and loss[-1][1] < loss[0][1], loss


# examples/06_PyTorch_NN_Integration_DKL/KISSGP_Deep_Kernel_Regression_CUDA.ipynb, reduced: deep
# kernel learning. The GP (gpytorch's Module.__call__, as above) runs a plain nn.Sequential feature
# extractor, whose nn.Module.__call__ the monitor's discovery sees first; the optimizer also trains
# the GP's own raw_lengthscale, raw_outputscale and constant mean and the likelihood's raw_noise,
# which no hook announces. In the real notebook the monitor watched the 8 tensors of the feature
# extractor and none of the GP's 4.
GPYTORCH_DKL = textwrap.dedent("""
    import math
    import torch
    from torch import nn

    class Module(nn.Module):
        def __call__(self, *inputs, **kwargs):
            return self.forward(*inputs, **kwargs)

    class GaussianLikelihood(Module):
        def __init__(self):
            super().__init__()
            self.raw_noise = nn.Parameter(torch.zeros(1))

    class DKLModel(Module):
        def __init__(self, likelihood):
            super().__init__()
            self.likelihood = likelihood
            self.feature_extractor = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 2))
            self.raw_lengthscale = nn.Parameter(torch.zeros(1, 2))
            self.raw_outputscale = nn.Parameter(torch.zeros(()))
            self.constant = nn.Parameter(torch.zeros(()))

        def forward(self, x):
            z = self.feature_extractor(x) / nn.functional.softplus(self.raw_lengthscale)
            k = nn.functional.softplus(self.raw_outputscale) * torch.exp(-0.5 * torch.cdist(z, z).pow(2))
            return self.constant.expand(len(x)), k

    class ExactMarginalLogLikelihood(Module):
        def __init__(self, likelihood, model):
            super().__init__()
            self.likelihood, self.model = likelihood, model

        def forward(self, output, y):
            mean, k = output
            cov = k + (nn.functional.softplus(self.likelihood.raw_noise) + 1e-4) * torch.eye(len(y))
            chol = torch.linalg.cholesky(cov)
            r = torch.cholesky_solve((y - mean)[:, None], chol)[:, 0]
            logdet = 2 * chol.diagonal().log().sum()
            return -0.5 * ((y - mean) @ r + logdet + len(y) * math.log(2 * math.pi)) / len(y)

    torch.manual_seed(0)
    x = torch.rand(40, 3) * 2 - 1
    y = torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(40)
    likelihood = GaussianLikelihood()
    model = DKLModel(likelihood)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mll = ExactMarginalLogLikelihood(likelihood, model)
    for i in range(25):
        opt.zero_grad()
        loss = -mll(model(x), y)
        loss.backward()
        opt.step()
""")


def test_a_gp_whose_feature_extractor_is_found_first_is_watched_whole(tmp_path, capsys):
    script = tmp_path / "dkl.py"
    script.write_text(GPYTORCH_DKL)
    assert main(["monitor", "--logdir", str(tmp_path / "run"), "--json", str(script)]) == 0
    run = open_run(tmp_path / "run")
    params = run.meta["monitor"]["params"]
    # the names of mll.state_dict(), the module holding every trained tensor
    assert sorted(params) == sorted([
        "model.feature_extractor.0.weight", "model.feature_extractor.0.bias",
        "model.feature_extractor.2.weight", "model.feature_extractor.2.bias",
        "model.raw_lengthscale", "model.raw_outputscale", "model.constant", "likelihood.raw_noise"]), params
    assert all(p["gradient_steps"] == 25 for p in params.values()), params
    # the feature extractor's layers keep their statistics
    assert "model.feature_extractor.0" in run.layers(), run.layers()


# The check every loop of pytorch/vision's references/detection (engine.train_one_epoch) and of
# DeiT, MAE and DINO makes: on a non-finite loss it prints it and calls sys.exit(1), no exception.
STOPS_ITSELF = textwrap.dedent(
    """
    import math
    import sys
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Linear(6, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(30):
        x = torch.randn(16, 6)
        y = (x[:, 0] > 0).long() if step != 25 else torch.zeros(16, dtype=torch.long)  # no positives
        ce = nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = ce[y == 1].sum() / (y == 1).sum() + ce[y == 0].mean()  # divided by the positives' count
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training")
            sys.exit(1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    """
)


def test_a_script_that_stops_itself_at_a_nan_loss_is_not_told_to_read_its_traceback(tmp_path, capsys):
    path = tmp_path / "train.py"
    path.write_text(STOPS_ITSELF)
    d = tmp_path / "run"
    assert main(["run", "--monitor", "--logdir", str(d), str(path)]) == 1
    capsys.readouterr()
    assert main(["diagnose", "--json", str(d)]) != 2
    crash = json.loads(capsys.readouterr().out)["findings"][0]
    assert crash["kind"] == "script_crashed" and "exited with code 1" in crash["title"]
    assert "traceback" not in crash["suggestion"], crash["suggestion"]
    assert "step 25" in crash["suggestion"] and "trainguard report" in crash["suggestion"], crash["suggestion"]


# pyro's SVI Part I tutorial (coin fairness) in torch alone: the guide's alpha_q and beta_q are
# pyro.param sites, plain tensors in the param store that no nn.Module holds; pyro.optim.Adam steps
# a torch Adam over each.
PARAM_SITES = textwrap.dedent("""
    import torch
    torch.manual_seed(0)
    data = torch.cat([torch.ones(6), torch.zeros(4)])
    log_alpha_q = torch.tensor(15.0).log().requires_grad_()
    log_beta_q = torch.tensor(15.0).log().requires_grad_()
    opts = [torch.optim.Adam([p], lr=0.005) for p in (log_alpha_q, log_beta_q)]
    prior = torch.distributions.Beta(10.0, 10.0)
    for step in range(25):
        q = torch.distributions.Beta(log_alpha_q.exp(), log_beta_q.exp())
        f = q.rsample()
        elbo = prior.log_prob(f) + torch.distributions.Bernoulli(f).log_prob(data).sum() - q.log_prob(f)
        (-elbo).backward()
        for o in opts:
            o.step()
            o.zero_grad()
""")


def test_parameters_outside_any_module_are_told_apart_from_a_direct_forward_call(tmp_path, capsys):
    # `trainguard monitor` on pyro's SVI tutorial said "called no nn.Module as module(x): a direct
    # .forward(x) call skips the hooks" and "call each module as layer(x)": the script has no module.
    script = tmp_path / "coin.py"
    script.write_text(PARAM_SITES)
    assert main(["monitor", "--logdir", str(tmp_path / "run"), "--json", str(script)]) == 0
    f = json.loads(capsys.readouterr().out)["findings"][0]
    assert f["kind"] == "no_model_parameters", f
    assert f["evidence"]["backward_calls"] == 25 and f["evidence"]["parameters_outside_modules"] == 2, f
    assert ".forward(" not in f["title"] and "layer(x)" not in f["suggestion"], f
    assert "pyro.param" in f["title"] and "PyroModule" in f["suggestion"], f
