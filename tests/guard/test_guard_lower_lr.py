"""The guard's lower_lr policy on a fault the updates before the failing step made: a VAE whose
learning rate is too high grows its log-variance until std = exp(0.5 * logvar) overflows."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg


class _VAE(nn.Module):
    """AntixK/PyTorch-VAE models/vanilla_vae.py (@a6896b9) in small: fc_mu/fc_var heads,
    reparameterize and loss_function as written there, one Linear layer for the encoder and decoder."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 16), nn.LeakyReLU())
        self.fc_mu, self.fc_var = nn.Linear(16, 4), nn.Linear(16, 4)
        self.decoder = nn.Sequential(nn.Linear(4, 16), nn.Tanh())

    def forward(self, x):
        h = self.encoder(x)
        mu, log_var = self.fc_mu(h), self.fc_var(h)
        std = torch.exp(0.5 * log_var)
        z = torch.randn_like(std) * std + mu
        recons = self.decoder(z)
        kld_loss = torch.mean(-0.5 * torch.sum(1 + log_var - mu ** 2 - log_var.exp(), dim=1), dim=0)
        return F.mse_loss(recons, x) + 0.00025 * kld_loss


def _train_at_lr_3(tmp_path, snapshot_every: int, steps: int):
    """The VAE under Adam at lr 3.0, guarded with lower_lr: (guard, state, model) after ``steps``."""
    torch.manual_seed(0)
    model = _VAE()
    x = (torch.rand(256, 16) * 2 - 1) * 4
    state = tg.TrainState(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=3.0),
                          loader=DataLoader(TensorDataset(x), batch_size=32, shuffle=True))
    guard = tg.Guard(tmp_path / "run", snapshot_every=snapshot_every, policy="lower_lr", max_rewinds=5)
    for _, (batch,) in guard.batches(state, total_steps=steps):
        loss = model(batch)
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
    return guard, state, model


def test_lower_lr_retries_from_before_the_updates_that_made_the_fault(tmp_path):
    # At Adam's lr 3.0 the first update grows fc_var until step 1's exp(0.5 * log_var) overflows
    # in the forward pass. lower_lr halved the rate and retried step 1 from a snapshot taken at
    # step 1, with the weights that update made: "loss is inf; rewound to step 1", five times, then
    # Diverged (max_rewinds). Retried from the snapshot before it (step 0), a lower rate trains.
    guard, state, model = _train_at_lr_3(tmp_path, snapshot_every=50, steps=30)
    events = guard.events
    assert events and all(e["action"] == "lower_lr" for e in events), [e["message"] for e in events]
    assert events[0]["origin"]["origin"]["op"] == "aten.exp", events[0]["origin"]["origin"]
    assert all(e["retried_from"] < e["step"] for e in events), [e["message"] for e in events]
    assert "retried from step" in events[0]["message"], events[0]["message"]
    assert state.step == 30 and all(torch.isfinite(p).all() for p in model.parameters())


def test_lower_lr_goes_back_when_the_fault_lands_on_a_snapshot_step(tmp_path):
    # The same VAE with a snapshot at every step: step 1's fault landed on the snapshot taken at
    # step 1, after the update that made it; lower_lr retried step 1 from there ("retried from
    # step 1") until max_rewinds and Diverged. It must go back to the snapshot before (step 0).
    guard, state, model = _train_at_lr_3(tmp_path, snapshot_every=1, steps=10)
    events = guard.events
    assert events and all(e["action"] == "lower_lr" for e in events), [e["message"] for e in events]
    assert all(e["retried_from"] < e["step"] for e in events), [e["message"] for e in events]
    assert state.step == 10 and all(torch.isfinite(p).all() for p in model.parameters())
