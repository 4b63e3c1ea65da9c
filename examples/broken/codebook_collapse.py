"""Broken: a VQ-VAE whose codebook starts far larger than the encoder's outputs: every position gets
the code nearest to 0, and the decoder sees one input whatever the image.

The quantizer is zalandoresearch/pytorch-vq-vae's ``VectorQuantizer`` (no parameters of its own: it
computes with ``self._embedding.weight``), its codes initialised with ``normal_()`` as the notebook's
EMA variant does, against encoder outputs of RMS ~0.1. About 2 of the 32 codes are used.
Expected finding: ``codebook_collapse`` (fix: codes from the inputs, k-means init, dead-code reset).
"""

import torch
import torch.nn.functional as F
from _common import log, parse_args
from torch import nn


class VectorQuantizer(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, commitment_cost=0.25):
        super().__init__()
        self._embedding = nn.Embedding(num_embeddings, embedding_dim)
        self._embedding.weight.data.normal_()  # the fault: codes of RMS 1 for inputs of RMS ~0.1
        self._d, self._commitment_cost = embedding_dim, commitment_cost

    def forward(self, inputs):
        inputs = inputs.permute(0, 2, 3, 1).contiguous()
        flat = inputs.view(-1, self._d)
        w = self._embedding.weight
        distances = flat.pow(2).sum(1, keepdim=True) + w.pow(2).sum(1) - 2 * flat @ w.t()
        encodings = F.one_hot(distances.argmin(1), w.shape[0]).float()
        quantized = (encodings @ w).view(inputs.shape)
        loss = F.mse_loss(quantized, inputs.detach()) + self._commitment_cost * F.mse_loss(quantized.detach(), inputs)
        quantized = inputs + (quantized - inputs).detach()  # straight-through estimator
        return loss, quantized.permute(0, 3, 1, 2).contiguous()


class VQVAE(nn.Module):
    def __init__(self, codes=32, dim=4):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(1, 16, 4, 2, 1), nn.ReLU(), nn.Conv2d(16, dim, 1))
        self.vq = VectorQuantizer(codes, dim)
        self.decoder = nn.Sequential(nn.Conv2d(dim, 16, 3, 1, 1), nn.ReLU(), nn.ConvTranspose2d(16, 1, 4, 2, 1))

    def forward(self, x):
        vq_loss, q = self.vq(self.encoder(x))
        return vq_loss, self.decoder(q)


def images(n, gen):
    """Smooth random 16x16 images in [-1, 1]."""
    return F.interpolate(torch.randn(n, 1, 4, 4, generator=gen), size=16, mode="bilinear").tanh()


def main(argv=None):
    args = parse_args(40, argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = VQVAE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        x = images(32, gen)
        vq_loss, recon = model(x)
        loss = F.mse_loss(recon, x) + vq_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        log(args, step, loss.item())


if __name__ == "__main__":
    main()
