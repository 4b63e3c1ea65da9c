"""A per-sample schedule vector broadcast along the last axis instead of the batch axis."""

from __future__ import annotations

import torch
from torch import nn

import trainguard as tg
from trainguard.analysis import diagnose
from trainguard.store import open_run


def extract(a, t, x_shape, reshape=True):
    # lucidrains/denoising-diffusion-pytorch denoising_diffusion_pytorch.py @ faed4db: extract();
    # without the reshape the [B] vector lines up with the last axis of a [B, C, H, W] batch
    b, *_ = t.shape
    out = a.gather(-1, t)
    return out.reshape(b, *((1,) * (len(x_shape) - 1))) if reshape else out


def _run(tmp_path, reshape):
    torch.manual_seed(0)
    betas = torch.linspace(1e-4, 0.02, 100)
    alphas_cumprod = torch.cumprod(1 - betas, 0)
    sqrt_ac, sqrt_1m_ac = alphas_cumprod.sqrt(), (1 - alphas_cumprod).sqrt()
    model = nn.Conv2d(3, 3, 3, padding=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tg.record(tmp_path / "r"):
        for _ in range(3):
            x_start = torch.rand(8, 3, 8, 8) * 2 - 1  # 8 samples of 8x8: the batch size is the width
            t = torch.randint(0, 100, (8,))
            noise = torch.randn_like(x_start)
            x = extract(sqrt_ac, t, x_start.shape, reshape) * x_start + extract(sqrt_1m_ac, t, x_start.shape, reshape) * noise
            loss = nn.functional.mse_loss(model(x), noise)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return open_run(tmp_path / "r")


def test_a_schedule_vector_broadcast_along_the_width_is_found_with_its_line_and_the_reshape(tmp_path):
    # Nothing raises when the batch size equals the width: the diffusion trains on wrongly noised
    # images, and the monitor said "Training looks healthy" (DiT's _extract_into_tensor without its
    # `res[..., None]` loop, 8 latents per rank of 8x8, did the same).
    fs = [f for f in diagnose(_run(tmp_path / "bad", reshape=False))
          if f.kind == "per_sample_broadcast"]
    assert len(fs) == 1, [f.title for f in fs]
    f = fs[0]
    assert f.evidence["vector_shape"] == [8] and f.evidence["tensor_shape"] == [8, 3, 8, 8], f.evidence
    assert f.evidence["lookup"].startswith("aten.gather") and "test_axis_rules.py" in f.evidence["at"], f.evidence
    assert "[8, 1, 1, 1]" in f.suggestion, f.suggestion


def test_a_schedule_vector_reshaped_to_the_batch_axis_is_not_a_finding(tmp_path):
    fs = diagnose(_run(tmp_path / "good", reshape=True))
    assert not [f for f in fs if f.kind == "per_sample_broadcast"], [f.title for f in fs]


def test_the_report_of_a_recording_without_the_monitor_names_the_broadcast(tmp_path):
    # `trainguard run train.py` (no --monitor) stores no findings; the report reads loss misuse off the
    # recording itself, and said nothing of this one.
    from trainguard.analysis import build_report

    report = build_report(_run(tmp_path / "bad", reshape=False))
    assert [f for f in report["findings"] if f["kind"] == "per_sample_broadcast"], [f["kind"] for f in report["findings"]]
