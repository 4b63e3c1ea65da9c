"""Errors a NaN/Inf makes an op raise instead of giving NaN: under the guard the step is a bad
step (rewind, replay under recording, skip), and the same error on finite values (a bug in the
code) is raised unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg


class _Generator(nn.Module):
    """eriklindernoren/PyTorch-GAN implementations/dcgan/dcgan.py (@36d3c77) in small: l1, view,
    the upsampling conv blocks ending in Tanh (8x8 images, one channel, fewer filters)."""

    def __init__(self, latent=8):
        super().__init__()
        self.l1 = nn.Sequential(nn.Linear(latent, 8 * 2 * 2))
        self.conv_blocks = nn.Sequential(
            nn.BatchNorm2d(8), nn.Upsample(scale_factor=2), nn.Conv2d(8, 8, 3, stride=1, padding=1),
            nn.BatchNorm2d(8, 0.8), nn.LeakyReLU(0.2, inplace=True), nn.Upsample(scale_factor=2),
            nn.Conv2d(8, 1, 3, stride=1, padding=1), nn.Tanh())

    def forward(self, z):
        return self.conv_blocks(self.l1(z).view(z.shape[0], 8, 2, 2))


class _Discriminator(nn.Module):
    """The same file's Discriminator: strided conv blocks, then Linear + Sigmoid (BCELoss's input)."""

    def __init__(self, bad_head=False):
        super().__init__()

        def block(i, o, bn=True):
            return [nn.Conv2d(i, o, 3, 2, 1), nn.LeakyReLU(0.2, inplace=True), nn.Dropout2d(0.25)] + (
                [nn.BatchNorm2d(o, 0.8)] if bn else [])

        self.model = nn.Sequential(*block(1, 4, bn=False), *block(4, 8))
        # bad_head: a bug in the code, no Sigmoid before BCELoss (finite values outside [0, 1])
        self.adv_layer = nn.Sequential(nn.Linear(8 * 2 * 2, 1), *([] if bad_head else [nn.Sigmoid()]))

    def forward(self, img):
        return self.adv_layer(self.model(img).view(img.shape[0], -1))


def _train_dcgan(tmp_path, images, *, bad_head=False, steps=12):
    torch.manual_seed(0)
    gen, disc = _Generator(), _Discriminator(bad_head)
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-4, betas=(0.5, 0.999))
    state = tg.TrainState(generator=gen, discriminator=disc, optimizer_G=opt_g, optimizer_D=opt_d,
                          loader=DataLoader(TensorDataset(images), batch_size=8, shuffle=True))
    adversarial_loss = nn.BCELoss()
    guard = tg.Guard(tmp_path / "run", snapshot_every=5)
    for _, (imgs,) in guard.batches(state, total_steps=steps):
        valid, fake = torch.ones(imgs.shape[0], 1), torch.zeros(imgs.shape[0], 1)
        opt_g.zero_grad()
        gen_imgs = gen(torch.randn(imgs.shape[0], 8))
        g_loss = adversarial_loss(disc(gen_imgs), valid)
        g_loss.backward()
        opt_g.step()
        opt_d.zero_grad()
        real_loss = adversarial_loss(disc(imgs), valid)  # marker: real_loss
        fake_loss = adversarial_loss(disc(gen_imgs.detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        d_loss.backward()
        opt_d.step()
    return guard, state


def test_nan_reaching_bceloss_is_a_bad_step_not_a_crash(tmp_path):
    # BCELoss raised "all elements of input should be between 0 and 1" on the NaN the discriminator
    # made of a NaN image, before the sentry saw any loss: the guard could not rewind, the run crashed.
    images = torch.rand(64, 1, 8, 8) * 2 - 1
    images[37, 0, 3, 3] = float("nan")
    guard, state = _train_dcgan(tmp_path, images)
    assert state.step == 12
    assert guard.events and guard.events[0]["action"] == "skip", [e["message"] for e in guard.events]
    event = guard.events[0]
    assert event["batch_nonfinite"]["samples"] == [37], event["batch_nonfinite"]
    assert event["replay"]["reproduced"] is True
    assert "binary_cross_entropy" in event["raised"]["op"], event.get("raised")
    assert "between 0 and 1" in event["raised"]["error"]
    assert "aten.binary_cross_entropy raised on NaN/Inf" in event["message"], event["message"]
    for m in state.discriminator.parameters():
        assert torch.isfinite(m).all()


def test_bceloss_on_finite_values_out_of_range_still_raises(tmp_path):
    # No Sigmoid before BCELoss: a bug in the code, not a bad value. It must crash as without the guard.
    images = torch.rand(64, 1, 8, 8) * 2 - 1
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        _train_dcgan(tmp_path, images, bad_head=True, steps=3)


class _Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 3)

    def forward(self, x):
        return self.net(torch.log(x))  # marker: log  (a negative feature makes NaN logits)


@pytest.mark.parametrize("how", ["distribution", "multinomial", "cholesky"])
def test_nan_made_by_an_op_raising_later_is_traced_to_that_op(tmp_path, how):
    # torch.distributions' validate_args ("Expected parameter logits ... found invalid values"),
    # multinomial ("probability tensor contains either inf, nan or element < 0") and
    # linalg.cholesky (not positive-definite) raised on NaN made inside the step by aten.log.
    torch.manual_seed(0)
    x = torch.rand(48, 4) + 0.5
    x[21, 2] = -1.0  # finite, but log() makes NaN of it
    model = _Policy()
    state = tg.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                          loader=DataLoader(TensorDataset(x), batch_size=8))
    guard = tg.Guard(tmp_path / "run", snapshot_every=4)
    for _, (batch,) in guard.batches(state, total_steps=6):
        logits = model(batch)
        if how == "distribution":
            dist = torch.distributions.Categorical(logits=logits)
            loss = -dist.log_prob(torch.zeros(len(batch), dtype=torch.long)).mean()
        elif how == "multinomial":
            probs = logits.softmax(-1)
            picked = torch.multinomial(probs, 1)
            loss = -probs.gather(1, picked).log().mean()
        else:
            a = logits.T @ logits + torch.eye(3)
            loss = torch.linalg.cholesky(a).diagonal().log().sum()
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
    assert state.step == 6
    assert [e["action"] for e in guard.events] == ["skip"], [e["message"] for e in guard.events]
    origin = guard.events[0]["origin"]["origin"]
    assert origin["op"] == "aten.log", origin
    assert all(torch.isfinite(p).all() for p in model.parameters())
