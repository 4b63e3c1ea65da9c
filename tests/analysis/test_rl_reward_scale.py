"""Rewards far too large for a value loss, and the symptoms they explain."""

from __future__ import annotations

from tests.analysis.test_diagnose import write_run
from tests.analysis.test_saturated_critic import LAYERS, PARAMS
from trainguard.analysis import diagnose

# stable-baselines3 @ e05d2dbe, PPO("MlpPolicy") (stable_baselines3/ppo/ppo.py PPO.train) on
# CartPole-v1 with every reward scaled 1e6 (a gymnasium RewardWrapper), under `trainguard run
# --monitor`: the value loss starts at 5.5e13 and the critic's gradients are ~1e7, so the global
# clip_grad_norm_(0.5) scales the actor's gradient to nothing (its update ratio ~1e-12). Beside
# rewards_too_large came a warning "Vanishing gradients: the first layer's relative gradient is
# 1.18e-11 of the last layer's ... use ReLU/GELU with Kaiming init": a symptom of the reward scale,
# with a fix that has nothing to do with it. Measured per weight matrix (weight norm, gradient
# norm, update ratio), steady over the run:
MEASURED = {
    "mlp_extractor.policy_net.0.weight": (2.8, 8e-4, 0.0),
    "mlp_extractor.policy_net.2.weight": (11.0, 8e-4, 3e-13),
    "mlp_extractor.value_net.0.weight": (2.8, 3e6, 8e-4),
    "mlp_extractor.value_net.2.weight": (13.0, 5e6, 1.6e-3),
    "action_net.weight": (0.014, 0.1, 2e-6),
    "value_net.weight": (1.9, 4.7e7, 1.9e-3),
}


def test_vanishing_gradients_behind_a_huge_value_loss_are_explained_by_the_reward_scale(tmp_path):
    loss = [5.1e13 + 3e12 * ((s * 7) % 5 - 2) for s in range(640)]
    rows = []
    for s in range(0, 640, 10):
        for p, (w, g, u) in MEASURED.items():
            rows += [(s, p, "weight", "norm", w), (s, p, "gradient", "norm", g), (s, p, "gradient", "present", 1),
                     (s, p, "gradient", "in_optimizer", 1), (s, p, "update", "norm", u * w),
                     (s, p, "update", "ratio", u)]
    fs = diagnose(write_run(tmp_path / "r", loss, layer_rows=rows, lr=3e-4, every=10, layers=LAYERS,
                            params=PARAMS, environment="gymnasium",
                            clipping={"function": "clip_grad_norm_", "value": 0.5, "first_step": 0}))
    by_kind = {f.kind: f for f in fs}
    assert by_kind["rewards_too_large"].is_problem
    assert "clip_grad_norm_(max_norm=0.5)" in by_kind["rewards_too_large"].suggestion
    vanish = by_kind["vanishing_gradient"]
    assert vanish.evidence.get("explained_by") == ["rewards_too_large"], (vanish.severity, vanish.title)
    assert [f.kind for f in fs if f.is_problem] == ["rewards_too_large"], [(f.kind, f.severity) for f in fs]
