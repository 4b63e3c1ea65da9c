"""posterior_collapse: a Gaussian VAE whose encoder's mean and log-variance heads give every input
the prior N(0, 1), so the latent carries nothing and the decoder learns the mean image."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from trainguard import Monitor


class _VanillaVAE(nn.Module):
    """AntixK/PyTorch-VAE models/vanilla_vae.py (@a6896b9) in small: its fc_mu/fc_var heads,
    decoder_input, reparameterize and loss_function verbatim; the conv encoder and decoder are one
    Linear layer each, on 8x8 images."""

    def __init__(self, latent_dim: int = 4):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 32), nn.LeakyReLU())
        self.fc_mu = nn.Linear(32, latent_dim)
        self.fc_var = nn.Linear(32, latent_dim)
        self.decoder_input = nn.Linear(latent_dim, 32)
        self.final_layer = nn.Sequential(nn.LeakyReLU(), nn.Linear(32, 64), nn.Tanh())

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return eps * std + mu

    def forward(self, input):
        result = self.encoder(input)
        mu, log_var = self.fc_mu(result), self.fc_var(result)
        z = self.reparameterize(mu, log_var)
        return [self.final_layer(self.decoder_input(z)), input, mu, log_var]

    def loss_function(self, recons, input, mu, log_var, M_N):
        recons_loss = F.mse_loss(recons, input)
        kld_loss = torch.mean(-0.5 * torch.sum(1 + log_var - mu ** 2 - log_var.exp(), dim=1), dim=0)
        return recons_loss + M_N * kld_loss


def _blobs(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    yy, xx = torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij")
    c = torch.rand(n, 2, generator=g) * 4 + 2
    img = torch.exp(-((yy - c[:, 0, None, None]) ** 2 + (xx - c[:, 1, None, None]) ** 2) / 4)
    return (img * 2 - 1).view(n, 64)


def _train(path, kld_weight: float) -> list:
    torch.manual_seed(0)
    model = _VanillaVAE()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    x = _blobs(512)
    with Monitor(model, path, every=5) as mon:
        for step in range(80):
            batch = x[step % 16 * 32:][:32]
            loss = model.loss_function(*model(batch), M_N=kld_weight)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return mon.findings


def test_a_vae_whose_kl_term_swamps_the_reconstruction_collapses_its_posterior(tmp_path):
    # PyTorch-VAE's experiment.py with kld_weight 1 (its configs say 0.00025: batch / dataset size)
    # on 16x16 images ended with KL 0.004 nats, fc_mu's outputs std 0.03 and fc_var's mean 0.002
    # (every posterior the prior), reconstruction MSE 20x the healthy run's; the diagnosis was
    # "Training looks healthy".
    findings = _train(tmp_path / "r", kld_weight=1.0)
    found = [f for f in findings if f.kind == "posterior_collapse"]
    assert found, [(f.kind, f.title) for f in findings]
    f = found[0]
    assert f.severity == "warning" and f.layers == ["fc_mu", "fc_var"], (f.severity, f.layers)
    assert f.evidence["kl_nats"] < 0.1, f.evidence
    assert "kld_weight" in f.suggestion or "warm-up" in f.suggestion, f.suggestion


def test_a_healthy_vae_keeps_its_posterior(tmp_path):
    findings = _train(tmp_path / "r", kld_weight=0.00025)
    assert "posterior_collapse" not in {f.kind for f in findings}, [(f.kind, f.title) for f in findings]
    assert not [f for f in findings if f.is_problem], [(f.kind, f.title) for f in findings]


def test_a_wide_latent_with_few_active_dimensions_is_no_collapse(tmp_path):
    # The full ELBO (summed reconstruction error + KL) on data of 2 degrees of freedom with 128 latent
    # dimensions: most dimensions stay at the prior, as they should, and the few in use carry the
    # input (KL 0.8 nats per input at the end). Judged per dimension on average (0.0035 nats), it was
    # called a collapse; the latent's total is what the decoder gets.
    torch.manual_seed(0)
    model = _VanillaVAE(latent_dim=128)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    x = _blobs(512)
    with Monitor(model, tmp_path / "r", every=5) as mon:
        for step in range(80):
            recons, inp, mu, log_var = model(x[step % 16 * 32:][:32])
            kld = torch.mean(-0.5 * torch.sum(1 + log_var - mu ** 2 - log_var.exp(), dim=1), dim=0)
            loss = F.mse_loss(recons, inp, reduction="sum") / 32 + kld
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert kld.item() > 0.3
    assert "posterior_collapse" not in {f.kind for f in mon.findings}, [(f.kind, f.title) for f in mon.findings]
