"""A DQN target network that is never synced with the network it should follow."""

from __future__ import annotations

from tests.analysis.test_diagnose import write_run
from trainguard.analysis import diagnose

# pytorch/tutorials intermediate_source/reinforcement_q_learning.py (the gymnasium version, as in
# PyTorchKorea/tutorials-kr): policy_net and target_net are DQN(n_observations, n_actions), three
# Linear layers; target_net starts as policy_net.load_state_dict's copy and follows it by a soft
# update each step (TAU=0.005). With that update dropped, under `trainguard run --monitor`, the TD
# loss fell 0.135 -> 0.0001 (a regression onto a fixed random target) and the only word on the target
# was "Model dqn (DQN) is not trained ... nothing to do for a target". stable-baselines3's DQN with
# target_update_interval past learn()'s total steps (its default 10,000 in learn(10_000)) is the same.
LAYERS = [{"name": f"{pre}layer{i}", "type": "Linear"} for pre in ("", "dqn.") for i in (1, 2, 3)]
SHAPES = {"layer1": [128, 4], "layer2": [128, 128], "layer3": [2, 128]}
PARAMS = {f"{pre}{la}.weight": {"layer": f"{pre}{la}", "module_type": "Linear", "shape": s, "requires_grad": True,
                                **({"optimizer": "AdamW"} if not pre else {})}
          for pre in ("", "dqn.") for la, s in SHAPES.items()}
INITIAL = {"layer1": 4.6, "layer2": 6.5, "layer3": 0.82}


def dqn_run(path, target_moves: bool, **meta):
    loss = [0.135 * 0.99 ** s + 1e-4 for s in range(600)]
    rows = []
    for s in range(0, 600, 10):
        for la, w0 in INITIAL.items():
            w = w0 * (1 + 0.0005 * s)  # the policy network trains
            rows += [(s, la + ".weight", "weight", "norm", w), (s, la + ".weight", "gradient", "norm", 0.05),
                     (s, la + ".weight", "gradient", "present", 1), (s, la + ".weight", "gradient", "in_optimizer", 1),
                     (s, la + ".weight", "update", "norm", 1e-4 * w), (s, la + ".weight", "update", "ratio", 1e-4)]
            t = f"dqn.{la}.weight"
            rows += [(s, t, "weight", "norm", w0 * (1 + 0.0004 * s) if target_moves else w0),
                     (s, t, "gradient", "present", 0), (s, t, "gradient", "in_optimizer", 0)]
    roots = [{"prefix": "", "type": "DQN"}, {"prefix": "dqn.", "type": "DQN"}]
    return write_run(path, loss, layer_rows=rows, lr=1e-4, every=10, layers=LAYERS, params=PARAMS, roots=roots,
                     **meta)


def test_a_target_network_never_synced_in_a_reinforcement_learning_run_is_a_warning(tmp_path):
    fs = diagnose(dqn_run(tmp_path / "r", target_moves=False, environment="gymnasium"))
    [f] = [f for f in fs if f.kind == "model_not_trained"]
    assert f.is_problem and f.evidence["frozen_copy"] == {"model": "dqn", "of": "(the first model)"}, (
        f.severity, f.evidence)
    assert "never" in f.title and "load_state_dict" in f.suggestion and "target_update_interval" in f.suggestion


def test_a_target_network_that_follows_or_a_frozen_reference_outside_rl_is_a_note(tmp_path):
    # the tutorial as written: the soft update moves target_net
    fs = diagnose(dqn_run(tmp_path / "soft", target_moves=True, environment="gymnasium"))
    assert not [f for f in fs if f.is_problem], [(f.kind, f.severity, f.title) for f in fs if f.is_problem]
    # a reference model frozen on purpose (DPO's) is never synced by design
    fs = diagnose(dqn_run(tmp_path / "ref", target_moves=False))
    [f] = [f for f in fs if f.kind == "model_not_trained"]
    assert not f.is_problem, (f.severity, f.title)
