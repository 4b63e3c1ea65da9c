"""A Real NVP flow whose modules run through methods, never ``module(x)``, for the capture tests.

Reduced from VincentStimper/normalizing-flows (normflows 1.7.3): ``NormalizingFlow.forward_kld``
(core.py) runs ``self.flows[i].inverse(z)`` and ``self.q0.log_prob(z)``;
``AffineCouplingBlock.inverse`` (flows/affine/coupling.py) runs Split, AffineCoupling and Merge
through their ``inverse`` methods, and only the coupling's ``param_map`` MLP is called as
``module(x)``. ``ActNorm``'s ``s``/``t`` and the base distribution's ``loc``/``log_scale`` are
trained but held by modules no hook ever sees.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class MLP(nn.Module):  # normflows.nets.MLP([1, hidden, 2])
    def __init__(self, hidden: int = 8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, hidden), nn.LeakyReLU(), nn.Linear(hidden, 2))

    def forward(self, x):
        return self.net(x)


class AffineCoupling(nn.Module):
    def __init__(self):
        super().__init__()
        self.param_map = MLP()

    def inverse(self, z1, z2):
        param = self.param_map(z1)
        shift, scale_ = param[:, 0::2], param[:, 1::2]
        z2 = (z2 - shift) * torch.exp(-scale_)  # MARK-COUPLING-EXP
        return z1, z2, -torch.sum(scale_, dim=1)


class AffineCouplingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.coupling = AffineCoupling()

    def inverse(self, z):
        z1, z2 = z[:, :1], z[:, 1:]  # Split
        z1, z2, log_det = self.coupling.inverse(z1, z2)
        return torch.cat([z1, z2], 1), log_det  # Merge


class Permute(nn.Module):  # mode="swap"
    def inverse(self, z):
        return z.flip(1), torch.zeros(len(z))


class ActNorm(nn.Module):
    def __init__(self, d: int = 2):
        super().__init__()
        self.s = nn.Parameter(torch.zeros(1, d))
        self.t = nn.Parameter(torch.zeros(1, d))

    def inverse(self, z):
        z_ = (z - self.t) * torch.exp(-self.s)
        return z_, -torch.sum(self.s) * torch.ones(len(z))


class DiagGaussian(nn.Module):
    def __init__(self, d: int = 2):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(1, d))
        self.log_scale = nn.Parameter(torch.zeros(1, d))

    def log_prob(self, z):
        eps = (z - self.loc) / torch.exp(self.log_scale)
        return -0.5 * z.shape[1] * math.log(2 * math.pi) - torch.sum(self.log_scale + 0.5 * eps.pow(2), 1)


class NormalizingFlow(nn.Module):
    def __init__(self, blocks: int = 2):
        super().__init__()
        self.q0 = DiagGaussian()
        self.flows = nn.ModuleList([m for _ in range(blocks) for m in (AffineCouplingBlock(), Permute(), ActNorm())])

    def forward_kld(self, x):
        log_q = torch.zeros(len(x))
        z = x
        for i in range(len(self.flows) - 1, -1, -1):
            z, log_det = self.flows[i].inverse(z)
            log_q = log_q + log_det
        log_q = log_q + self.q0.log_prob(z)
        return -torch.mean(log_q)


def two_moons(n: int, g: torch.Generator) -> torch.Tensor:  # normflows.distributions.TwoMoons.sample
    x = torch.randn(n, 2, generator=g)
    x[:, 0] = x[:, 0] / 4 + torch.sign(x[:, 1]) * 0.6  # a stand-in with two modes
    return x
