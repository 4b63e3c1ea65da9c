"""A Lightning training script, run by the tests both with ``TrainguardCallback`` and unmodified under
``trainguard run --monitor``. Shaped after Lightning's ``examples/pytorch/bug_report/bug_report_model.py``
(a LightningModule, a random dataset, a Trainer): an MLP learning which of three features is largest.

    python lit_mlp.py --steps 30 [--callback LOGDIR [--record]] [--plant 20] [--accumulate 2]
                      [--ckpt-out PATH] [--ckpt-in PATH] [--norms OUT.json] [--precision bf16-mixed] [--touch]
"""

import argparse
import json

import lightning as L
import torch
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class MLP(L.LightningModule):
    def __init__(self, plant_at=None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.plant_at = plant_at
        self.norms = {}
        self.losses = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        probs = torch.softmax(self.net(x), dim=1)
        if self.plant_at is not None and self.global_step >= self.plant_at:
            probs = probs * 0  # a planted fault: the log below sees zeros
        loss = -(torch.log(probs) * nn.functional.one_hot(y, 3)).sum(1).mean()  # LOG LINE
        self.losses.setdefault(self.global_step, []).append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):
        # Lightning's own gradient-norm logging, at the point its docs recommend.
        self.norms[self.global_step] = grad_norm(self, norm_type=2)["grad_2.0_norm_total"].item()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    return DataLoader(TensorDataset(x, x[:, :3].argmax(1)), batch_size=16)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--callback", default=None)
    p.add_argument("--record", action="store_true")
    p.add_argument("--plant", type=int, default=None)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--ckpt-out", default=None)
    p.add_argument("--ckpt-in", default=None)
    p.add_argument("--norms", default=None)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--touch", action="store_true", help="call the model once before fit")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model = MLP(plant_at=args.plant)
    if args.touch:
        model.net(torch.zeros(1, 8))  # outside the trainer: a monitor attaching here sees no Trainer
    callbacks = []
    if args.callback:
        from trainguard.integrations.lightning import TrainguardCallback

        callbacks.append(TrainguardCallback(args.callback, record=args.record, every=5))
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=args.devices, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        accumulate_grad_batches=args.accumulate, precision=args.precision, callbacks=callbacks,
                        strategy="ddp" if args.devices > 1 else "auto")
    trainer.fit(model, loader(), ckpt_path=args.ckpt_in)
    if args.ckpt_out:
        trainer.save_checkpoint(args.ckpt_out)
    if args.norms and trainer.global_rank == 0:
        with open(args.norms, "w") as f:
            json.dump({"norms": model.norms, "losses": model.losses}, f)
    return trainer


if __name__ == "__main__":
    main()
