"""Raw inputs in float16: milesial/Pytorch-UNet @ 21d7850 trained with ``--amp`` on 16-bit images
(values up to 65535; float16's largest is 65504). The report led with a NaN loss at step 3 (its fix:
"record the run ... usual suspects: log of 0") and a GradScaler that kept skipping (its fix: find the
op that overflows, or bfloat16), with "inputs are not normalised" a separate warning below them:
the inputs are why the first layer's sums leave float16's range."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import trainguard
from trainguard import Monitor
from trainguard.analysis import diagnose


def _train(path, scale: float):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 1))  # UNet's first conv, its head
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with Monitor(model, path, every=2, diagnose=False):
        for _ in range(20):
            x = torch.rand(4, 1, 16, 16) * scale
            y = (x[:, 0] > scale / 2).long()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return {f.kind: f for f in diagnose(trainguard.open(path))}


def test_raw_16_bit_inputs_under_float16_explain_the_nan_loss_and_the_skipped_steps(tmp_path):
    fs = _train(tmp_path / "raw", 65535.0)
    cause = fs["inputs_not_normalized"]
    assert cause.severity == "critical", [(f.kind, f.severity) for f in fs.values()]
    assert set(cause.evidence["explains"]) >= {"nonfinite_loss", "grad_scaler_skips"}
    assert fs["nonfinite_loss"].evidence["explained_by"] == ["inputs_not_normalized"]
    assert "float16" in cause.title and "65504" in cause.suggestion
    assert list(fs)[0] == "inputs_not_normalized"  # diagnose sorts the cause first


def test_inputs_a_little_off_scale_are_no_cause_of_float16_overflows():
    from trainguard.analysis._causes import explain
    from trainguard.store import Finding

    def findings(top):
        cause = Finding(kind="inputs_not_normalized", severity="warning", title="i", layers=["<input>"],
                        evidence={"min": 0.0, "max": top, "mean": top / 2, "std": top / 4})
        skips = Finding(kind="grad_scaler_skips", severity="error", title="s", evidence={})
        explain([cause, skips])
        return cause, skips

    cause, skips = findings(65000.0)
    assert skips.evidence.get("explained_by") == ["inputs_not_normalized"] and cause.severity == "error"
    cause, skips = findings(40.0)  # off scale for the units, not for float16: the overflow is elsewhere
    assert "explained_by" not in skips.evidence and cause.severity == "warning"
