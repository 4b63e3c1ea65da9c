"""The monitor on MAML: an inner loop of ``torch.autograd.grad`` with fast weights, then one meta-update.

Derived from dragen1860/MAML-Pytorch (``learner.py``, ``meta.py``): the ``Learner`` keeps its weights
in an ``nn.ParameterList`` ``vars``, runs ``forward(x, vars=None)`` with ``F.linear`` on whichever
list it is given (the meta-parameters or the adapted fast weights, which are no parameters), and
overrides ``parameters()`` to return that list (no ``recurse`` argument); ``Meta.forward`` adapts a
copy per task with ``torch.autograd.grad`` (``create_graph=True`` for second-order MAML), then calls
``meta_optim.zero_grad()``, ``backward()`` on the query loss and ``meta_optim.step()``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainguard import Monitor
from trainguard.store import open_run


class Learner(nn.Module):
    def __init__(self, n_in: int = 6, hidden: int = 16, n_way: int = 3):
        super().__init__()
        self.vars = nn.ParameterList()
        for out, inp in ((hidden, n_in), (n_way, hidden)):
            w = nn.Parameter(torch.ones(out, inp))
            nn.init.kaiming_normal_(w)
            self.vars.append(w)
            self.vars.append(nn.Parameter(torch.zeros(out)))

    def forward(self, x, vars=None):
        if vars is None:
            vars = self.vars
        x = F.relu(F.linear(x, vars[0], vars[1]))
        return F.linear(x, vars[2], vars[3])

    def parameters(self):  # MAML-Pytorch's override: the list itself, no ``recurse``
        return self.vars


class Meta(nn.Module):
    def __init__(self, second_order: bool, forget_zero_grad: bool = False):
        super().__init__()
        self.net = Learner()
        self.meta_optim = torch.optim.Adam(self.net.parameters(), lr=1e-3)
        self.second_order = second_order
        self.forget_zero_grad = forget_zero_grad

    def forward(self, x_spt, y_spt, x_qry, y_qry, update_lr=0.4, update_step=2):
        loss_q = 0
        for i in range(x_spt.shape[0]):
            fast = list(self.net.parameters())
            for _ in range(update_step):
                loss = F.cross_entropy(self.net(x_spt[i], fast), y_spt[i])
                grad = torch.autograd.grad(loss, fast, create_graph=self.second_order)
                fast = [w - update_lr * g for g, w in zip(grad, fast)]
            loss_q = loss_q + F.cross_entropy(self.net(x_qry[i], fast), y_qry[i])
        loss_q = loss_q / x_spt.shape[0]
        if not self.forget_zero_grad:
            self.meta_optim.zero_grad()
        loss_q.backward()
        self.meta_optim.step()
        return loss_q.item()


def tasks(step: int, n_tasks: int = 2, n_way: int = 3, shots: int = 2):
    g = torch.Generator().manual_seed(step)
    protos = torch.randn(n_tasks, n_way, 6, generator=g)
    y = torch.arange(n_way).repeat(shots)
    x_spt = protos[:, y] + 0.3 * torch.randn(n_tasks, len(y), 6, generator=g)
    x_qry = protos[:, y] + 0.3 * torch.randn(n_tasks, len(y), 6, generator=g)
    return x_spt, y.expand(n_tasks, -1), x_qry, y.expand(n_tasks, -1)


def train(meta: Meta, logdir, steps: int = 8, watched=None):
    with Monitor(watched, logdir, every=2) as mon:
        for step in range(steps):
            meta(*tasks(step))
    return mon


@pytest.mark.parametrize("watched", ["found", "given"])
def test_a_learner_whose_parameters_takes_no_recurse_is_watched_by_its_state_dict_names(tmp_path, watched):
    torch.manual_seed(0)
    meta = Meta(second_order=True)
    train(meta, tmp_path / "r", watched=None if watched == "found" else meta)
    with open_run(tmp_path / "r") as run:
        assert run.meta["monitor"]["status"] == "finished"
        grads = {r["layer"] for r in run.layer_stats(kind="gradient", stat="norm")}
        assert len(run.scalars("loss")["loss"]) == 8
    names = set(meta.state_dict())
    assert grads == names == {"net.vars.0", "net.vars.1", "net.vars.2", "net.vars.3"}


@pytest.mark.parametrize("second_order", [False, True])
def test_inner_loop_gradients_are_not_gradients_left_from_the_previous_step(tmp_path, second_order):
    # autograd.grad hands the fast weights' gradients back without touching .grad: the previous
    # step's .grad, still there until Meta zeroes it just before backward(), is no accumulation
    torch.manual_seed(0)
    mon = train(Meta(second_order=second_order), tmp_path / "r")
    with open_run(tmp_path / "r") as run:
        stale = {r["value"] for r in run.layer_stats(kind="gradient", stat="stale")}
    assert stale == {0.0}
    assert "gradients_accumulating" not in {f.kind for f in mon.findings}, [f.title for f in mon.findings]


def test_a_meta_loop_that_never_zeroes_its_gradients_is_still_told(tmp_path):
    torch.manual_seed(0)
    mon = train(Meta(second_order=True, forget_zero_grad=True), tmp_path / "r")
    assert "gradients_accumulating" in {f.kind for f in mon.findings}, [f.title for f in mon.findings]


# learn2learn's MAML (learn2learn/algorithms/maml.py, learn2learn/utils clone_module/update_module),
# cut to what the monitor sees: ``clone()`` makes a module per task whose ``__dict__`` is a shallow
# copy of the original's (the hook dicts are the same objects) and whose parameters are ``clone()``s
# of the originals; ``adapt()`` puts ``p - lr * grad`` (non-leaf tensors) in their place.
def clone_module(module: nn.Module) -> nn.Module:
    clone = module.__new__(type(module))
    clone.__dict__ = module.__dict__.copy()
    clone._parameters = {k: (p.clone() if p is not None else None) for k, p in module._parameters.items()}
    clone._buffers = clone._buffers.copy()
    clone._modules = {k: clone_module(m) for k, m in module._modules.items()}
    return clone


def update_module(module: nn.Module, updates: dict) -> None:
    for name, m in module.named_modules():
        for k, p in list(m._parameters.items()):
            key = f"{name}.{k}" if name else k
            if key in updates:
                m._parameters[k] = p + updates[key]


class L2LMAML(nn.Module):
    def __init__(self, module: nn.Module, lr: float):
        super().__init__()
        self.module, self.lr = module, lr

    def forward(self, x):
        return self.module(x)

    def clone(self) -> L2LMAML:
        return clone_module(self)

    def adapt(self, loss):
        names = [n for n, _ in self.module.named_parameters()]
        grads = torch.autograd.grad(loss, list(self.module.parameters()), create_graph=True)
        update_module(self.module, {n: -self.lr * g for n, g in zip(names, grads)})


def test_learn2learn_clones_are_the_model_they_copy_not_a_new_model_per_task(tmp_path):
    torch.manual_seed(0)
    maml = L2LMAML(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)), lr=0.1)
    opt = torch.optim.Adam(maml.parameters(), 1e-3)
    with Monitor(None, tmp_path / "r", every=2) as mon:
        for step in range(8):
            x_spt, y_spt, x_qry, y_qry = tasks(step)
            opt.zero_grad()
            for i in range(2):
                learner = maml.clone()
                learner.adapt(F.cross_entropy(learner(x_spt[i]), y_spt[i]))
                F.cross_entropy(learner(x_qry[i]), y_qry[i]).backward()
            opt.step()
    with open_run(tmp_path / "r") as run:
        layers = set(run.layers())
        grads = {r["layer"] for r in run.layer_stats(kind="gradient", stat="norm")}
        acts = {r["layer"] for r in run.layer_stats(kind="activation", stat="mean")}
    # 16 clones made, none of them a model: the layers and parameters are the watched model's own
    assert grads == {"module.0.weight", "module.0.bias", "module.2.weight", "module.2.bias"}
    assert acts == {"module.0", "module.1", "module.2"}
    assert layers == acts | grads | {"<input>"}, sorted(layers)
    assert "models_in_sequence" not in {f.kind for f in mon.findings}
