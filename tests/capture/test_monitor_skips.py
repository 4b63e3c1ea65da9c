"""Iterations a loop skips itself: the model ran its training forward, the program checked the loss
for NaN/Inf, found it non-finite and ran the next iteration without backward() or optimizer.step().

The pattern is normflows' own example loop (VincentStimper/normalizing-flows,
examples/real_nvp_colab.ipynb): ``loss = model.forward_kld(x); if ~(torch.isnan(loss) |
torch.isinf(loss)): loss.backward(); optimizer.step()``; also ``if not torch.isfinite(loss):
continue`` and ``if not math.isfinite(loss.item()): continue``. Before, the monitor saw nothing of
the skipped iterations (steps and the loss come from backward() and optimizer.step()): no finding
about them, and every later step number one less than the loop's own counter per skip.

The other half are loops that run a model with gradients and no backward() through it for good
reasons (a GAN's generator in the discriminator step, an EMA teacher, an RL rollout, a warm-up
forward, LBFGS, SAM, gradient accumulation, GradScaler skips): none may be called skipped.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainguard import Monitor
from trainguard.store import open_run


def mlp(out: int = 1):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, out))


def batch(it: int, n: int = 32):
    g = torch.Generator().manual_seed(it)
    x = torch.randn(n, 4, generator=g)
    return x, x.sum(1, keepdim=True)


def check_isnan_isinf(loss):  # normflows' notebook
    return bool(~(torch.isnan(loss) | torch.isinf(loss)))


def check_isfinite(loss):
    return bool(torch.isfinite(loss))


def check_item(loss):
    return math.isfinite(loss.item())


def skip_loop(model, iters, check, *, nan_at=(), bad_from=None):
    """A regression loop that skips the update of any iteration whose loss is not finite:
    ``nan_at`` puts a NaN in one sample of those iterations' batches, ``bad_from`` makes every
    later loss +inf (log of 0, as normflows' exp(-scale) overflow made it)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ran = []
    for it in range(iters):
        x, y = batch(it)
        if it in nan_at:
            x[3, 0] = float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        if bad_from is not None and it >= bad_from:
            loss = loss - torch.log(torch.zeros(()))
        if check(loss):
            opt.zero_grad()
            loss.backward()
            opt.step()
            ran.append(it)
    return ran


def scalars(path, name):
    return open_run(path).scalars(name).get(name) or []


def findings(path, kind):
    return [f for f in open_run(path).findings() if f["kind"] == kind]


@pytest.mark.parametrize("check", [check_isnan_isinf, check_isfinite, check_item])
def test_iterations_the_loop_skips_are_counted_with_their_loss(tmp_path, check):
    model = mlp()
    with Monitor(model, tmp_path / "r", every=10):
        ran = skip_loop(model, 40, check, nan_at={17}, bad_from=30)
    assert len(ran) == 29
    meta = open_run(tmp_path / "r").meta["monitor"]
    sk = meta["skipped_iterations"]
    assert sk["count"] == 11
    assert sk["steps"][:2] == [17, 30] and sk["steps"][-1] == 39
    assert sk["first"]["step"] == 17 and math.isnan(sk["first"]["loss"])
    assert sk["first"]["file"].endswith("test_monitor_skips.py")
    assert sk["nonfinite"]["inf"] == 10 and sk["nonfinite"]["nan"] == 1
    # The loop's own counter and the run's steps agree: each skipped iteration is a step of its own.
    assert [s for s, _ in scalars(tmp_path / "r", "loss")] == ran
    assert [s for s, v in scalars(tmp_path / "r", "skipped") if v] == [17, *range(30, 40)]
    f = findings(tmp_path / "r", "iterations_skipped")
    assert len(f) == 1, [x["kind"] for x in open_run(tmp_path / "r").findings()]
    f = f[0]
    assert f["severity"] == "error"
    assert "11 of 40 iterations" in f["title"] and "never called backward()" in f["title"]
    assert "nan at step 17" in f["title"]
    assert "check-numerics" in f["suggestion"]
    assert f["evidence"]["skipped"] == 11 and f["evidence"]["iterations"] == 40


def test_one_skipped_nan_batch_is_a_warning_and_keeps_later_steps_aligned(tmp_path):
    model = mlp()
    with Monitor(model, tmp_path / "r", every=10):
        ran = skip_loop(model, 30, check_isnan_isinf, nan_at={5})
    assert [s for s, _ in scalars(tmp_path / "r", "loss")] == ran == [i for i in range(30) if i != 5]
    f = findings(tmp_path / "r", "iterations_skipped")
    assert len(f) == 1 and f[0]["severity"] == "warning"
    assert f[0]["title"].startswith("1 of 30 iterations ran the model but never called backward()")
    assert not findings(tmp_path / "r", "healthy")


# ---------------------------------------------------------------------- never a skip
def gan(steps):
    """pytorch/examples dcgan's loop, fully connected: the generator runs with gradients in the
    discriminator step (its output detached there) and its graph is used by the generator step."""
    torch.manual_seed(0)
    g, d = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), nn.Sequential(nn.Linear(4, 8), nn.ReLU(),
                                                                                    nn.Linear(8, 1))
    og, od = torch.optim.Adam(g.parameters(), 1e-3), torch.optim.Adam(d.parameters(), 1e-3)
    bce = nn.BCEWithLogitsLoss()
    for it in range(steps):
        real, _ = batch(it)
        d.zero_grad()
        err_real = bce(d(real), torch.ones(32, 1))
        err_real.backward()
        fake = g(torch.randn(32, 4))
        err_fake = bce(d(fake.detach()), torch.zeros(32, 1))
        err_fake.backward()
        od.step()
        g.zero_grad()
        err_g = bce(d(fake), torch.ones(32, 1))
        err_g.backward()
        og.step()
        assert math.isfinite(err_g.item())
    return [g, d]


def ema_teacher(steps):
    """A mean-teacher / BYOL-style loop: the EMA teacher runs in train mode with gradients on
    (its output detached), its loss is checked, nothing ever calls backward() through it."""
    student, teacher = mlp(), mlp()
    opt = torch.optim.SGD(student.parameters(), lr=1e-2)
    for it in range(steps):
        x, y = batch(it)
        target = teacher(x)
        teacher_loss = nn.functional.mse_loss(target, y)
        assert math.isfinite(teacher_loss.item())
        loss = nn.functional.mse_loss(student(x), target.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for pt, ps in zip(teacher.parameters(), student.parameters()):
                pt.mul_(0.9).add_(ps, alpha=0.1)
    return student


def accumulation(steps, k=4):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for it in range(steps * k):
        x, y = batch(it)
        loss = nn.functional.mse_loss(model(x), y) / k
        if not torch.isfinite(loss):
            continue
        loss.backward()
        if (it + 1) % k == 0:
            opt.step()
            opt.zero_grad()
    return model


def lbfgs(steps):
    """pytorch/examples time_sequence_prediction: LBFGS calls the closure several times per step."""
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x, y = batch(0)
    for _ in range(steps):
        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            assert math.isfinite(loss.item())
            loss.backward()
            return loss

        opt.step(closure)
    return model


def sam(steps):
    """SAM: two forward/backward passes per step, the first to find the ascent direction."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for it in range(steps):
        x, y = batch(it)
        loss = nn.functional.mse_loss(model(x), y)
        assert torch.isfinite(loss)
        loss.backward()
        eps = []
        with torch.no_grad():
            for p in model.parameters():
                e = 0.05 * p.grad / (p.grad.norm() + 1e-12)
                p.add_(e)
                eps.append(e)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p, e in zip(model.parameters(), eps):
                p.sub_(e)
        opt.step()
        opt.zero_grad()
    return model


def rollout(steps):
    """cleanRL's PPO without its no_grad around the rollout: 16 policy forwards with gradients and
    no backward through them (their values read and checked), then the update."""
    model = mlp(2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for update in range(steps):
        obs = []
        for t in range(16):
            x, _ = batch(update * 100 + t, n=8)
            value = model(x)[:, 1].mean()
            assert math.isfinite(value.item())
            obs.append(x)
        x = torch.cat(obs)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def warmup_and_validation_in_train_mode(steps):
    """A warm-up forward before training (cudnn autotuning, a lazy module), and a validation
    pass left in train mode under no_grad, whose loss is checked."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = batch(0)
    warm = nn.functional.mse_loss(model(x), y)
    assert torch.isfinite(warm)
    for it in range(steps):
        x, y = batch(it)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            val = nn.functional.mse_loss(model(batch(1000)[0]), batch(1000)[1])
            assert torch.isfinite(val)
    return model


def eval_mode_nan_with_grad(steps):
    """An evaluation in eval mode with gradients left on, whose loss is NaN and checked: no
    training iteration was skipped (nonfinite_val_loss's business)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for it in range(steps):
        x, y = batch(it)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.eval()
        xv, yv = batch(1000)
        xv[0, 0] = float("nan")
        val = nn.functional.mse_loss(model(xv), yv)
        assert not torch.isfinite(val)
        model.train()
    return model


def nan_checked_after_backward(steps):
    """DeiT/MAE-style: the loss is read after backward(); one NaN batch is trained on, not skipped
    (nonfinite_loss's business, not this rule's)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for it in range(steps):
        x, y = batch(it)
        if it == 7:
            x[0, 0] = float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if not math.isfinite(loss.item()):
            for p in model.parameters():
                p.grad = None
        opt.step()
    return model


def grad_scaler_overflow(steps):
    """An overflowing loss under a GradScaler: backward() runs, the scaler skips the update (its
    own rule, grad_scaler_skips)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for it in range(steps):
        x, y = batch(it)
        loss = nn.functional.mse_loss(model(x), y)
        if it == 3:
            loss = loss * torch.tensor(float("inf"))
        assert it == 3 or torch.isfinite(loss)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return model


LOOPS = [gan, ema_teacher, accumulation, lbfgs, sam, rollout, warmup_and_validation_in_train_mode,
         eval_mode_nan_with_grad, nan_checked_after_backward, grad_scaler_overflow]


@pytest.mark.parametrize("loop", LOOPS, ids=[f.__name__ for f in LOOPS])
def test_loops_that_run_models_without_backward_on_purpose_skip_nothing(tmp_path, loop):
    with Monitor(None, tmp_path / "r", every=5):
        loop(22)
    meta = open_run(tmp_path / "r").meta["monitor"]
    assert "skipped_iterations" not in meta
    assert not findings(tmp_path / "r", "iterations_skipped")
    assert not scalars(tmp_path / "r", "skipped")
    # SAM changes the weights in place between its two backward passes: before the optimizer is
    # known (its first step), that ends a step as updates by hand do (docs/monitor.md, Steps).
    assert meta["final_step"] == (23 if loop is sam else 22)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_scripts_and_compiled_code_still_call_the_checks(tmp_path):
    # While a monitor is open torch.isnan & co. are trainguard's wrappers: TorchScript must still
    # find them as builtins (it raised "module, class, method, function ... expected, got
    # builtin_function_or_method" trying to compile the wrapper), and Dynamo traces through them.
    model = mlp()
    with Monitor(model, tmp_path / "r", every=5, diagnose=False):
        @torch.jit.script
        def bad(x: torch.Tensor) -> torch.Tensor:
            return torch.isnan(x).any() | torch.isinf(x).any() | ~torch.isfinite(x).all()

        assert not bool(bad(torch.ones(3))) and bool(bad(torch.tensor([float("nan")])))
        compiled = torch.compile(lambda x: torch.isnan(model(x)).any(), backend="eager")
        assert not bool(compiled(torch.ones(2, 4)))
    assert torch.isnan is torch._C._VariableFunctions.isnan  # put back


def test_a_restore_forgets_the_skips_that_run_again():
    # A guard's rewind (or a checkpoint's restore) to step 20 runs steps 20.. again: their skips
    # are counted again when they recur, so the account drops them.
    from trainguard.capture._skips import Skip, count, forget

    acc = None
    for step, v in ((5, float("nan")), (21, float("inf")), (22, float("-inf"))):
        acc = count(acc, Skip(step=step, loss=v, file="t.py", line=3, check="isnan"))
    assert acc["count"] == 3 and acc["nonfinite"] == {"nan": 1, "inf": 1, "-inf": 1}
    kept = forget(acc, 20)
    assert kept["count"] == 1 and kept["steps"] == [5] and kept["nonfinite"] == {"nan": 1}
    assert kept["last"]["step"] == 5 and math.isnan(kept["last"]["loss"])
    assert forget(acc, 5) is None and forget(acc, 30) is acc
