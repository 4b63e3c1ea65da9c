"""Stale gradients (a missing ``zero_grad``) in loops with several optimizers whose losses reach
each other's parameters: an accumulation matters only when the optimizer that holds the
parameter steps on it."""

from __future__ import annotations

import torch
from torch import nn

from trainguard import Monitor


class _Actor(nn.Module):
    """cleanrl's sac_continuous_action.py Actor (vwxyzjn/cleanrl @fe8d8a0) in small: a tanh-squashed
    Gaussian policy, 3 observations, 1 action, 16 units."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc_mean, self.fc_logstd = nn.Linear(3, 16), nn.Linear(16, 1), nn.Linear(16, 1)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        return self.fc_mean(x), torch.tanh(self.fc_logstd(x)) * 3.5 - 1.5

    def get_action(self, x):
        mean, log_std = self(x)
        normal = torch.distributions.Normal(mean, log_std.exp())
        x_t = normal.rsample()
        action = torch.tanh(x_t)
        log_prob = (normal.log_prob(x_t) - torch.log(1 - action.pow(2) + 1e-6)).sum(1, keepdim=True)
        return action, log_prob


class _SoftQNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 16), nn.Linear(16, 1)

    def forward(self, x, a):
        return self.fc2(torch.relu(self.fc1(torch.cat([x, a], 1))))


def _sac(tmp_path, *, zero_q: bool = True):
    """cleanrl's SAC update (q_optimizer over qf1 and qf2; every policy_frequency=2 iterations, two
    actor updates and two entropy-temperature updates) on a fake replay buffer: the actor's loss
    runs through qf1 and qf2, whose .grad it adds to after q_optimizer stepped; q_optimizer's own
    zero_grad() clears that before qf1 and qf2 are trained again."""
    torch.manual_seed(0)
    actor, qf1, qf2 = _Actor(), _SoftQNetwork(), _SoftQNetwork()
    qf1_target, qf2_target = _SoftQNetwork(), _SoftQNetwork()
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    q_optimizer = torch.optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=1e-3)
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=3e-4)
    log_alpha = torch.zeros(1, requires_grad=True)
    a_optimizer = torch.optim.Adam([log_alpha], lr=1e-3)
    obs, actions, rewards, next_obs = torch.randn(64, 3), torch.rand(64, 1) * 2 - 1, torch.randn(64), torch.randn(64, 3)
    with Monitor(None, tmp_path / "r", every=5) as mon:
        for step in range(40):
            idx = torch.randint(0, 64, (16,))
            alpha = log_alpha.exp().item()
            with torch.no_grad():
                next_a, next_log_pi = actor.get_action(next_obs[idx])
                min_q = torch.min(qf1_target(next_obs[idx], next_a), qf2_target(next_obs[idx], next_a)) - alpha * next_log_pi
                target = rewards[idx] + 0.99 * min_q.view(-1)
            qf_loss = (nn.functional.mse_loss(qf1(obs[idx], actions[idx]).view(-1), target)
                       + nn.functional.mse_loss(qf2(obs[idx], actions[idx]).view(-1), target))
            if zero_q:
                q_optimizer.zero_grad()
            qf_loss.backward()
            q_optimizer.step()
            if step % 2 == 0:
                for _ in range(2):
                    pi, log_pi = actor.get_action(obs[idx])
                    min_q_pi = torch.min(qf1(obs[idx], pi), qf2(obs[idx], pi))
                    actor_loss = (alpha * log_pi - min_q_pi).mean()
                    actor_optimizer.zero_grad()
                    actor_loss.backward()
                    actor_optimizer.step()
                    with torch.no_grad():
                        _, log_pi = actor.get_action(obs[idx])
                    alpha_loss = (-log_alpha.exp() * (log_pi + 1.0)).mean()
                    a_optimizer.zero_grad()
                    alpha_loss.backward()
                    a_optimizer.step()
                    alpha = log_alpha.exp().item()
            with torch.no_grad():
                for p, tp in zip(list(qf1.parameters()) + list(qf2.parameters()),
                                 list(qf1_target.parameters()) + list(qf2_target.parameters())):
                    tp.data.copy_(0.005 * p.data + 0.995 * tp.data)
    return mon.findings


def test_a_critics_gradient_the_actors_loss_adds_to_and_nothing_applies_is_not_stale(tmp_path):
    # cleanrl's sac_continuous_action.py on Pendulum-v1 under `trainguard monitor` (199 env steps,
    # learning_starts 40): an ERROR "Gradients accumulate across steps: at 15 of 15 recordings the
    # new gradient was added to the previous step's", stale_fraction 0.6 (qf1's and qf2's 12 of 20
    # parameters), "call optimizer.zero_grad() once per step". Every optimizer there zeroes its
    # gradients before its backward; the actor's loss adds to the critics' .grad after q_optimizer
    # stepped, and q_optimizer.zero_grad() clears that before the critics' next update.
    findings = _sac(tmp_path)
    assert "gradients_accumulating" not in {f.kind for f in findings}, [(f.kind, f.title) for f in findings]


def test_the_same_loop_without_the_critics_zero_grad_is_still_told(tmp_path):
    # q_optimizer steps on the critics' gradients of every earlier update, the actor's added in
    findings = _sac(tmp_path, zero_q=False)
    found = [f for f in findings if f.kind == "gradients_accumulating"]
    assert found, [(f.kind, f.title) for f in findings]


def _gan(tmp_path, *, zero_d: bool = True):
    """eriklindernoren/PyTorch-GAN implementations/dcgan/dcgan.py (@36d3c77)'s loop in small: the
    generator's step first (its loss runs through the discriminator, adding to the discriminator's
    .grad after optimizer_D stepped), then the discriminator's on real images and detached fakes."""
    torch.manual_seed(0)
    # the generator holds most of the parameters (10 of 14 here, 14 of 22 in dcgan.py at 16x16)
    generator = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.LeakyReLU(0.2), nn.Linear(16, 16),
                              nn.BatchNorm1d(16), nn.LeakyReLU(0.2), nn.Linear(16, 8), nn.Tanh())
    discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
    adversarial_loss = nn.BCELoss()
    optimizer_G = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizer_D = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    real = torch.randn(256, 8).tanh()
    with Monitor(None, tmp_path / "r", every=5) as mon:
        for i in range(30):
            imgs = real[(i * 16) % 256:(i * 16) % 256 + 16]
            valid, fake = torch.ones(16, 1), torch.zeros(16, 1)
            optimizer_G.zero_grad()
            gen_imgs = generator(torch.randn(16, 4))
            g_loss = adversarial_loss(discriminator(gen_imgs), valid)
            g_loss.backward()
            optimizer_G.step()
            if zero_d:
                optimizer_D.zero_grad()
            d_loss = (adversarial_loss(discriminator(imgs), valid)
                      + adversarial_loss(discriminator(gen_imgs.detach()), fake)) / 2
            d_loss.backward()
            optimizer_D.step()
    return mon.findings


def test_a_gans_discriminator_gradient_the_generators_loss_adds_to_is_not_stale(tmp_path):
    findings = _gan(tmp_path)
    assert "gradients_accumulating" not in {f.kind for f in findings}, [(f.kind, f.title) for f in findings]


def test_a_gan_without_the_discriminators_zero_grad_is_told(tmp_path):
    # PyTorch-GAN's dcgan.py with `optimizer_D.zero_grad()` left out (the monitor measured all 8 of the
    # discriminator's parameters stale at every recording after the first, the gradient norm 300x
    # the healthy loop's) was "Training looks healthy": the rule did not judge a loop whose steps
    # sum a GAN's two losses at all, and 8 stale parameters of 22 are under its stale_fraction.
    findings = _gan(tmp_path, zero_d=False)
    found = [f for f in findings if f.kind == "gradients_accumulating"]
    assert found, [(f.kind, f.title) for f in findings]
    # both optimizers are Adams: the finding names the model whose gradients pile up
    assert found[0].evidence["model"] == "discriminator", found[0].title
    assert found[0].evidence["parameters"] == [f"discriminator.{i}.{w}" for i in (0, 2) for w in ("weight", "bias")]
    assert "optimizer of discriminator" in found[0].suggestion, found[0].suggestion
