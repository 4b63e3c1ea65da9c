"""gradient_check: float64 central differences against autograd, banded, with the wrong ones named."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console
from torch import nn

from trainguard import doctor
from trainguard.doctor._gradcheck import BUG_BAND, PASS_BAND, band
from trainguard.store import dumps


class LinearFn(torch.autograd.Function):
    """A hand-written linear layer whose weight gradient is multiplied by ``scale``."""

    @staticmethod
    def forward(ctx, x, w, b, scale):
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w, ctx.scale * (grad.t() @ x), grad.sum(0), None


class CustomNet(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(20, 32)
        self.fc2 = nn.Linear(32, 10)
        self.scale = scale

    def forward(self, x):
        return LinearFn.apply(torch.tanh(self.fc1(x)), self.fc2.weight, self.fc2.bias, self.scale)


def test_healthy_models_pass(batch, new_mlp):
    nets = [
        new_mlp(),
        nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Dropout(0.3), nn.Linear(32, 32), nn.BatchNorm1d(32),
                      nn.GELU(), nn.Linear(32, 10)),
        CustomNet(scale=1.0),
    ]
    for net in nets:
        r = doctor.gradient_check(net, batch, nn.CrossEntropyLoss())
        assert r.passed, r.summary
        assert r.bad_params == [] and r.suspicious_params == []
        assert r.max_rel < PASS_BAND
        assert all(p.status == "ok" for p in r.params)


class EMACodebookAE(nn.Module):
    """lucidrains/vector-quantize-pytorch (vector_quantize_pytorch.py, EuclideanCodebook): a VQ
    autoencoder whose codebook is a buffer updated in place by exponential moving averages in every
    training forward (ema_inplace of cluster_size and embed_avg under no_grad, then embed.copy_),
    quantised with the straight-through estimator. The decoder's gradient is exact; each forward
    moves the codebook, so a finite difference taken after other forwards saw another codebook."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(20, 6)
        self.dec = nn.Linear(6, 10)
        self.register_buffer("embed", torch.randn(8, 6))
        self.register_buffer("embed_avg", self.embed.clone())
        self.register_buffer("cluster_size", torch.ones(8))

    def forward(self, x):
        h = self.enc(x)
        onehot = nn.functional.one_hot(torch.cdist(h, self.embed).argmin(-1), 8).to(h.dtype)
        q = onehot @ self.embed
        if self.training:
            with torch.no_grad():
                self.cluster_size.lerp_(onehot.sum(0), 0.2)
                self.embed_avg.lerp_(onehot.t() @ h, 0.2)
                self.embed.copy_(self.embed_avg / self.cluster_size.clamp(min=1e-5)[:, None])
        return self.dec(h + (q - h).detach())


def test_buffers_a_forward_updates_in_place_are_put_back_before_each_evaluation(batch):
    net = EMACodebookAE()
    embed = net.embed.clone()
    r = doctor.gradient_check(net, batch, nn.CrossEntropyLoss(), params=["dec.weight", "dec.bias"])
    assert r.passed and r.bad_params == [] and r.suspicious_params == [], r.summary
    assert torch.equal(net.embed, embed)  # and the codebook is the caller's again


def test_a_loss_that_moves_its_own_buffer_is_checked_at_the_same_buffer_every_evaluation(dino):
    # `trainguard doctor` on DINO called 26 of its 37 trainable parameters "wrong gradient": each finite
    # difference evaluated the loss after other evaluations had moved its center.
    student, batch, loss = dino
    r = doctor.gradient_check(student, batch, loss)
    assert r.passed and r.bad_params == [], r.summary
    assert torch.equal(loss.center, torch.zeros(1, 16))  # the caller's center again


def test_a_loss_module_a_function_closes_over_is_checked_at_the_same_buffer_too(dino):
    # DINO's loss takes an epoch argument, so a user passes a function calling it
    student, batch, loss = dino
    r = doctor.gradient_check(student, batch, lambda out, t: loss(out, t))
    assert r.passed and r.bad_params == [], r.summary
    assert torch.equal(loss.center, torch.zeros(1, 16))


class _SetCriterion(nn.Module):
    """facebookresearch/detr models/detr.py's SetCriterion, its classification part: a float32
    class-weight buffer (``empty_weight``, the no-object class down-weighted) in cross_entropy."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        weight = torch.ones(num_classes + 1)
        weight[-1] = 0.1
        self.register_buffer("empty_weight", weight)

    def forward(self, logits, targets):
        return nn.functional.cross_entropy(logits, targets, self.empty_weight)


def test_a_loss_module_behind_a_function_runs_in_float64_with_the_model(batch):
    # DETR's loss is `sum(criterion(outputs, targets)[k] * weight_dict[k] ...)`, a function over its
    # SetCriterion: the check stopped at "expected scalar type Double but found Float" (the
    # criterion's empty_weight stayed float32 while the model ran in float64).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 6))
    criterion = _SetCriterion(5)
    x, y = torch.randn(8, 20), torch.randint(0, 6, (8,))

    def loss_fn(out, t):
        return criterion(out, t) * 1.0

    r = doctor.gradient_check(model, (x, y), loss_fn)
    assert r.passed and r.bad_params == [], r.summary
    assert criterion.empty_weight.dtype == torch.float32  # the caller's dtype again


def test_a_loss_that_changes_between_evaluations_is_said_to_be_so_not_a_wrong_gradient(dino):
    # the same loss where no reference the doctor follows reaches it (an attribute of an object the
    # function reads): its buffer is out of reach, so it says why it cannot judge rather than blame
    # the backward
    student, batch, loss = dino
    holder = type("Holder", (), {})()
    holder.loss = loss
    r = doctor.gradient_check(student, batch, lambda out, t: holder.loss(out, t))
    assert not r.passed and r.bad_params == []
    assert "changes between evaluations" in r.summary, r.summary
    [f] = r.findings()
    assert f.kind != "wrong_gradient" and "nn.Module" in f.suggestion, f.suggestion


def test_wrongly_scaled_weight_gradient_in_custom_backward_is_named(batch):
    r = doctor.gradient_check(CustomNet(scale=1.5), batch, nn.CrossEntropyLoss())
    assert not r.passed
    assert r.bad_params == ["fc2.weight"]
    worst = next(p for p in r.params if p.name == "fc2.weight")
    assert worst.max_rel == pytest.approx(1 / 3, rel=1e-4)  # |1.5a - a| / 1.5|a|
    assert worst.analytic == pytest.approx(1.5 * worst.numeric, rel=1e-6)
    f = next(f for f in r.findings() if f.kind == "wrong_gradient")
    assert f.layers == ["fc2.weight"] and f.severity == "error"
    assert r.verdict == "fail"


def test_a_slightly_wrong_gradient_is_suspicious(batch):
    r = doctor.gradient_check(CustomNet(scale=1 + 1e-4), batch, nn.CrossEntropyLoss())
    assert r.suspicious_params == ["fc2.weight"] and r.bad_params == []
    assert not r.passed and r.verdict == "warn"


def test_a_gradient_that_does_not_flow_is_wrong(batch):
    class Leaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(20, 10)
            self.gain = nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            return self.fc(x) * self.gain.detach() + 0 * self.gain  # gain's gradient is cut

    r = doctor.gradient_check(Leaky(), batch, nn.CrossEntropyLoss())
    assert r.bad_params == ["gain"]


def test_bands():
    assert band(0.0) == "ok" and band(PASS_BAND / 2) == "ok"
    assert band(PASS_BAND * 2) == "suspicious" and band(BUG_BAND) == "suspicious"
    assert band(BUG_BAND * 1.01) == "wrong" and band(float("nan")) == "wrong" and band(float("inf")) == "wrong"


def test_params_selects_by_name_or_object(batch):
    net = CustomNet(scale=1.5)
    r = doctor.gradient_check(net, batch, nn.CrossEntropyLoss(), params=["fc1.weight"])
    assert [p.name for p in r.params] == ["fc1.weight"] and r.passed
    r = doctor.gradient_check(net, batch, nn.CrossEntropyLoss(), params=[net.fc2.weight], samples_per_param=3)
    assert r.bad_params == ["fc2.weight"] and r.params[0].checked == net.fc2.weight.numel()


def test_frozen_parameters_are_not_checked(batch, new_mlp):
    net = new_mlp()
    net[0].weight.requires_grad_(False)
    r = doctor.gradient_check(net, batch, nn.CrossEntropyLoss(), samples_per_param=2)
    assert "0.weight" not in [p.name for p in r.params]
    assert net[0].weight.grad is None and not net[0].weight.requires_grad


def test_result_serialises_and_renders(batch):
    r = doctor.gradient_check(CustomNet(scale=1.5), batch, nn.CrossEntropyLoss(), samples_per_param=4)
    d = json.loads(dumps(r.to_dict()))
    assert d["bad_params"] == ["fc2.weight"] and {p["name"] for p in d["params"]} == {
        "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    buf = io.StringIO()
    Console(file=buf, width=120).print(r)
    assert "fc2.weight" in buf.getvalue() and "wrong" in buf.getvalue()


@pytest.mark.parametrize("kwargs, match", [
    (dict(eps=0), "eps"),
    (dict(samples_per_param=-1), "samples_per_param"),
    (dict(directions=0), "directions"),
    (dict(params=["nope"]), "no trainable parameter named 'nope'"),
    (dict(params=[torch.zeros(3)]), "parameter names or parameters"),
    (dict(batch=(torch.zeros(4, 20),)), "pair"),
    (dict(model=None), "nn.Module"),
])
def test_bad_inputs_are_value_errors(kwargs, match, mlp, batch):
    args = dict(model=mlp, batch=batch, loss_fn=nn.CrossEntropyLoss())
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        doctor.gradient_check(**args)


def test_sparse_embedding_gradients_and_large_parameters(state_of, same_state):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50_000, 8, sparse=True), nn.Flatten(), nn.Linear(24, 3))
    x, y = torch.randint(0, 50_000, (8, 3)), torch.randint(0, 3, (8,))
    nn.functional.cross_entropy(model(x), y).backward()  # leaves a sparse .grad behind
    before = state_of(model)
    # Entries sampled from the 400k-entry table are mostly unused rows: gradient 0 both ways.
    r = doctor.gradient_check(model, (x, y), nn.CrossEntropyLoss(), samples_per_param=32)
    assert r.passed and r.params[0].checked == 400_000
    same_state(before, state_of(model))


class OneEntryWrong(torch.autograd.Function):
    """``x @ w.t()`` whose backward gets one entry of the weight's gradient wrong (a bug of the
    kind an index error in a hand-written kernel makes): the entry's value doubled."""

    @staticmethod
    def forward(ctx, x, w, at):
        ctx.save_for_backward(x, w)
        ctx.at = at
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gw = grad.t() @ x
        gw[ctx.at] = 2 * gw[ctx.at] + gw.abs().max()
        return grad @ w, gw, None


def test_a_gradient_wrong_in_one_entry_of_a_large_parameter_is_found_and_located():
    # 128 x 512 = 65,536 entries: 16 sampled entries would see the wrong one with probability
    # 1 in 4,096; one direction covers them all, and bisection finds it.
    torch.manual_seed(0)
    at = (37, 411)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(128, 512) / 512 ** 0.5)
            self.head = nn.Linear(128, 4)

        def forward(self, x):
            return self.head(torch.tanh(OneEntryWrong.apply(x, self.w, at)))

    x, y = torch.randn(16, 512), torch.randint(0, 4, (16,))
    net = Net()
    r = doctor.gradient_check(net, (x, y), nn.CrossEntropyLoss(), max_samples=None)
    assert r.bad_params == ["w"]
    w = next(p for p in r.params if p.name == "w")
    assert w.worst_index == list(at) and w.checked == 128 * 512
    # The finite difference is the true derivative there: autograd's through a correct x @ w.t().
    xd, wd = x.double(), net.w.detach().double().requires_grad_()
    out = nn.functional.linear(torch.tanh(xd @ wd.t()), net.head.weight.double(), net.head.bias.double())
    nn.functional.cross_entropy(out, y).backward()
    assert w.numeric == pytest.approx(wd.grad[at].item(), rel=1e-5)
    assert abs(w.analytic - w.numeric) > BUG_BAND * max(abs(w.analytic), abs(w.numeric))
    f = next(f for f in r.findings() if f.kind == "wrong_gradient")
    assert "w[37, 411]" in f.title


def test_forward_passes_grow_with_directions_not_with_entries(batch, monkeypatch):
    # A healthy smooth model: one pass as training's first step (a first forward may initialise
    # parameters: gpytorch's variational strategy), one for the gradient, one to see the loss
    # repeat, then two per direction per parameter.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 256), nn.Tanh(), nn.Linear(256, 10))
    calls = []
    loss = nn.CrossEntropyLoss()
    monkeypatch.setattr(loss, "forward", lambda out, y: calls.append(1) or nn.functional.cross_entropy(out, y))
    r = doctor.gradient_check(net, batch, loss)
    assert r.passed, r.summary
    assert len(calls) == 3 + 2 * 2 * 4  # 4 parameters, 2 directions each
    calls.clear()
    r = doctor.gradient_check(net, batch, loss, directions=1, samples_per_param=3)
    assert r.passed and len(calls) == 3 + 4 * (2 + 2 * 3)


class _CastingScan(nn.Module):
    """johnma2006/mamba-minimal model.py's MambaBlock.ssm, smaller: its parameters are cast with
    ``.float()`` inside the forward (``A = -torch.exp(self.A_log.float())``, ``D = self.D.float()``),
    so in a float64 check part of the forward ran in float32."""

    def __init__(self, d: int = 6, n: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1.0)).repeat(d, 1))
        self.D = nn.Parameter(torch.ones(d))
        self.proj = nn.Linear(d, d)

    def forward(self, u):
        A = -torch.exp(self.A_log.float())
        D = self.D.float()
        delta = nn.functional.softplus(self.proj(u))
        x, ys = torch.zeros(u.shape[0], u.shape[2], A.shape[1]), []
        for i in range(u.shape[1]):
            x = torch.exp(delta[:, i].unsqueeze(-1) * A) * x + (delta[:, i] * u[:, i]).unsqueeze(-1)
            ys.append(x.sum(-1))
        return torch.stack(ys, 1) + u * D


def test_casts_to_float32_inside_the_forward_are_kept_in_float64():
    """mamba-minimal has no custom backward: the check said its D's gradient was wrong (relative
    difference 0.057), the float32 round-off of the cast forward seen by float64 differences."""
    model = _CastingScan()
    u = torch.randn(4, 8, 6)
    result = doctor.gradient_check(model, (u, torch.randn(4, 8, 6)), nn.MSELoss())
    assert result.passed and result.bad_params == [] and result.suspicious_params == [], result.summary
    assert result.kept_float64 > 0 and "float64" in result.summary
    assert model.D.dtype == torch.float32 and model(u).dtype == torch.float32  # the model is as it was


class _RotaryLM(nn.Module):
    """Cut from karpathy/nanochat@92d63d4 nanochat/gpt.py: rotary tables kept as non-persistent
    buffers in the compute dtype, which forward() asserts (``self.cos.dtype == COMPUTE_DTYPE``),
    activations cast back to it (``x.to(COMPUTE_DTYPE)``), QK norm and a softcapped lm_head."""

    def __init__(self, vocab=32, dim=16, seq=8):
        super().__init__()
        self.wte, self.c_q, self.lm_head = nn.Embedding(vocab, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, vocab, bias=False)
        freqs = torch.outer(torch.arange(seq, dtype=torch.float32), 1.0 / 100000 ** (torch.arange(0, dim, 2) / dim))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, idx):
        assert self.cos.dtype == torch.float32, f"Rotary embeddings must be in torch.float32, got {self.cos.dtype}"
        x = self.wte(idx).to(torch.float32)
        q = self.c_q(nn.functional.rms_norm(x, (x.size(-1),)))
        d = q.size(-1) // 2
        cos, sin = self.cos[: idx.size(1)], self.sin[: idx.size(1)]
        q = torch.cat([q[..., :d] * cos + q[..., d:] * sin, q[..., :d] * -sin + q[..., d:] * cos], -1)
        logits = self.lm_head(nn.functional.rms_norm(x + q, (x.size(-1),))).float()
        return 15 * torch.tanh(logits / 15)


def test_a_model_that_asserts_its_constant_tables_dtype_is_checked():
    """nanochat's GPT: `trainguard doctor` reported gradient_check as ERROR, "AssertionError: Rotary
    embeddings must be in torch.float32, got torch.float64" (the check had converted the rotary
    buffers), and told the user to fix the forward pass of a healthy model."""
    torch.manual_seed(0)
    model = _RotaryLM()
    idx = torch.randint(0, 32, (4, 8))
    loss = lambda logits, y: nn.functional.cross_entropy(logits.reshape(-1, 32), y.reshape(-1))  # noqa: E731
    result = doctor.gradient_check(model, (idx, torch.randint(0, 32, (4, 8))), loss)
    assert result.passed and result.bad_params == [] and result.suspicious_params == [], result.summary
    assert model.cos.dtype == torch.float32 and model.c_q.weight.dtype == torch.float32


class _ZeroInitBlock(nn.Module):
    """timm/models/resnet.py BasicBlock with zero_init_last (bn2.weight = 0), after a ReLU: at w=0 the
    residual sum equals the ReLU'd shortcut, exact zeros meet the ReLU after the sum at its kink."""

    def __init__(self, c=8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU())
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        nn.init.zeros_(self.bn2.weight)
        self.head = nn.Linear(c, 4)

    def forward(self, x):
        x = self.stem(x)
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return self.head(torch.relu(y + x).mean((2, 3)))


def test_a_kink_is_not_a_wrong_gradient():
    # trainguard doctor on timm's resnet10t: "Gradient check: wrong gradient for layer1.0.bn2.weight
    # (autograd says 0.00295251, finite differences -0.012053)", an error on a healthy model.
    torch.manual_seed(0)
    model = _ZeroInitBlock()
    batch = (torch.randn(8, 3, 6, 6), torch.randint(0, 4, (8,)))
    res = doctor.gradient_check(model, batch, nn.CrossEntropyLoss(), params=["bn2.weight", "head.weight"])
    assert res.bad_params == [], res.summary
    p = next(p for p in res.params if p.name == "bn2.weight")
    assert p.status == "suspicious" and p.kink, p
    f = next(f for f in res.findings() if f.kind == "suspicious_gradient")
    assert "not differentiable" in f.suggestion


class _SpectralNet(nn.Module):
    """zongyi-li/fourier_neural_operator fourier_2d.py in small: SpectralConv2d's complex weights
    (``torch.rand(..., dtype=torch.cfloat)``) on the lowest ``rfft2`` modes, its ``out_ft`` made
    with ``dtype=torch.cfloat`` inside the forward, plus FNO2d's pointwise ``w`` path."""

    def __init__(self, width=3, modes=2):
        super().__init__()
        self.modes = modes
        self.weights1 = nn.Parameter(torch.rand(width, width, modes, modes, dtype=torch.cfloat) / width**2)
        self.w = nn.Conv2d(width, width, 1)

    def forward(self, x):
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(x.shape[0], x.shape[1], x.size(-2), x.size(-1) // 2 + 1, dtype=torch.cfloat)
        m = self.modes
        out_ft[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m, :m], self.weights1)
        return torch.nn.functional.gelu(torch.fft.irfft2(out_ft, s=(x.size(-2), x.size(-1))) + self.w(x))


def test_complex_parameters_are_checked_in_complex128():
    torch.manual_seed(0)
    model = _SpectralNet()
    x, y = torch.randn(2, 3, 6, 6), torch.randn(2, 3, 6, 6)
    result = doctor.gradient_check(model, (x, y), nn.MSELoss())
    assert "weights1" in [p.name for p in result.params]
    assert result.passed and result.bad_params == [] and result.suspicious_params == [], result.summary
    assert model.weights1.dtype == torch.cfloat and model(x).dtype == torch.float32  # the model is as it was


class _DcganCritic(nn.Module):
    """pytorch/examples dcgan/main.py's Discriminator (ndf 8, 3x64x64 images, weights_init's
    N(0, 0.02) convolutions): four LeakyReLUs over 32k-262k activations each, many of them within
    1e-6 of their kink at 0."""

    def __init__(self, ndf=8):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(3, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 4), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 8), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False), nn.Sigmoid())
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, x):
        return self.main(x).view(-1)


def test_many_small_kinks_crossed_by_the_step_are_not_a_wrong_gradient():
    # `trainguard doctor` on pytorch/examples' DCGAN discriminator: "wrong gradient for
    # main.0.weight (largest relative difference 0.00287)", an error on built-in layers. Each step
    # of the weight moves thousands of LeakyReLU inputs, and a larger step crosses more kinks:
    # the difference grew with eps (6e-4 at 1e-6, 1e-2 at 1e-5) and vanished at 1e-7.
    torch.manual_seed(0)
    model = _DcganCritic()
    g = torch.Generator().manual_seed(0)
    x = torch.rand(32, 3, 64, 64, generator=g) * 2 - 1
    y = (torch.arange(32) % 2).float()
    res = doctor.gradient_check(model, (x, y), nn.BCELoss(), params=["main.0.weight", "main.2.weight"])
    assert res.passed, [(p.name, p.max_rel, p.status) for p in res.params]
    # a wrong gradient stays wrong at every step
    scaled = doctor.gradient_check(CustomNet(scale=1.5), (torch.randn(8, 20), torch.randint(0, 10, (8,))),
                                   nn.CrossEntropyLoss())
    assert scaled.bad_params == ["fc2.weight"]


class _ShiftedLogits(nn.Module):
    """Autoformer's auto-correlation (thuml/Time-Series-Library layers/AutoCorrelation.py), reduced to
    its point: the key projection's bias moves every lag's correlation alike before the softmax over
    the lags' weights, which takes it off again. Here one shift is added to every class's logit."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(20, 10)
        self.shift = nn.Parameter(torch.tensor(0.37))

    def forward(self, x):
        return self.fc(x) + self.shift


@pytest.mark.parametrize("seed", [1, 9, 11, 25])
def test_a_zero_gradient_whose_finite_difference_rounds_by_one_ulp_of_the_loss_agrees(seed):
    # `trainguard doctor` on Time-Series-Library's Autoformer: "Gradient check:
    # decoder.layers.0.cross_attention.key_projection.bias differs from finite differences by
    # 1.11e-05", a warning on a correct gradient: autograd said 1.6e-18, the loss (1.28) moved by one
    # ulp over the widest step, 2 * 1e-4, a slope of 1.1e-12, which the 1e-7 floor of the relative
    # difference makes 1.1e-5. These seeds' losses (2.1 to 3.5) move by one ulp too.
    torch.manual_seed(seed)
    model = _ShiftedLogits()
    x, y = torch.randn(8, 20) * 3, torch.randint(0, 10, (8,))
    r = doctor.gradient_check(model, (x, y), nn.CrossEntropyLoss())
    shift = next(p for p in r.params if p.name == "shift")
    assert shift.status == "ok" and r.passed, (shift.max_rel, shift.analytic, shift.numeric)
    # a cut gradient is still wrong: the tolerance is round-off, 1e-11 here, far below a slope of 1e-4
    class CutShift(_ShiftedLogits):
        def forward(self, x):
            out = self.fc(x)
            return torch.cat([out[:, :1] + 1e-3 * self.shift.detach() + 0 * self.shift, out[:, 1:]], dim=1)

    torch.manual_seed(seed)
    r = doctor.gradient_check(CutShift(), (x, y), nn.CrossEntropyLoss())
    assert r.bad_params == ["shift"], [(p.name, p.max_rel, p.analytic, p.numeric) for p in r.params]


def test_a_qat_model_is_not_a_crash_but_says_fake_quant_has_no_finite_difference_gradient(qat_model):
    # Eager-mode QAT as PyTorch's QAT tutorial prepares it (prepare_qat with get_default_qat_qconfig("x86")):
    # the check cast the model to float64 and the fused fake-quant op raised "expected scalar type Float
    # but found Double", reported as "could not run ... Fix the error above (often the forward pass)".
    # Fake-quantizing rounds (a step function): its straight-through gradient is not the finite difference.
    torch.manual_seed(0)
    model = qat_model(channels=4, side=8, classes=3)
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,))
    result = doctor.gradient_check(model, (x, y), nn.CrossEntropyLoss())
    assert "fake-quant" in result.summary, result.summary
    [f] = result.findings()
    assert f.severity == "warning" and result.verdict == "warn" and "disable_fake_quant" not in f.suggestion and "before prepare_qat" in f.suggestion


class _CoarseFine(nn.Module):
    """yenchenlin/nerf-pytorch's render_rays, reduced: the coarse network's weights place the
    fine network's samples, which are detached (``z_samples = z_samples.detach()``), so the
    coarse network learns only from its own loss term (``+ z * ...``, its rendering's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.coarse = nn.Linear(20, 4)
        self.fine = nn.Linear(1, 10)

    def forward(self, x):
        w = torch.softmax(self.coarse(x), -1)
        z = (w * torch.arange(4.0)).sum(-1, keepdim=True)
        zd = z.detach()  # the fine samples carry no gradient
        return self.fine(zd) + z * torch.linspace(-1.0, 1.0, 10)


class _CoarseFineWrongBackward(_CoarseFine):
    """_CoarseFine whose coarse layer also has a wrong hand-written backward (LinearFn, scale 1.5)."""

    def forward(self, x):
        w = torch.softmax(LinearFn.apply(x, self.coarse.weight, self.coarse.bias, 1.5), -1)
        z = (w * torch.arange(4.0)).sum(-1, keepdim=True)
        zd = z.detach()  # the fine samples carry no gradient
        return self.fine(zd) + z * torch.linspace(-1.0, 1.0, 10)


def test_a_gradient_a_detach_cuts_is_exact_for_the_graph_the_code_builds(batch):
    # `trainguard doctor` on yenchenlin/nerf-pytorch's unmodified run_nerf.py gave an ERROR, "wrong
    # gradient", for the coarse network, whose gradient is what the code means: held fixed at the
    # values the forward detached, finite differences agree with autograd, so the detach is the whole
    # difference. The finding is a warning naming the line, for the user to tell intended from not.
    r = doctor.gradient_check(_CoarseFine(), batch, nn.CrossEntropyLoss())
    assert r.bad_params == [] and r.verdict == "warn", r.summary
    coarse = next(p for p in r.params if p.name == "coarse.weight")
    assert coarse.status == "detached" and coarse.max_rel > BUG_BAND, coarse
    assert coarse.held_rel is not None and coarse.held_rel < PASS_BAND, coarse
    [f] = [f for f in r.findings() if "coarse.weight" in f.title]  # one finding for the detach's parameters
    assert f.kind == "gradient_cut_by_detach" and f.severity == "warning", f
    assert "2 parameters (coarse.weight, coarse.bias)" in f.title and f.layers == ["coarse.weight", "coarse.bias"]
    line = _CoarseFine.forward.__code__.co_firstlineno + 3
    assert f"test_gradcheck.py:{line}" in f.suggestion and "zd = z.detach()" in f.suggestion, f.suggestion
    assert {"name": "coarse.weight", "max_rel": coarse.max_rel, "held_rel": coarse.held_rel} in f.evidence["params"]
    assert f.evidence["detached_at"][0]["line"] == line
    assert all(p.status == "ok" for p in r.params if p.name.startswith("fine."))


def test_a_wrong_gradient_through_a_detach_names_the_detach_line(batch):
    # a wrong backward on the same parameter: holding the detached values does not make it agree
    r = doctor.gradient_check(_CoarseFineWrongBackward(), batch, nn.CrossEntropyLoss())
    assert set(r.bad_params) >= {"coarse.weight"}, r.summary
    f = next(f for f in r.findings() if f.kind == "wrong_gradient" and "coarse.weight" in f.title)
    assert f.severity == "error"
    line = _CoarseFineWrongBackward.forward.__code__.co_firstlineno + 3
    assert f"test_gradcheck.py:{line}" in f.suggestion and "zd = z.detach()" in f.suggestion, f.suggestion
    assert f.evidence["detached_at"][0]["line"] == line
    fine = [f for f in r.findings() if "fine." in f.title and f.kind == "wrong_gradient"]
    assert not fine  # the fine network's gradient is exact


def test_a_detached_parameter_is_named_at_its_line(batch):
    class Leaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(20, 10)
            self.gain = nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            return self.fc(x) * self.gain.detach() + 0 * self.gain  # gain's gradient is cut

    r = doctor.gradient_check(Leaky(), batch, nn.CrossEntropyLoss())
    (f,) = [f for f in r.findings() if f.kind == "wrong_gradient"]
    assert "self.gain.detach()" in f.suggestion, f.suggestion


class LazyVariational(nn.Module):
    """cornellius-gp/gpytorch's _VariationalStrategy.__call__ (gpytorch/variational/_variational_strategy.py):
    while the buffer ``variational_params_initialized`` is 0, the forward writes the variational
    mean from the prior (``initialize_variational_distribution``, a ``.data.copy_``) and sets it to
    1. The doctor puts buffers back before each evaluation, so every finite difference ran that
    initialisation again over the perturbed mean: on the SVGP example `trainguard doctor` said
    "wrong gradient" for variational_mean and chol_variational_covar (autograd -0.252, finite
    differences 0), which training, past its first step, never sees."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(20, 4)
        self.variational_mean = nn.Parameter(torch.zeros(4, 10))
        self.register_buffer("variational_params_initialized", torch.tensor(0))

    def forward(self, x):
        if not self.variational_params_initialized.item():
            self.variational_mean.data.copy_(0.1 * torch.randn(4, 10))
            self.variational_params_initialized.fill_(1)
        return torch.tanh(self.fc(x)) @ self.variational_mean


def test_parameters_a_first_forward_initialises_are_checked_as_training_sees_them(batch):
    net = LazyVariational()
    r = doctor.gradient_check(net, batch, nn.CrossEntropyLoss())
    assert r.passed and r.bad_params == [] and r.suspicious_params == [], r.summary
    # the caller's model is as it was: not initialised yet
    assert net.variational_params_initialized.item() == 0 and not net.variational_mean.any()


def test_teacher_forcing_drawn_from_pythons_random_is_checked(teacher_forcing):
    # bentrevett/pytorch-seq2seq's teacher forcing (random.random() per target step): each
    # evaluation took other inputs, and the check gave up ("the loss changes between evaluations at
    # the same weights ...: something it reads moves on every call")
    model, batch, loss_fn = teacher_forcing
    r = doctor.gradient_check(model, batch, loss_fn, samples_per_param=2)
    assert r.cannot is None and r.passed, (r.cannot, r.notes)
