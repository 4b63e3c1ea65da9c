"""The monitor on vector-quantised autoencoders written as tutorials write them (zalandoresearch/
pytorch-vq-vae): a model that replaces its own Parameter objects while training
(``module.weight = nn.Parameter(...)``) is watched as it is now, not as it was attached; a quantizer
that returns ``(loss, quantized)`` is measured by its quantized output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainguard import Monitor
from trainguard.store import open_run


class _VectorQuantizerEMA(nn.Module):
    """zalandoresearch/pytorch-vq-vae (vq-vae.ipynb, VectorQuantizerEMA), shortened: the codebook is
    an ``nn.Embedding`` whose weight, and the running sum ``_ema_w``, are assigned a new
    ``nn.Parameter`` by every training forward (EMA updates, no gradient by design); the
    straight-through estimator ``inputs + (quantized - inputs).detach()`` passes the gradient on."""

    def __init__(self, num_embeddings, embedding_dim, commitment_cost=0.25, decay=0.9, epsilon=1e-5):
        super().__init__()
        self._embedding = nn.Embedding(num_embeddings, embedding_dim)
        self._embedding.weight.data.normal_()
        self.register_buffer("_ema_cluster_size", torch.zeros(num_embeddings))
        self._ema_w = nn.Parameter(torch.Tensor(num_embeddings, embedding_dim))
        self._ema_w.data.normal_()
        self._n, self._d = num_embeddings, embedding_dim
        self._commitment_cost, self._decay, self._epsilon = commitment_cost, decay, epsilon

    def forward(self, inputs):
        inputs = inputs.permute(0, 2, 3, 1).contiguous()
        flat_input = inputs.view(-1, self._d)
        distances = (torch.sum(flat_input**2, dim=1, keepdim=True) + torch.sum(self._embedding.weight**2, dim=1)
                     - 2 * torch.matmul(flat_input, self._embedding.weight.t()))
        encodings = F.one_hot(torch.argmin(distances, dim=1), self._n).float()
        quantized = torch.matmul(encodings, self._embedding.weight).view(inputs.shape)
        if self.training:
            self._ema_cluster_size = self._ema_cluster_size * self._decay + (1 - self._decay) * encodings.sum(0)
            n = torch.sum(self._ema_cluster_size.data)
            self._ema_cluster_size = (self._ema_cluster_size + self._epsilon) / (n + self._n * self._epsilon) * n
            dw = torch.matmul(encodings.t(), flat_input)
            self._ema_w = nn.Parameter(self._ema_w * self._decay + (1 - self._decay) * dw)
            self._embedding.weight = nn.Parameter(self._ema_w / self._ema_cluster_size.unsqueeze(1))
        loss = self._commitment_cost * F.mse_loss(quantized.detach(), inputs)
        quantized = inputs + (quantized - inputs).detach()
        return loss, quantized.permute(0, 3, 1, 2).contiguous()


class _VQVAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(1, 4, 3, padding=1)
        self.vq = _VectorQuantizerEMA(8, 4)
        self.dec = nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x):
        vq_loss, q = self.vq(self.enc(x))
        return vq_loss, self.dec(q)


def test_parameters_the_model_assigns_anew_each_step_are_watched_as_they_are_now(tmp_path):
    # The monitor held the Parameters of attach time: the optimizer's orphans, never changed, never
    # given a gradient. It reported their norm, constant (vq._embedding.weight 33.1 at every
    # recording of the notebook's model while the model's own codebook moved), and a false
    # param_no_gradient warning ("2 trainable parameter(s) never received a gradient: _vq_vae._ema_w,
    # _vq_vae._embedding.weight ... if they are frozen on purpose, set requires_grad=False") said
    # to explain the flat loss. They are a codebook the EMA moves by hand.
    torch.manual_seed(0)
    model = _VQVAE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(16, 1, 6, 6)
    with Monitor(model, tmp_path / "r", every=5) as mon:
        for step in range(25):
            vq_loss, recon = model(x)
            loss = F.mse_loss(recon, x) + vq_loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 20:  # the last recording
                last = model.vq._embedding.weight.norm().item()
    kinds = {f.kind: f for f in mon.findings}
    assert "param_no_gradient" not in kinds, [(f.kind, f.title) for f in mon.findings]
    f = kinds["model_not_trained"]
    assert f.severity == "info"
    assert set(f.evidence["updated_by_hand"]) == {"vq._ema_w", "vq._embedding.weight"}, f.evidence
    with open_run(tmp_path / "r") as run:
        params = run.meta["monitor"]["params"]
        assert "optimizer" not in params["vq._embedding.weight"], params["vq._embedding.weight"]
        assert params["enc.weight"]["optimizer"] == "Adam"
        norms = [r["value"] for r in run.layer_stats()
                 if r["layer"] == "vq._embedding.weight" and r["kind"] == "weight" and r["stat"] == "norm"]
    assert len(norms) == 5 and len(set(norms)) == 5, norms  # the codebook the model holds moves
    assert abs(norms[-1] - last) < 1e-4 * last, (norms, last)


def test_a_layer_returning_its_loss_first_is_measured_by_its_output(tmp_path):
    # The notebook's quantizers return (loss, quantized, perplexity, encodings): the layer's
    # "activation" was the 0-d commitment loss (mean 0.098, std NaN, no units), and the quantized
    # output, where a collapsed codebook shows, was never measured.
    torch.manual_seed(0)
    model = _VQVAE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(16, 1, 6, 6)
    seen = []
    model.vq.register_forward_hook(lambda m, args, out: seen.append(out[1].detach().std().item()))
    with Monitor(model, tmp_path / "r", every=5):
        for _ in range(6):
            vq_loss, recon = model(x)
            loss = F.mse_loss(recon, x) + vq_loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    with open_run(tmp_path / "r") as run:
        layer = next(la for la in run.meta["monitor"]["layers"] if la["name"] == "vq")
        stats = {(r["step"], r["stat"]): r["value"] for r in run.layer_stats(layer="vq") if r["kind"] == "activation"}
    assert layer["units"] == 4, layer  # channels of the quantized [16, 4, 6, 6]
    assert stats[(5, "std")] == pytest.approx(seen[5], rel=1e-3), (stats, seen)
