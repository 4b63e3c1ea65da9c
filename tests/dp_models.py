"""Stand-ins for opacus' wrappers, derived from pytorch/opacus 1.6 (Apache 2.0), without opacus.

``PrivacyEngine.make_private`` wraps the model in a ``GradSampleModule`` (per-sample gradients
through its own hooks; ``grad_sample_mode="ghost"`` a ``GradSampleModuleFastGradientClipping``,
``"ew"`` a ``GradSampleModuleExpandedWeights``), each an ``AbstractGradSampleModule`` that holds
the model as ``_module`` and calls it in ``forward``: its ``state_dict`` names every key
``_module.<key>``. ``SampleConvNet`` is opacus' examples/mnist.py model.
"""

from __future__ import annotations

from torch import nn
from torch.nn import functional as F


class AbstractGradSampleModule(nn.Module):
    def __init__(self, m: nn.Module):
        super().__init__()
        self._module = m

    def forward(self, *args, **kwargs):
        return self._module(*args, **kwargs)


class GradSampleModule(AbstractGradSampleModule):
    pass


class GradSampleModuleFastGradientClipping(GradSampleModule):
    pass


class SampleConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))  # -> [B, 16, 14, 14]
        x = F.max_pool2d(x, 2, 1)  # -> [B, 16, 13, 13]
        x = F.relu(self.conv2(x))  # -> [B, 32, 5, 5]
        x = F.max_pool2d(x, 2, 1)  # -> [B, 32, 4, 4]
        x = x.view(-1, 32 * 4 * 4)  # -> [B, 512]
        x = F.relu(self.fc1(x))  # -> [B, 32]
        return self.fc2(x)  # -> [B, 10]


class DPTensorFastGradientClipping:
    """opacus' ghost clipping loss (``grad_sample_mode="ghost"``: make_private returns a criterion
    whose loss is this object). Its ``item()`` is the mean of the per-sample losses; ``backward()``
    runs two passes: the loss itself, then, after ``zero_grad``, the per-sample losses weighted by
    their clipping coefficients (here a stand-in for the per-sample gradient norms' coefficients)."""

    def __init__(self, optimizer, loss_per_sample):
        self.optimizer = optimizer
        self.loss_per_sample = loss_per_sample

    def item(self):
        return self.loss_per_sample.detach().mean().item()

    def backward(self):
        reduced_loss = self.loss_per_sample.mean(dim=0)
        reduced_loss.backward(retain_graph=True)
        self.optimizer.zero_grad()
        coeff = (1.0 / self.loss_per_sample.detach().clamp(min=1e-6)).clamp(max=1.0)
        second_loss_per_sample = coeff * self.loss_per_sample
        second_loss = second_loss_per_sample.sum()
        second_loss.backward()
