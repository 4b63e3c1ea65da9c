"""The monitor on TorchRL's loss modules, without torchrl (CI does not install it).

Derived from pytorch/rl sota-implementations/dqn/dqn_cartpole.py (torchrl 0.14): ``DQNLoss(value_network=
model, delay_value=True)`` keeps the Q network out of its submodules and holds its parameters in a
``tensordict.nn.TensorDictParams`` (``value_network_params``: the network's own ``Parameter``
objects) and a copy as buffers (``target_value_network_params``); ``forward`` runs the network with
those swapped in (``functional_call`` here, ``TensorDictParams.to_module`` there). The collector runs
the policy itself, under ``no_grad``, at the top level. ``TensorDictParams`` is an ``nn.Module`` and
a ``TensorDict``: its ``==`` is elementwise and the truth value of the result raises.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

import trainguard as tg
from trainguard import Monitor
from trainguard.store import open_run


class _Elementwise:
    def __bool__(self):
        raise RuntimeError("Converting a tensordict to boolean value is not permitted")


class ParamsHolder(nn.Module):
    """tensordict.nn.TensorDictParams: the network's Parameters (or detached copies as buffers)."""

    def __init__(self, net: nn.Module, target: bool):
        super().__init__()
        self.names = [n for n, _ in net.named_parameters()]
        for i, (_, p) in enumerate(net.named_parameters()):
            if target:
                self.register_buffer(f"p{i}", p.detach().clone())
            else:
                self.register_parameter(f"p{i}", p)

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, f"p{i}") for i, n in enumerate(self.names)}

    def __eq__(self, other):
        return _Elementwise()

    def __hash__(self):
        return id(self)


class DQNLoss(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.__dict__["value_network"] = net  # not a submodule
        self.value_network_params = ParamsHolder(net, target=False)
        self.target_value_network_params = ParamsHolder(net, target=True)

    def forward(self, obs, action, reward, next_obs):
        q = functional_call(self.value_network, self.value_network_params.as_dict(), (obs,))
        q = q.gather(1, action).squeeze(1)
        with torch.no_grad():
            next_q = functional_call(self.value_network, self.target_value_network_params.as_dict(), (next_obs,))
            target = reward + 0.99 * next_q.max(1).values
        return ((q - target) ** 2).mean()


def _train(logdir, steps: int = 12, every: int = 2) -> tuple[Monitor, nn.Module, list[float]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    loss_module = DQNLoss(net)
    opt = torch.optim.Adam(loss_module.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    norms = []
    with Monitor(None, logdir, every=every) as mon:
        for _ in range(steps):
            with torch.no_grad():  # the collector
                net(torch.randn(8, 4, generator=g)).argmax(1)
            obs, next_obs = torch.randn(32, 4, generator=g), torch.randn(32, 4, generator=g)
            action, reward = torch.randint(0, 2, (32, 1), generator=g), torch.randn(32, generator=g)
            loss = loss_module(obs, action, reward, next_obs)
            opt.zero_grad()
            loss.backward()
            norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()])).item())
            opt.step()
    return mon, net, norms


def test_a_loss_module_holding_tensordict_params_is_watched_without_raising(tmp_path):
    _train(tmp_path / "r")
    run = open_run(tmp_path / "r")
    assert [s for s, _ in run.scalars("grad_norm")["grad_norm"]] == list(range(12))


def test_parameters_the_loss_module_shares_with_the_policy_count_once(tmp_path):
    # The policy (found first, run by the collector) and the loss module hold the same Parameters:
    # counted under both, the gradient norm was sqrt(2) times the true one.
    _, net, norms = _train(tmp_path / "r")
    run = open_run(tmp_path / "r")
    assert [v for _, v in run.scalars("grad_norm")["grad_norm"]] == pytest.approx(norms, rel=1e-5)
    params = run.meta["monitor"]["params"]
    assert sorted(params) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert all(params[n]["gradient_steps"] == 12 for n in params)


def _calls_the_holder(net: nn.Module) -> None:
    # A holder called as a module twice (its lookups in the recorder's module table).
    holder = ParamsHolder(net, target=False)
    holder.forward = lambda x: functional_call(net, holder.as_dict(), (x,))
    for _ in range(2):
        holder(torch.randn(3, 4)).sum().backward()


@pytest.mark.parametrize("backend", ["native", "python"])
def test_the_recorder_names_modules_whose_equality_is_elementwise(tmp_path, backend):
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    with tg.record(tmp_path / "r", buffer=-1, backend=backend):
        _calls_the_holder(net)
    run = open_run(tmp_path / "r")
    assert {r["module"].rsplit(".", 1)[-1] for r in run.executions(phase="forward", op="addmm")} == {"0", "2"}


class PPOLoss(nn.Module):
    """torchrl.objectives.ClipPPOLoss: the actor's and the critic's Parameters in two holders; the actor's
    network is run through a sequence built around it (``get_dist``'s TensorDictSequential of the
    ProbabilisticActor's deterministic part), the critic as itself, neither a submodule of the loss."""

    def __init__(self, actor: nn.Sequential, critic: nn.Module):
        super().__init__()
        self.__dict__["det_part"] = nn.Sequential(actor[0])
        self.__dict__["critic"] = critic
        self.actor_network_params = ParamsHolder(actor, target=False)
        self.critic_network_params = ParamsHolder(critic, target=False)

    def forward(self, obs, ret):
        return self.det_part(obs).pow(2).mean() + (self.critic(obs).squeeze(1) - ret).pow(2).mean()


def test_each_layer_and_parameter_is_watched_once_under_the_name_of_the_module_that_runs_it(tmp_path):
    # ppo_mujoco.py under trainguard monitor: the actor's layers came twice ("module.0.module.0.0" and
    # "tensordictsequential.module.0.module.0.0"), and the critic's weights were named after the loss's
    # holder ("clipppoloss.critic_network_params.module.0.weight", layer type TensorDictParams) while
    # its layers were "valueoperator.module.0".
    torch.manual_seed(0)
    actor = nn.Sequential(nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)), nn.Softplus())
    critic = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))
    loss_module = PPOLoss(actor, critic)
    opt = torch.optim.Adam(loss_module.parameters(), lr=1e-3)
    with Monitor(None, tmp_path / "r", every=2):
        for _ in range(6):
            with torch.no_grad():
                actor(torch.randn(8, 3))  # the collector
            loss = loss_module(torch.randn(32, 3), torch.randn(32))
            opt.zero_grad()
            loss.backward()
            opt.step()
    meta = open_run(tmp_path / "r").meta["monitor"]
    layers = [la["name"] for la in meta["layers"] if la["type"] in ("Linear", "Tanh")]
    assert layers[:3] == ["0.0", "0.1", "0.2"] and len(layers) == 6, layers
    assert len(meta["params"]) == 8
    assert {info["layer"] for info in meta["params"].values()} == {"0.0", "0.2", layers[3], layers[5]}
    assert {info["module_type"] for info in meta["params"].values()} == {"Linear"}
