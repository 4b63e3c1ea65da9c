"""Mixed precision under the monitor (CPU autocast): the stored loss is unscaled, GradScaler skips are
steps, routine skips while the scale settles are a quiet note, persistent overflow is an error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainguard
from trainguard import Monitor
from trainguard.store import open_run


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 8, generator=g)
    return x, x[:, :3].argmax(1)


def fp16_loop(model, steps, *, init_scale=2.0**24, poison=False, poison_from=0):
    """The AMP recipe of the PyTorch docs, on CPU: autocast(float16) + GradScaler; ``poison``
    from step ``poison_from`` on."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    losses, skipped = [], []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
            loss = nn.functional.cross_entropy(out, y)
            if poison and step >= poison_from:  # sqrt(|0|): a finite loss whose gradient is NaN at any scale
                loss = loss + (out[:, :1].float() * 0).abs().sqrt().sum()  # POISON
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        skipped.append(scaler.get_scale() < scale)
    return losses, skipped


def test_fp16_scaler_settling_is_a_quiet_note(tmp_path):
    model = mlp()
    with Monitor(model, tmp_path / "r", every=10) as mon:
        losses, skipped = fp16_loop(model, 60)
    assert 3 <= sum(skipped[:20]) and not any(skipped[30:])  # the scale settled early
    run = open_run(tmp_path / "r")
    s = run.scalars()
    assert [st for st, _ in s["loss"]] == list(range(60))  # skipped iterations are steps too
    assert [v for _, v in s["loss"]] == pytest.approx(losses, rel=1e-6)  # unscaled: ~1, not ~1e7
    assert [v > 0.5 for _, v in s["amp/skipped"]] == skipped
    assert s["amp/scale"][0][1] == 2.0**24
    by_kind = {f.kind: f for f in mon.findings}
    assert not [f for f in mon.findings if f.severity in ("critical", "error", "warning")], mon.findings
    note = by_kind["grad_scaler_skips"]
    assert note.severity == "info" and note.evidence["settling_skips"] == sum(skipped)
    assert "init_scale=2**" in note.suggestion
    assert "healthy" in by_kind


def test_bf16_autocast_loss_is_the_users(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    with Monitor(model, tmp_path / "r", every=10) as mon:
        for step in range(40):
            x, y = batch(step)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    s = open_run(tmp_path / "r").scalars()
    assert [v for _, v in s["loss"]] == pytest.approx(losses, rel=1e-6)
    assert "amp/skipped" not in s
    assert [f.kind for f in mon.findings] == ["healthy"]


def test_persistent_overflow_is_an_error_with_its_origin(tmp_path):
    model = mlp()
    with trainguard.record(tmp_path / "r", mode="full_health"):
        with Monitor(model, tmp_path / "r", every=10) as mon:
            losses, skipped = fp16_loop(model, 30, poison=True)
    assert all(skipped)
    f = next(f for f in mon.findings if f.kind == "grad_scaler_skips")
    assert f.severity == "error"
    assert "every one of the 30 steps was skipped" in f.title
    assert "bfloat16" in f.suggestion and "test_monitor_amp.py" in f.suggestion  # the op's line
    assert f.evidence["origin"]["line"] > 0
    assert not any(f.kind == "nonfinite_gradient" for f in mon.findings)  # the scaler's rule judges these


def test_skips_of_steps_whose_loss_was_already_nan_are_not_called_a_float16_overflow(tmp_path):
    # facebookresearch/mae's loop (engine_pretrain.py, util/misc.py NativeScalerWithGradNormCount @
    # efb2a80) in float32 with its GradScaler, norm_pix_loss without its 1e-6 and one image with a
    # constant patch: the loss is NaN in the forward pass of each batch holding it, and the scaler skips
    # those steps. grad_scaler_skips said "Mixed precision keeps overflowing ... compute it in float32
    # ... or keep its values in float16's range; train in bfloat16": no autocast ran, and no scale or
    # precision makes a NaN loss finite.
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with Monitor(model, tmp_path / "r", every=10) as mon:
        for step in range(40):
            x, y = batch(step)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if step % 8 == 6:
                loss = loss * 0 / torch.zeros(())  # 0/0 in the forward pass
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    f = next(f for f in mon.findings if f.kind == "grad_scaler_skips")
    assert "float16" not in f.title + f.suggestion and "bfloat16" not in f.suggestion, (f.title, f.suggestion)
    assert "loss" in f.title and "nonfinite_loss" in f.suggestion, (f.title, f.suggestion)
    assert any(f.kind == "nonfinite_loss" for f in mon.findings)


POISON_LINE = next(i for i, line in enumerate(open(__file__), 1) if line.rstrip().endswith("# POISON"))


def test_the_origin_of_a_later_persistent_overflow_is_of_those_steps(tmp_path):
    # The scale settles first (routine overflows in steps 0..k), then the poison makes every step
    # from 30 on overflow: the fix must name the op of the persistent steps, not a settling one.
    model = mlp()
    with trainguard.record(tmp_path / "r", mode="full_health", buffer=100_000):
        with Monitor(model, tmp_path / "r", every=10) as mon:
            losses, skipped = fp16_loop(model, 45, poison=True, poison_from=30)
    assert any(skipped[:10]) and not any(skipped[20:30]) and all(skipped[30:])
    f = next(f for f in mon.findings if f.kind == "grad_scaler_skips")
    assert f.severity == "error" and "from step 30" in f.title
    origin = f.evidence["origin"]
    assert origin["step"] >= 30 and origin["line"] == POISON_LINE, origin
    assert f"test_monitor_amp.py:{POISON_LINE}" in f.suggestion


def test_the_monitors_diagnosis_sees_what_the_recorder_still_holds(tmp_path, monkeypatch):
    # The monitor diagnoses at its close, inside the recording: the recorder's records of the last
    # steps may not have reached the writer yet (it hands them over by time). Found as a flaky
    # KeyError 'origin' in the test above; here the recorder's time-based hand-overs are off, so the
    # records of steps 30.. reach the writer only if the monitor's flush gathers them.
    from trainguard.capture import _recorder

    monkeypatch.setattr(_recorder, "FLUSH_SECONDS", 1e9)
    monkeypatch.setattr(_recorder.Recorder, "_flush_if_stale", lambda self: None)
    model = mlp()
    with trainguard.record(tmp_path / "r", mode="full_health", buffer=100_000):
        with Monitor(model, tmp_path / "r", every=10) as mon:
            fp16_loop(model, 45, poison=True, poison_from=30)
    f = next(f for f in mon.findings if f.kind == "grad_scaler_skips")
    assert f.severity == "error"
    origin = f.evidence["origin"]
    assert origin["step"] >= 30 and origin["line"] == POISON_LINE, origin


def test_gradient_norm_is_read_unscaled_from_the_first_step(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    ref = []
    with Monitor(model, tmp_path / "r", every=5, diagnose=False):
        for step in range(6):
            x, y = batch(step)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            ref.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item())
            scaler.step(opt)
            scaler.update()
    s = open_run(tmp_path / "r").scalars()
    assert not any(v for _, v in s["amp/skipped"])
    assert [v for _, v in s["grad_norm"]] == pytest.approx(ref, rel=1e-5)


def test_a_disabled_scaler_passes_through(tmp_path):
    # karpathy/nanoGPT's train.py on CPU/float32: GradScaler(enabled=False), whose step() must
    # simply run the optimizer (a disabled scaler has no _scale; the tap crashed the script).
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with Monitor(model, tmp_path / "m", every=1):
        for step in range(3):
            x, y = batch(step)
            loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    with open_run(tmp_path / "m") as run:
        assert [s for s, _ in run.scalars("loss")["loss"]] == [0, 1, 2]
