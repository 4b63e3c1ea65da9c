"""Parameter rules on real monitored loops: which parameters a finding is about, and its fix."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import trainguard as tg


class TinyGPTBlock(nn.Module):
    # Derived from karpathy/llm.c train_gpt2.py (GPT: embedding, LayerNorm, MLP, tied lm_head).
    def __init__(self, vocab: int = 23, n_embd: int = 16):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.ln = nn.LayerNorm(n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets):
        x = self.wte(idx)
        x = x + self.c_proj(F.gelu(self.c_fc(self.ln(x))))
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _monitored_run(path, *, zero_grad: bool) -> list:
    torch.manual_seed(0)
    model = TinyGPTBlock()
    # llm.c's configure_optimizers with its second group (biases and LayerNorm weights, dim < 2)
    # left out: those parameters get gradients that optimizer.zero_grad() never clears.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}], lr=3e-3, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(1)
    with tg.Monitor(model, path, every=5) as mon:
        for _ in range(30):
            if zero_grad:
                opt.zero_grad(set_to_none=True)
            idx = torch.randint(0, 23, (4, 8), generator=g)
            model(idx, idx.roll(-1, dims=1)).backward()
            opt.step()
    return [f for f in mon.findings if f.is_problem]


def test_gradients_of_params_in_no_optimizer_are_not_called_a_missing_zero_grad(tmp_path):
    findings = {f.kind: f for f in _monitored_run(tmp_path / "r", zero_grad=True)}
    # The loop calls optimizer.zero_grad(): the stale gradients are those of the parameters the
    # optimizer does not hold, which param_not_in_optimizer names with the right fix.
    assert "gradients_accumulating" not in findings
    assert set(findings["param_not_in_optimizer"].evidence["params"]) == {
        "ln.weight", "ln.bias", "c_fc.bias", "c_proj.bias", "ln_f.weight", "ln_f.bias"}


def test_a_missing_zero_grad_is_still_found_beside_params_in_no_optimizer(tmp_path):
    kinds = {f.kind for f in _monitored_run(tmp_path / "r", zero_grad=False)}
    assert {"gradients_accumulating", "param_not_in_optimizer"} <= kinds


def _wgan_gp(path) -> list:
    """eriklindernoren/PyTorch-GAN implementations/wgan_gp/wgan_gp.py (@36d3c77) in small: an MLP
    generator and critic on 8 features, the gradient penalty through autograd.grad(create_graph=True),
    the generator trained every n_critic=5 iterations."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 8), nn.Tanh())
    discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    optimizer_G = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizer_D = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    real = torch.randn(256, 8).tanh()

    def compute_gradient_penalty(D, real_samples, fake_samples):
        alpha = torch.rand(real_samples.size(0), 1)
        interpolates = (alpha * real_samples + ((1 - alpha) * fake_samples)).requires_grad_(True)
        d_interpolates = D(interpolates)
        gradients = torch.autograd.grad(outputs=d_interpolates, inputs=interpolates,
                                        grad_outputs=torch.ones(real_samples.shape[0], 1),
                                        create_graph=True, retain_graph=True, only_inputs=True)[0]
        return ((gradients.norm(2, dim=1) - 1) ** 2).mean()

    with tg.Monitor(None, path, every=5) as mon:
        for i in range(40):
            real_imgs = real[(i * 16) % 256:(i * 16) % 256 + 16]
            optimizer_D.zero_grad()
            z = torch.randn(16, 4)
            fake_imgs = generator(z)
            real_validity = discriminator(real_imgs)
            fake_validity = discriminator(fake_imgs)
            gradient_penalty = compute_gradient_penalty(discriminator, real_imgs.data, fake_imgs.data)
            d_loss = -torch.mean(real_validity) + torch.mean(fake_validity) + 10 * gradient_penalty
            d_loss.backward()
            optimizer_D.step()
            optimizer_G.zero_grad()
            if i % 5 == 0:
                g_loss = -torch.mean(discriminator(generator(z)))
                g_loss.backward()
                optimizer_G.step()
    return mon.findings


def test_a_wgan_critics_output_bias_is_no_broken_path(tmp_path):
    # PyTorch-GAN's wgan_gp.py under `trainguard run --monitor` got a WARNING "1 parameter(s) always get
    # an all-zero gradient: discriminator.model.2.bias ... the loss does not depend on them; remove them
    # or fix the path to the loss". The critic's loss -D(real).mean() + D(fake).mean() + penalty depends on
    # differences of its outputs only: its output bias cancels, by design of the loss, while the weight
    # of the same layer learns. That is a note, not a warning on a healthy run.
    findings = _wgan_gp(tmp_path / "r")
    problems = [(f.kind, f.title) for f in findings if f.is_problem]
    assert not problems, problems
    (note,) = [f for f in findings if f.kind == "param_zero_gradient"]
    assert note.severity == "info" and note.evidence["params"] == ["discriminator.2.bias"], note.title
    assert "bias=False" in note.suggestion, note.suggestion


def test_a_generator_trained_on_detached_fakes_is_named(tmp_path):
    # PyTorch-GAN's dcgan.py (@36d3c77) with `discriminator(gen_imgs.detach())` in the generator's loss:
    # "14 trainable parameter(s) never received a gradient: l1.0.weight, ..." named the layers but not
    # that they are the whole generator (the first model found has no prefix), nor the GAN's usual cause.
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.LeakyReLU(0.2), nn.Linear(16, 8), nn.Tanh())
    discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
    adversarial_loss = nn.BCELoss()
    optimizer_G = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizer_D = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    real = torch.randn(256, 8).tanh()
    with tg.Monitor(None, tmp_path / "r", every=5) as mon:
        for i in range(30):
            imgs = real[(i * 16) % 256:(i * 16) % 256 + 16]
            valid, fake = torch.ones(16, 1), torch.zeros(16, 1)
            optimizer_G.zero_grad()
            gen_imgs = generator(torch.randn(16, 4))
            g_loss = adversarial_loss(discriminator(gen_imgs.detach()), valid)
            g_loss.backward()
            optimizer_G.step()
            optimizer_D.zero_grad()
            d_loss = (adversarial_loss(discriminator(imgs), valid)
                      + adversarial_loss(discriminator(gen_imgs.detach()), fake)) / 2
            d_loss.backward()
            optimizer_D.step()
    (f,) = [f for f in mon.findings if f.kind == "param_no_gradient"]
    assert f.evidence["params"] == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"], f.evidence
    assert f.evidence.get("model") == "generator" and "model generator (Sequential)" in f.title, f.title
    assert "fake.detach()" in f.suggestion, f.suggestion
