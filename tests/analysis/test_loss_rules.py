"""The loss rules on recorded runs: what the origin of a NaN says about the loss before it."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

import trainguard as tg


def test_a_nan_written_into_a_batch_after_noisy_losses_is_no_divergence(tmp_path):
    # YOLO("yolov8n.yaml").train() on 32 synthetic images with a NaN pixel written into the 6th
    # batch: the recorder traced it to that line ("the code wrote this value"), but the per-batch
    # detection loss, healthy and noisy (1.33, 5.9, 1.29, 11.5, 16.3: the number of boxes in each
    # mosaic), made lr_too_high an ERROR ("the loss grew 12.2x before turning NaN/Inf") and the
    # nonfinite_loss fix "lower the learning rate from 0.01 to about 0.001". The scales below are
    # those losses' ratios to the first.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scales = [1.0, 4.4, 0.97, 8.6, 12.2, 1.0]
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in scales]
    with tg.record(tmp_path / "r"), tg.Monitor(model, tmp_path / "r", every=1) as mon:
        for step, ((x, y), scale) in enumerate(zip(batches, scales)):
            if step == 5:
                x[0, 3] = float("nan")  # a corrupt sample
            loss = scale * nn.functional.mse_loss(model(x), y) / 1.1
            opt.zero_grad()
            loss.backward()
            opt.step()
    kinds = {f.kind: f for f in mon.findings}
    nonfinite = kinds["nonfinite_loss"]
    assert nonfinite.evidence["origin"]["op"] == "aten.lift_fresh", nonfinite.evidence["origin"]
    assert "lr_too_high" not in kinds, kinds["lr_too_high"].title
    assert "loss_grew" not in nonfinite.evidence and "learning rate" not in nonfinite.suggestion, nonfinite.suggestion


def _lr_find_then_fit(mon_dir, hand_written: bool):
    """fastai's ``learn.lr_find()`` then ``learn.fit(...)``, written out: the LRFinder callback saves
    the model and optimizer, raises the learning rate exponentially from 1e-7 to 10 over 100 batches
    (SchedExp), stops once the smoothed loss passes 4x its best, then loads both back
    (``learn.load(..., with_opt=True)``: ``model.load_state_dict``) before the real fit. fastai's own
    Optimizer is no ``torch.optim`` one (``hand_written``: the update is ``p.data.add_``)."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    x = torch.randn(512, 8)
    y = (x[:, 0] + x[:, 1] > 0).long()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

    def batch(i):
        j = (i * 32) % 512
        return x[j:j + 32], y[j:j + 32]

    def update(lr):
        if hand_written:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-lr)
                    p.grad = None
        else:
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
            opt.zero_grad()

    with tg.Monitor(model, mon_dir, every=5) as mon:
        saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        best, avg = float("inf"), 0.0
        for i in range(100):
            lr = 1e-7 * (10 / 1e-7) ** (i / 100)
            xb, yb = batch(i)
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            update(lr)
            avg = 0.98 * avg + 0.02 * loss.item()  # fastai's AvgSmoothLoss, debiased
            smooth = avg / (1 - 0.98 ** (i + 1))
            best = min(best, smooth)
            if smooth > 4 * best or not torch.isfinite(loss):
                break
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        found = i + 1
        for i in range(40):
            xb, yb = batch(i)
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            update(0.05)
    return mon, found


def test_an_lr_range_test_whose_weights_were_loaded_back_is_not_judged(tmp_path):
    # fastai 2.8 `learn.lr_find()` then `learn.fit_one_cycle(3, 1e-2)` on a tiny CNN under
    # `trainguard run --monitor`: lr_find's deliberate divergence made lr_too_high ("the smoothed
    # loss rose to 1.65 by step 87 ... lower the learning rate about 10x") and loss_spike ("Loss
    # spiked to 4.78 at step 84 (17x its recent median)") on a run that then trained to 90%
    # accuracy. The weights lr_find trained were loaded back: those steps are not the training.
    for hand_written in (False, True):
        mon, found = _lr_find_then_fit(tmp_path / f"r{int(hand_written)}", hand_written)
        assert 20 < found <= 100, found
        kinds = {f.kind: f for f in mon.findings}
        assert "lr_too_high" not in kinds and "loss_spike" not in kinds, [(f.kind, f.title) for f in mon.findings]
        assert "healthy" in kinds, [(f.kind, f.title) for f in mon.findings]
        assert f"{found} steps" in kinds["healthy"].title or kinds["healthy"].evidence.get("undone_steps") == found, \
            (kinds["healthy"].title, kinds["healthy"].evidence)


def test_weights_swapped_in_for_an_evaluation_and_back_undo_nothing(tmp_path):
    # An EMA swapped into the model with load_state_dict for each evaluation and the trained
    # weights loaded back after it: training went on from the same weights, and every step counts.
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ema = copy.deepcopy(model.state_dict())
    x, y = torch.randn(256, 8), torch.randn(256, 1)
    with tg.Monitor(model, tmp_path / "r", every=5) as mon:
        for i in range(60):
            xb, yb = x[(i * 16) % 256:][:16], y[(i * 16) % 256:][:16]
            loss = nn.functional.mse_loss(model(xb), yb) * (50 if i == 12 else 1)  # one spike, early
            opt.zero_grad()
            loss.backward()
            opt.step()
            ema = {k: 0.9 * ema[k] + 0.1 * v for k, v in model.state_dict().items()}
            if i % 20 == 19:
                backup = copy.deepcopy(model.state_dict())
                model.load_state_dict(ema)
                with torch.no_grad():
                    model(x[:32])
                model.load_state_dict(backup)
    healthy = [f for f in mon.findings if f.kind == "healthy"]
    assert not any("not judged" in f.title for f in mon.findings), [f.title for f in mon.findings]
    assert not healthy or "undone_steps" not in healthy[0].evidence


class _LoRALinear(nn.Module):
    # Derived from torchtune.modules.peft.LoRALinear: a frozen base weight and a trainable low-rank
    # update lora_b(lora_a(x)) * alpha / rank, lora_a kaiming-uniform, lora_b zeros.
    def __init__(self, d_in: int, d_out: int, rank: int = 4, alpha: float = 8.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in), requires_grad=False)
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)
        nn.init.kaiming_uniform_(self.lora_a.weight, a=5**0.5)
        nn.init.zeros_(self.lora_b.weight)
        self.scaling = alpha / rank

    def forward(self, x):
        return nn.functional.linear(x, self.weight) + self.lora_b(self.lora_a(x)) * self.scaling


class _TinyLoRALM(nn.Module):
    # A tiny torchtune lora_llama3: frozen embedding and output, per block an up and a down
    # projection with adapters and a gate without (its lora_attn_modules leave k_proj out).
    def __init__(self, vocab: int = 32, dim: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleList([_LoRALinear(dim, 4 * dim), _LoRALinear(4 * dim, dim), nn.Linear(dim, 4 * dim, bias=False)])
            for _ in range(2))
        self.out = nn.Linear(dim, vocab, bias=False)
        for p in [self.tok.weight, self.out.weight] + [b[2].weight for b in self.blocks]:
            p.requires_grad_(False)

    def forward(self, idx):
        x = self.tok(idx)
        for up, down, gate in self.blocks:
            h = nn.functional.rms_norm(x, (x.size(-1),))
            x = x + down(nn.functional.silu(gate(h)) * up(h))
        return self.out(nn.functional.rms_norm(x, (x.size(-1),)))


def _lora_run(path, lr: float, steps: int) -> dict:
    torch.manual_seed(0)
    model = _TinyLoRALM()
    # torchtune's lora_finetune_single_device hands the optimizer every parameter, the frozen too
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    seqs = (torch.randint(0, 32, (64, 1), generator=g) + torch.arange(9)) % 32
    with tg.Monitor(model, path, every=1) as mon:
        for i in range(steps):
            b = seqs[(i * 8) % 64:(i * 8) % 64 + 8]
            loss = nn.functional.cross_entropy(model(b[:, :-1]).reshape(-1, 32), b[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {f.kind: f for f in mon.findings}


def test_frozen_base_weights_do_not_hide_a_lora_rate_far_too_high(tmp_path):
    # torchtune's LoRA recipe at lr=3 (lr 3e-4 in its configs) under `trainguard run --monitor`: the
    # frozen base matrices, which the optimizer holds but never moves, made the median update ratio 0
    # at every step, so lr_too_high never saw the adapters' 766% update; the report said only
    # "exploding activations", naming no rate.
    kinds = _lora_run(tmp_path / "hi", lr=1.0, steps=30)
    assert "lr_too_high" in kinds, sorted(kinds)
    high = kinds["lr_too_high"]
    assert high.evidence["update_ratio_max"] > 1, high.evidence
    # A sweep of this model under AdamW (loss of the last 8 of 30 steps; of 100): 1e-4 3.63 (3.61), 1e-3
    # 3.58 (3.07), 3e-3 3.37 (2.06), 1e-2 2.37 (1.70), 3e-2 1.96 (1.65), 0.1 2.15 (1.84); it starts at 3.59.
    # Read off AdamW's first update at a ratio of 1e-3, the rate was 1e-4, which learns nothing.
    new = high.evidence["suggested_lr"]
    assert 3e-3 <= new <= 3e-2 and f"from 1 to about {new:g}" in high.suggestion, high.suggestion


def test_a_healthy_lora_run_reports_the_adapters_update_ratio(tmp_path):
    # was update_ratio_median: 0 (the frozen matrices' median) in the healthy finding
    kinds = _lora_run(tmp_path / "ok", lr=3e-3, steps=30)
    assert "healthy" in kinds, sorted(kinds)
    assert 0.005 < kinds["healthy"].evidence["update_ratio_median"] < 0.1, kinds["healthy"].evidence


class _Lars(torch.optim.Optimizer):
    """timm's ``Lars`` (timm/optim/lars.py, trust_clip=False, always_adapt=False): the groups with
    weight decay step by ``lr * trust_coeff * |w| / (|g| + wd |w|)``, the others as SGD with momentum."""

    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0, trust_coeff=0.001, eps=1e-8):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coeff=trust_coeff,
                                      eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            wd = group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if wd != 0:
                    w_norm, g_norm = p.norm(2.0), grad.norm(2.0)
                    trust = group["trust_coeff"] * w_norm / (g_norm + w_norm * wd + group["eps"])
                    trust = torch.where(w_norm > 0, torch.where(g_norm > 0, trust, 1.0), 1.0)
                    grad.add_(p, alpha=wd)
                    grad.mul_(trust)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    buf = state["momentum_buffer"] = grad.clone()
                else:
                    buf = state["momentum_buffer"]
                    buf.mul_(group["momentum"]).add_(grad)
                p.add_(buf, alpha=-group["lr"])


def test_a_noisy_loss_under_weights_that_do_not_move_is_a_rate_too_low_not_healthy(tmp_path):
    # timm's train.py --opt lars on a tiny ImageFolder (resnet10t, 2 classes, batch 4, 24 steps under
    # `trainguard monitor`): timm scales its default rate to the batch, 0.1 * 4 / 256, and LARS
    # multiplies it by trust_coeff 1e-3, so every weight matrix moved by under 4e-7 of its norm per
    # step and the loss stayed at chance (0.803 -> 0.776, ln 2 = 0.69), yet the verdict was "Training
    # looks healthy": the loss's best 4-step median, 0.649 at steps 14-17, was a dip of the batches'
    # noise, read as 19% progress. The losses below are that run's, as scales of a fixed batch's.
    timm_losses = [0.791, 0.647, 0.814, 0.841, 0.785, 0.804, 0.769, 0.680, 0.865, 0.806, 0.734, 0.831,
                   0.881, 0.965, 0.585, 0.660, 0.638, 0.924, 0.731, 0.690, 0.854, 0.806, 0.732, 0.745]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 2))
    decay = [p for p in model.parameters() if p.ndim > 1]  # timm's param_groups_weight_decay
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    opt = _Lars([{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": 2e-5}], lr=1.25e-3)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 0, 1])
    first = None
    with tg.Monitor(model, tmp_path / "r", every=10) as mon:
        for s in timm_losses:
            loss = nn.functional.cross_entropy(model(x), y)
            first = loss.item() if first is None else first
            loss = loss * (s / first)
            opt.zero_grad()
            loss.backward()
            opt.step()
    kinds = {f.kind: f for f in mon.findings}
    assert "healthy" not in kinds, kinds["healthy"].title
    low = kinds["lr_too_low"]
    assert low.evidence["update_ratio_median"] < 1e-5, low.evidence
    assert "0.00125" in low.suggestion, low.suggestion


class _ZeroInitLastBlock(nn.Module):
    """timm's resnet BasicBlock with ``zero_init_last`` (its default): the last BatchNorm's weight is 0,
    so at step 0 no gradient reaches the block's convolutions."""

    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        nn.init.zeros_(self.bn2.weight)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def test_a_rate_that_blows_up_the_loss_is_named_when_zero_initialised_branches_got_no_first_gradient(tmp_path):
    # timm's train.py --model resnet10t --opt adamw --lr 5 --warmup-epochs 0 under `trainguard run
    # --monitor`: the loss went 0.79, 4.19e3, 2.24e4 and stayed near 500, but the only finding was
    # exploding_activations, no lr_too_high: the step-0 update ratio is the median over the 15 weight
    # matrices, and the 8 convolutions of the blocks, behind BatchNorms zero-initialised by timm's
    # zero_init_last, got no gradient at step 0 (AdamW moved them by its weight decay alone, 1e-4),
    # so the median hid the stem's 5150-8450% update and the jump read as a noisy loss.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          *[_ZeroInitLastBlock(8) for _ in range(3)], nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=5, weight_decay=2e-5)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(4)]
    losses = []
    with tg.Monitor(model, tmp_path / "r", every=10) as mon:
        for step in range(24):
            x, y = batches[step % 4]
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert sorted(losses[1:6])[2] > 10 * losses[0], losses  # the shape of timm's run: the first update blew it up
    kinds = {f.kind: f for f in mon.findings}
    assert "lr_too_high" in kinds, [(f.kind, f.title) for f in mon.findings]
    assert "5" in kinds["lr_too_high"].suggestion, kinds["lr_too_high"].suggestion


class _DoubleConv(nn.Sequential):
    # milesial/Pytorch-UNet's unet/unet_parts.py DoubleConv: (conv 3x3 => BN => ReLU) * 2
    def __init__(self, cin: int, cout: int):
        super().__init__(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class _TinyUNet(nn.Module):
    # milesial/Pytorch-UNet's unet/unet_model.py at width 4 with two levels (Down: maxpool + DoubleConv,
    # Up: ConvTranspose2d + concat + DoubleConv, OutConv: 1x1)
    def __init__(self, classes: int = 3):
        super().__init__()
        self.inc, self.down = _DoubleConv(3, 4), nn.Sequential(nn.MaxPool2d(2), _DoubleConv(4, 8))
        self.up, self.conv = nn.ConvTranspose2d(8, 4, 2, stride=2), _DoubleConv(8, 4)
        self.outc = nn.Conv2d(4, classes, 1)

    def forward(self, x):
        x1 = self.inc(x)
        return self.outc(self.conv(torch.cat([x1, self.up(self.down(x1))], dim=1)))


def test_rmsprops_first_update_sets_no_rate_far_below_one_that_trains(tmp_path):
    # milesial/Pytorch-UNet's train.py (RMSprop, momentum 0.999, weight_decay 1e-8, clip 1.0) at -l 0.1
    # under `trainguard run --monitor`: RMSprop's first update moves every weight by about 10x the rate
    # (the root of a square average that holds a hundredth of one squared gradient), 1479% of the weight
    # matrices' norm at step 0, 0.1 after. The rate was read off that first step: "lower the learning
    # rate from 0.1 to about 7e-06", while 1e-3 trains the UNet well.
    torch.manual_seed(0)
    model = _TinyUNet()
    opt = torch.optim.RMSprop(model.parameters(), lr=0.1, weight_decay=1e-8, momentum=0.999, foreach=True)
    g = torch.Generator().manual_seed(1)
    images = torch.rand(8, 3, 16, 16, generator=g)
    masks = (images.mean(1) > 0.5).long()
    with tg.Monitor(model, tmp_path / "r", every=10) as mon:
        for i in range(30):
            b = slice((i * 2) % 8, (i * 2) % 8 + 2)
            loss = nn.functional.cross_entropy(model(images[b]), masks[b])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    high = next(f for f in mon.findings if f.kind == "lr_too_high")
    assert high.evidence["update_ratio_max"] > 1, high.evidence
    assert 1e-4 <= high.evidence["suggested_lr"] <= 1e-2, high.suggestion
    assert "first update" in high.suggestion, high.suggestion


def test_weights_initialised_tiny_set_no_rate_far_below_one_that_trains(tmp_path):
    # bentrevett/pytorch-seq2seq's legacy 4 (GRU encoder, attention, GRU decoder; init_weights draws
    # every weight from N(0, 0.01)), Adam at lr 1e-2 on a synthetic copy task, under `trainguard run
    # --monitor`: Adam's first update moves each weight by about the rate, 50% of weights that small;
    # the fix said "from 0.01 to about 2e-05", which learns nothing in 200 steps, while 1e-2 trained best
    # of 1e-2, 3e-3, 1e-3, 1e-4. Here: an embedding, a GRU and a linear head, initialised the same way.
    torch.manual_seed(0)
    emb, rnn, head = nn.Embedding(20, 16), nn.GRU(16, 32), nn.Linear(32, 20)
    model = nn.ModuleDict({"emb": emb, "rnn": rnn, "head": head})
    for name, p in model.named_parameters():
        nn.init.normal_(p, 0, 0.01) if "weight" in name else nn.init.zeros_(p)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, 20, (64, 6), generator=g)
    with tg.Monitor(model, tmp_path / "r", every=20) as mon:
        for i in range(120):
            b = seqs[(i * 8) % 64:(i * 8) % 64 + 8].t()
            out, _ = rnn(emb(b))
            loss = nn.functional.cross_entropy(head(out).reshape(-1, 20), b.flip(0).reshape(-1))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    high = next((f for f in mon.findings if f.kind == "lr_too_high"), None)
    assert high is None or high.evidence["suggested_lr"] >= 1e-3, high.suggestion


class _TinyNeRF(nn.Module):
    """yenchenlin/nerf-pytorch@63a5a63 run_nerf_helpers.py's NeRF (use_viewdirs) at D=4, W=32, skip at 2,
    on 3-D points without the positional embedding."""

    def __init__(self, W=32):
        super().__init__()
        self.pts_linears = nn.ModuleList([nn.Linear(3, W), nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W + 3, W)])
        self.views_linears = nn.ModuleList([nn.Linear(W + 3, W // 2)])
        self.feature_linear, self.alpha_linear, self.rgb_linear = nn.Linear(W, W), nn.Linear(W, 1), nn.Linear(W // 2, 3)

    def forward(self, pts, views):
        h = pts
        for i, lin in enumerate(self.pts_linears):
            h = torch.relu(lin(h))
            if i == 2:
                h = torch.cat([pts, h], -1)
        alpha = self.alpha_linear(h)
        h = torch.relu(self.views_linears[0](torch.cat([self.feature_linear(h), views], -1)))
        return torch.cat([self.rgb_linear(h), alpha], -1)


def _render(model, rays_o, rays_d, n_samples=8):
    """run_nerf.py's render_rays (near 2, far 6, no perturbation) and raw2outputs."""
    z_vals = torch.linspace(2.0, 6.0, n_samples).expand(rays_o.shape[0], n_samples)
    pts = rays_o[:, None, :] + rays_d[:, None, :] * z_vals[..., None]
    raw = model(pts, rays_d[:, None, :].expand(pts.shape))
    dists = z_vals[..., 1:] - z_vals[..., :-1]
    dists = torch.cat([dists, torch.Tensor([1e10]).expand(dists[..., :1].shape)], -1)
    dists = dists * torch.norm(rays_d[..., None, :], dim=-1)
    alpha = 1. - torch.exp(-torch.relu(raw[..., 3]) * dists)
    weights = alpha * torch.cumprod(torch.cat([torch.ones((alpha.shape[0], 1)), 1. - alpha + 1e-10], -1), -1)[:, :-1]
    return torch.sum(weights[..., None] * torch.sigmoid(raw[..., :3]), -2)


def test_a_rate_that_kills_every_unit_in_one_step_is_named_without_the_rule_failing(tmp_path):
    # nerf-pytorch's training loop at --lrate 0.5 (tiny NeRF, synthetic rays): Adam's first update moved
    # every weight matrix by about 500% of its norm and left every ReLU dead, so no gradient reached any
    # matrix after step 0 and the update ratio was known at step 0 alone. lr_too_high then failed with
    # "TypeError: 'numpy.float64' object is not iterable" (max() of one number) and said nothing.
    torch.manual_seed(0)
    model = _TinyNeRF()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(0)
    rays_o = torch.randn(64, 3, generator=g) * 0.1 + torch.tensor([0.0, 0.0, 4.0])
    rays_d = torch.nn.functional.normalize(torch.randn(64, 3, generator=g) * 0.2 + torch.tensor([0.0, 0.0, -1.0]), dim=-1)
    target = torch.rand(64, 3, generator=g)
    with tg.Monitor(model, tmp_path / "r", every=10) as mon:
        for _ in range(25):
            loss = torch.mean((_render(model, rays_o, rays_d) - target) ** 2)
            opt.zero_grad()
            loss.backward()
            opt.step()
    kinds = {f.kind: f for f in mon.findings}
    assert "rule_error" not in kinds, kinds["rule_error"].title
    assert "lr_too_high" in kinds, [(f.kind, f.title) for f in mon.findings]


def test_a_tiny_output_layer_under_warmup_sets_no_rate_far_below_one_that_trains(tmp_path):
    # karpathy/nanochat@92d63d4 (nanochat/gpt.py init_weights: lm_head from N(0, 0.001); scripts/
    # base_train.py: a linear warmup written into each group's lr), 150 steps of a pattern with 30%
    # random tokens, loss 5.55 -> 3.04: AdamW's first update, at a tenth of the peak rate, moved
    # lm_head by 139% of its tiny norm, and the fix said "lower the learning rate from 0.00139 to about
    # 1e-06". The Kaiming floor that judges such a first update was applied only without a warmup.
    torch.manual_seed(0)
    V, D = 64, 32
    model = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, V, bias=False))
    nn.init.normal_(model[3].weight, std=0.001)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0139, betas=(0.8, 0.96), eps=1e-10)
    for group in opt.param_groups:
        group["initial_lr"] = group["lr"]
    g = torch.Generator().manual_seed(1)
    with tg.Monitor(model, tmp_path / "r", every=10) as mon:
        for i in range(60):
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * min((i + 1) / 10, 1.0)
            x = torch.randint(0, V, (32,), generator=g)
            y = torch.where(torch.rand(32, generator=g) < 0.3, torch.randint(0, V, (32,), generator=g), (x * 7) % V)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    high = next((f for f in mon.findings if f.kind == "lr_too_high"), None)
    assert high is None or high.evidence["suggested_lr"] >= 1e-3, high.suggestion


# the first 32 lines of makemore's names.txt
_WORDS = ("emma olivia ava isabella sophia charlotte mia amelia harper evelyn abigail emily elizabeth mila ella avery "
         "sofia camila aria scarlett victoria madison luna grace chloe penelope layla riley zoey nora lily eleanor").split()


class _MakemoreBlock(nn.Module):
    # makemore.py's Block: pre-LayerNorm causal self-attention and a NewGELU MLP
    def __init__(self, d: int, heads: int, block: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))
        self.heads = heads

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")), dim=-1)
        x = x + self.attn_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))
        h = self.c_fc(self.ln_2(x))
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        return x + self.c_proj(h)


class _Makemore(nn.Module):
    # makemore.py's Transformer (wte + wpe, Blocks, ln_f, lm_head without bias), PyTorch's default init
    def __init__(self, vocab: int, block: int, d: int = 32, layers: int = 2, heads: int = 4):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList([_MakemoreBlock(d, heads, block) for _ in range(layers)])
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def _makemore_batches():
    # makemore.py's CharDataset: x = [0, word..., 0...], y = [word..., 0, -1...]
    chars = sorted(set("".join(_WORDS)))
    block = max(len(w) for w in _WORDS) + 1
    xs, ys = [], []
    for w in _WORDS:
        ix = [chars.index(c) + 1 for c in w]
        x, y = torch.zeros(block, dtype=torch.long), torch.zeros(block, dtype=torch.long)
        x[1:1 + len(ix)], y[:len(ix)] = torch.tensor(ix), torch.tensor(ix)
        y[len(ix) + 1:] = -1
        xs.append(x)
        ys.append(y)
    return torch.stack(xs), torch.stack(ys), len(chars) + 1, block


def test_adamws_first_update_sets_no_rate_far_below_one_that_trains_a_makemore_transformer(tmp_path):
    # karpathy/makemore@988aa59 makemore.py (Transformer, AdamW with weight_decay 0.01, betas (0.9, 0.99))
    # at -l 0.05 under `trainguard monitor`: lr_too_high read the rate off AdamW's first update, which moves
    # each weight by about the rate whatever the gradient (69% of the weight matrices' norm), and said "lower
    # the learning rate from 0.05 to about 7e-05", 7x below makemore's default 5e-4. In a 200-step sweep of
    # this tiny copy (32 names), 1e-4 ends at a loss of 2.55, 1e-3 at 0.84, 3e-3 to 3e-2 at 0.57-0.60 and
    # 0.05 at 1.15 (its floor: 0.523).
    torch.manual_seed(3407)
    x, y, vocab, block = _makemore_batches()
    model = _Makemore(vocab, block)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-8)
    g = torch.Generator().manual_seed(0)
    with tg.Monitor(model, tmp_path / "r", every=10) as mon:
        for _ in range(30):
            i = torch.randint(0, len(x), (16,), generator=g)
            loss = model(x[i], y[i])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    high = next(f for f in mon.findings if f.kind == "lr_too_high")
    assert high.evidence["update_ratio_max"] > 0.3, high.evidence  # the first update, sized by the rate
    assert 1e-3 <= high.evidence["suggested_lr"] <= 1.5e-2, high.suggestion
