"""The true origin inside frameworks: Lightning's inf sentinel and DDP's uninitialised buckets
are never alerts (see test_true_origin for the models themselves)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.analysis import origin
from trainguard.store import open_run


def _lightning_fit(root: Path) -> None:
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

        def training_step(self, batch, i):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, i):
            x, y = batch
            self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 2, (32,), generator=g))
    torch.manual_seed(0)
    # ModelCheckpoint builds torch.tensor(inf) as its best-score sentinel when the Trainer is made.
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=root / "ckpt", monitor="val_loss", save_top_k=1)
    trainer = L.Trainer(max_epochs=3, callbacks=[ckpt], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root, accelerator="cpu", devices=1)
    trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=8), torch.utils.data.DataLoader(data, batch_size=8))


def test_lightning_model_checkpoint_sentinel_is_no_alert(tmp_path):
    with tg.record(tmp_path / "r"):
        _lightning_fit(tmp_path / "a")
    run = open_run(tmp_path / "r")
    assert run.alerts()["total"] == 0 and origin(run) is None
    assert any(g["made_by"] == "aten.lift_fresh.default" and g["kind"] == "+inf" for g in run.intended())
    with tg.check_numerics():
        _lightning_fit(tmp_path / "b")


@pytest.mark.timeout(240)
def test_ddp_buckets_are_unknown_not_nan(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).with_name("_ddp_origin.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "r"), str(port)], capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]  # check_numerics ran to the end on both ranks
    for rank in (0, 1):
        run = open_run(tmp_path / "r", rank=rank)
        assert run.alerts()["total"] == 0 and origin(run) is None
        # the buckets and their views were seen, as unknown
        unknown = run.executions(health="unknown")
        assert any(e["op"] == "aten.as_strided" for e in unknown), {e["op"] for e in unknown}
