"""A critic's Tanh layer saturated by the returns it learns to predict, in a reinforcement learning run."""

from __future__ import annotations

import numpy as np

from tests.analysis.test_diagnose import write_run
from trainguard.analysis import diagnose

# stable-baselines3 @ e05d2dbe (stable_baselines3/common/policies.py ActorCriticPolicy with
# common/torch_layers.py MlpExtractor: two 64-unit Tanh MLPs, an action head and a value head),
# trained by stable_baselines3/a2c/a2c.py A2C.train with its defaults (RMSprop 7e-4, 5-step rollouts,
# clip_grad_norm_ 0.5) on CartPole-v1 for 5000 steps under `trainguard run --monitor`: the episode
# return reached 294, while the critic's last Tanh (mlp_extractor.value_net.3) went 0% -> 100%
# saturated as its value head's output grew with the returns (-0.064 -> 49.3). The finding was a
# warning telling a run that learned to lower its learning rate. Measured, one value every 100 steps:
CRITIC_SAT = [0.0, 0.0, 0.0, 0.572, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
VALUE_MEAN = [-0.0641, 10.1, 16.9, 22.8, 27.7, 32.1, 36.6, 40.8, 45.0, 49.3]
VALUE_STD = [0.0469, 0.126, 0.254, 0.0406, 0.00338, 0.00797, 0.00372, 0.0165, 0.0067, 0.00136]
LOSS = [7.71, 6.07, 18.5, 5.55, 5.33, 3.81, 4.51, 4.78, 4.3, 3.68, 3.53, 3.17, 2.93, 2.88, 3.58, 2.31, 2.51,
        2.02, 2.11, 1.79]

LAYERS = [{"name": n, "type": t, "units": u} for n, t, u in (
    ("mlp_extractor.policy_net.0", "Linear", 64), ("mlp_extractor.policy_net.1", "Tanh", 64),
    ("mlp_extractor.policy_net.2", "Linear", 64), ("mlp_extractor.policy_net.3", "Tanh", 64),
    ("mlp_extractor.value_net.0", "Linear", 64), ("mlp_extractor.value_net.1", "Tanh", 64),
    ("mlp_extractor.value_net.2", "Linear", 64), ("mlp_extractor.value_net.3", "Tanh", 64),
    ("action_net", "Linear", 2), ("value_net", "Linear", 1))]
SHAPES = {"mlp_extractor.policy_net.0": [64, 4], "mlp_extractor.policy_net.2": [64, 64],
          "mlp_extractor.value_net.0": [64, 4], "mlp_extractor.value_net.2": [64, 64],
          "action_net": [2, 64], "value_net": [1, 64]}
PARAMS = {f"{la}.weight": {"layer": la, "module_type": "Linear", "shape": s, "requires_grad": True,
                           "optimizer": "RMSprop"} for la, s in SHAPES.items()}


def a2c_run(path, value_mean=VALUE_MEAN, **meta):
    loss = list(np.repeat(LOSS, 50))
    rows = []
    for i, s in enumerate(range(0, 1000, 10)):
        k = i // 10
        for la in ("mlp_extractor.policy_net.1", "mlp_extractor.policy_net.3", "mlp_extractor.value_net.1",
                   "mlp_extractor.value_net.3"):
            sat = CRITIC_SAT[k] if la == "mlp_extractor.value_net.3" else 0.0
            rows += [(s, la, "activation", "sat_frac", sat), (s, la, "activation", "mean", 0.02),
                     (s, la, "activation", "std", 0.1 if k == 0 else max(0.3, sat))]
        rows += [(s, "value_net", "activation", "mean", value_mean[k]),
                 (s, "value_net", "activation", "std", VALUE_STD[k]),
                 (s, "action_net", "activation", "mean", 0.001), (s, "action_net", "activation", "std", 0.5)]
        for p in PARAMS:
            rows += [(s, p, "weight", "norm", 5.0), (s, p, "gradient", "norm", 1.0), (s, p, "gradient", "present", 1),
                     (s, p, "gradient", "in_optimizer", 1), (s, p, "update", "norm", 0.005),
                     (s, p, "update", "ratio", 1e-3)]
    return write_run(path, loss, layer_rows=rows, lr=7e-4, every=10, layers=LAYERS, params=PARAMS, **meta)


def _saturated(findings):
    return next(f for f in findings if f.kind == "saturated_activations")


def test_a_critic_saturated_by_growing_returns_is_a_note_about_the_reward_scale(tmp_path):
    fs = diagnose(a2c_run(tmp_path / "r", environment="gymnasium"), rules=["saturated_activations"])
    f = _saturated(fs)
    assert f.layers == ["mlp_extractor.value_net.3"]
    assert not f.is_problem, (f.severity, f.title)
    assert f.evidence["value_head"] == {"layer": "value_net", "initial": -0.0641, "last": 49.3}, f.evidence
    assert "VecNormalize" in f.suggestion and "learning rate" not in f.suggestion, f.suggestion


def test_the_same_saturation_outside_reinforcement_learning_or_without_growing_values_stays_a_warning(tmp_path):
    # a regression head whose targets are not returns: the updates saturated the layer
    f = _saturated(diagnose(a2c_run(tmp_path / "sl"), rules=["saturated_activations"]))
    assert f.is_problem and "learning rate" in f.suggestion, (f.severity, f.suggestion)
    # an agent whose value head stayed near its initial output: the returns do not explain it
    f = _saturated(diagnose(a2c_run(tmp_path / "flat", value_mean=[-0.0641 + 0.01 * k for k in range(10)],
                                    environment="gymnasium"), rules=["saturated_activations"]))
    assert f.is_problem and "value_head" not in f.evidence, (f.severity, f.evidence)
