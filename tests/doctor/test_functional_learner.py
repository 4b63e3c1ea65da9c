"""The doctor on a model that keeps its weights in ParameterLists and overrides ``parameters()``.

Derived from dragen1860/MAML-Pytorch's ``Learner`` (learner.py): ``forward(x, vars=None,
bn_training=True)`` runs ``F.conv2d``/``F.batch_norm``/``F.linear`` on ``self.vars`` (or on the fast
weights given), the batch-norm running statistics are ``nn.Parameter(requires_grad=False)`` in a
second list ``vars_bn``, and ``parameters()`` returns ``self.vars`` alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainguard import doctor


class Learner(nn.Module):
    def __init__(self):
        super().__init__()
        self.vars = nn.ParameterList()
        self.vars_bn = nn.ParameterList()
        w = nn.Parameter(torch.ones(4, 1, 3, 3))
        nn.init.kaiming_normal_(w)
        self.vars.extend([w, nn.Parameter(torch.zeros(4))])
        self.vars.extend([nn.Parameter(torch.ones(4)), nn.Parameter(torch.zeros(4))])  # bn weight, bias
        self.vars_bn.extend([nn.Parameter(torch.zeros(4), requires_grad=False),
                             nn.Parameter(torch.ones(4), requires_grad=False)])
        w = nn.Parameter(torch.ones(3, 4 * 3 * 3))
        nn.init.kaiming_normal_(w)
        self.vars.extend([w, nn.Parameter(torch.zeros(3))])

    def forward(self, x, vars=None, bn_training=True):
        vars = self.vars if vars is None else vars
        x = F.relu(F.conv2d(x, vars[0], vars[1], stride=2))
        x = F.batch_norm(x, self.vars_bn[0], self.vars_bn[1], weight=vars[2], bias=vars[3], training=bn_training)
        return F.linear(x.view(x.size(0), -1), vars[4], vars[5])

    def parameters(self):
        return self.vars


@pytest.fixture
def setup():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    y = torch.arange(3).repeat(8)
    x = torch.rand(3, 1, 7, 7, generator=g)[y] + 0.3 * torch.randn(len(y), 1, 7, 7, generator=g)
    return Learner(), (x, y)


def test_the_gradient_check_runs_a_learner_whose_running_statistics_parameters_list_omits(setup):
    model, batch = setup
    result = doctor.gradient_check(model, batch, F.cross_entropy, samples_per_param=2)
    assert {p.name for p in result.params} == {f"vars.{i}" for i in range(6)}
    assert result.bad_params == []


@pytest.mark.parametrize("check", ["overfit", "gradient_check", "lr_range"])
def test_running_statistics_held_as_frozen_parameters_are_put_back(setup, check):
    model, batch = setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if check == "overfit":
        doctor.overfit_one_batch(model, batch, F.cross_entropy, steps=5)
    elif check == "gradient_check":
        doctor.gradient_check(model, batch, F.cross_entropy, samples_per_param=2)
    else:
        doctor.lr_range_test(model, [batch] * 5, F.cross_entropy, steps=5)
    after = model.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k]) or before[k].dtype != after[k].dtype]
    assert changed == [], changed
