"""The monitor never changes what a model can do: save, pickle, deep-copy and trace it mid-training."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

from trainguard import Monitor


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 2))

    def forward(self, x):
        return self.body(x)


def users_hook(module, args, output):
    """A hook of the user's own: it is pickled with the model, trainguard's are not."""


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def train_step(model, opt, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 6, generator=g)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize("model_arg", ["explicit", "discovered"])
def test_save_pickle_deepcopy_while_monitoring(tmp_path, model_arg):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    user_hook = model.body[0].register_forward_hook(users_hook)  # the user's own stays
    with Monitor(model if model_arg == "explicit" else None, tmp_path / "r", every=2, diagnose=False):
        train_step(model, opt, 0)
        train_step(model, opt, 1)
        train_step(model, opt, 2)  # a recording step: layer hooks are on now
        assert hook_count(model) > 1
        buf = io.BytesIO()
        torch.save(model, buf)  # "Can't pickle local object 'Monitor._make_root_hook.<locals>.hook'" before
        dumped = pickle.dumps(model)
        twin = copy.deepcopy(model)
        state = io.BytesIO()
        torch.save(model.state_dict(), state)
    user_hook.remove()
    x = torch.randn(3, 6)
    for restored in (torch.load(io.BytesIO(buf.getvalue()), weights_only=False), pickle.loads(dumped), twin):
        assert hook_count(restored) == 1  # the user's hook, not trainguard's
        assert torch.equal(restored(x), model(x))
    # weights_only loading (torch's default) needs no trainguard global: the pickle holds none.
    with torch.serialization.safe_globals([Net, nn.Sequential, nn.Linear, nn.ReLU, users_hook]):
        plain = torch.load(io.BytesIO(buf.getvalue()))
    assert torch.equal(plain(x), model(x))
    assert b"trainguard" not in buf.getvalue() and b"trainguard" not in dumped
    loaded_state = torch.load(io.BytesIO(state.getvalue()))
    assert set(loaded_state) == set(model.state_dict())


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_jit_trace_while_monitoring_is_the_plain_trace(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 6)
    plain = torch.jit.trace(model, x)
    with Monitor(model, tmp_path / "r", every=1, diagnose=False) as mon:
        train_step(model, opt, 0)
        traced = torch.jit.trace(model, x)  # at a recording step, with every layer hooked
        train_step(model, opt, 1)
        step = mon.current_step
    def ops(t):
        return [n.kind() for n in t.inlined_graph.nodes()]

    assert ops(traced) == ops(plain) and "aten::linear" in ops(plain)
    assert torch.equal(traced(x), model(x))
    assert step == 2  # two optimizer steps; tracing ended none


def test_hooks_are_removed_and_the_pickle_reducer_restored(tmp_path):
    import copyreg
    from collections import OrderedDict

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, tmp_path / "r", every=1, diagnose=False):
        train_step(model, opt, 0)
    assert hook_count(model) == 0
    assert OrderedDict not in copyreg.dispatch_table
    assert all(not p._backward_hooks for p in model.parameters())
