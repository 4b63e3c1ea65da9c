"""Gradient-flow rules on an actor-critic held in one module (stable-baselines3's ActorCriticPolicy)."""

from __future__ import annotations

from tests.analysis.test_diagnose import write_run
from tests.analysis.test_saturated_critic import LAYERS, PARAMS
from trainguard.analysis import diagnose

# stable-baselines3 @ e05d2dbe, PPO("MlpPolicy", "Pendulum-v1", n_steps=512, batch_size=64), healthy,
# under `trainguard run --monitor` (stable_baselines3/ppo/ppo.py PPO.train; the policy's separate
# actor and critic MLPs, common/torch_layers.py MlpExtractor): the value head regresses returns of
# order -1000, so its relative gradient (205) dwarfs the actor's first layer's (0.0089), a ratio
# of 4.4e-5 that was called "Vanishing gradients ... use ReLU/GELU with Kaiming init": a policy
# layer compared with the critic's head, another branch with another loss. Measured: weight norm,
# relative gradient (gradient norm / weight norm), update ratio.
MEASURED = {
    "mlp_extractor.policy_net.0.weight": (2.8, 0.00891, 1e-4),
    "mlp_extractor.policy_net.2.weight": (11.0, 0.00178, 5e-5),
    "mlp_extractor.value_net.0.weight": (2.8, 26.2, 1e-3),
    "mlp_extractor.value_net.2.weight": (11.0, 1.24, 4e-4),
    "action_net.weight": (0.05, 3.88, 1e-3),
    "value_net.weight": (1.5, 205.0, 2.07e-3),
}


def ppo_run(path, measured=MEASURED, **meta):
    loss = [3000.0 * (1 + 0.3 * ((s * 7) % 5 - 2) / 2) for s in range(1280)]
    rows = []
    for s in range(0, 1280, 10):
        for p, (w, rel, u) in measured.items():
            rows += [(s, p, "weight", "norm", w), (s, p, "gradient", "norm", rel * w),
                     (s, p, "gradient", "present", 1), (s, p, "gradient", "in_optimizer", 1),
                     (s, p, "update", "norm", u * w), (s, p, "update", "ratio", u)]
    return write_run(path, loss, layer_rows=rows, lr=3e-4, every=10, layers=LAYERS, params=PARAMS, **meta)


def test_a_policy_layer_is_not_judged_against_the_critics_value_head(tmp_path):
    fs = diagnose(ppo_run(tmp_path / "r", environment="gymnasium"), rules=["vanishing_gradient"])
    assert not [f for f in fs if f.kind == "vanishing_gradient"], [f.title for f in fs]


def test_a_policy_whose_own_head_dwarfs_its_first_layer_still_vanishes(tmp_path):
    # the actor's first layer at 1e-6 of its own head's relative gradient: vanishing within the actor
    starved = dict(MEASURED)
    starved["mlp_extractor.policy_net.0.weight"] = (2.8, 3.88e-6, 1e-7)
    fs = diagnose(ppo_run(tmp_path / "r", starved, environment="gymnasium"), rules=["vanishing_gradient"])
    assert [f.kind for f in fs if f.is_problem] == ["vanishing_gradient"], [f.title for f in fs]
