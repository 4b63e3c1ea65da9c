"""The monitor's records: per-step scalars, layer statistics checked against a reference computed
in the test, batching (no per-layer host reads), attachment, modes, and cleanup."""

from __future__ import annotations

import copyreg
import gc
import math
import weakref
from collections import OrderedDict

import pytest
import torch
from torch import nn

import trainguard
from trainguard import Monitor
from trainguard.capture import _monitor_events, _monitor_tap, _steps
from trainguard.store import open_run


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(step: int):
    """A learnable task: the label is the largest of the first three features."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 8, generator=g)
    return x, x[:, :3].argmax(1)


def stats_of(run, step: int, layer: str, kind: str) -> dict[str, float]:
    return {r["stat"]: r["value"] for r in run.layer_stats(layer=layer, kind=kind) if r["step"] == step}


def test_scalars_and_layer_stats_match_a_reference(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_losses, ref_norms, ref_acts, ref_grads, ref_updates = [], [], {}, {}, {}
    seen = {}
    handles = [model[i].register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o.detach().clone()))
               for i in (1, 3)]
    with Monitor(model, tmp_path / "run", every=5, diagnose=False):
        for step in range(12):
            x, y = batch(step)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            ref_losses.append(loss.item())
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            ref_norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item())
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            if step % 5 == 0:
                ref_acts[step] = dict(seen)
                ref_grads[step] = grads
                ref_updates[step] = {
                    n: ((p.detach() - before[n]).norm() / before[n].norm()).item() for n, p in model.named_parameters()
                }
    for h in handles:
        h.remove()

    run = open_run(tmp_path / "run")
    scalars = run.scalars()
    assert [s for s, _ in scalars["loss"]] == list(range(12))
    assert [v for _, v in scalars["loss"]] == pytest.approx(ref_losses, rel=1e-6)
    assert [v for _, v in scalars["grad_norm"]] == pytest.approx(ref_norms, rel=1e-5)
    assert [v for _, v in scalars["lr/0"]] == [0.1] * 12

    assert sorted({r["step"] for r in run.layer_stats()}) == [0, 5, 10]
    for step in (0, 5, 10):
        relu = ref_acts[step][1]
        got = stats_of(run, step, "1", "activation")
        assert got["mean"] == pytest.approx(relu.mean().item(), rel=1e-5)
        assert got["std"] == pytest.approx(relu.std().item(), rel=1e-5)
        assert got["min"] == relu.min().item() and got["max"] == relu.max().item()
        assert got["zero_frac"] == pytest.approx((relu == 0).float().mean().item())
        assert got["dead_frac"] == pytest.approx((relu == 0).all(0).float().mean().item())
        tanh = stats_of(run, step, "3", "activation")
        assert tanh["sat_frac"] == pytest.approx((ref_acts[step][3].abs() > 0.99).float().mean().item())
        for name, g in ref_grads[step].items():
            got = stats_of(run, step, name, "gradient")
            assert got["mean_abs"] == pytest.approx(g.abs().mean().item(), rel=1e-5)
            assert got["max_abs"] == pytest.approx(g.abs().max().item(), rel=1e-6)
            assert got["norm"] == pytest.approx(g.norm().item(), rel=1e-5)
            assert got["nonfinite"] == 0 and got["present"] == 1 and got["in_optimizer"] == 1
            assert stats_of(run, step, name, "update")["ratio"] == pytest.approx(ref_updates[step][name], rel=1e-4)
    inputs = stats_of(run, 5, "<input>", "input")
    x5, _ = batch(5)
    assert inputs["mean"] == pytest.approx(x5.mean().item(), rel=1e-5)
    assert inputs["feat_std_max"] == pytest.approx(x5.std(0).max().item(), rel=1e-5)
    meta = run.meta["monitor"]
    assert meta["order"] == ["0", "1", "2", "3", "4"]
    assert meta["params"]["2.weight"] == {"layer": "2", "module_type": "Linear", "shape": [16, 16], "dtype": "float32",
                                          "requires_grad": True, "optimizer": "SGD", "orthogonalised": False,
                                          "weight_decay": 0.0, "gradient_steps": 12}


def test_dead_units_are_counted_across_the_batch_and_their_persistence(tmp_path):
    lin = nn.Linear(4, 10)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.copy_(torch.tensor([1.0] * 3 + [-1.0] * 7))  # 7 of 10 units always negative
        lin.weight[:3] = 0.1
    model = nn.Sequential(lin, nn.ReLU(), nn.Linear(10, 2))
    opt = torch.optim.SGD(model[2].parameters(), lr=0.0)
    with Monitor(model, tmp_path / "r", every=1, diagnose=False):
        for step in range(3):
            x, _ = batch(step)
            opt.zero_grad()
            model(x[:, :4]).sum().backward()
            opt.step()
    run = open_run(tmp_path / "r")
    assert stats_of(run, 0, "1", "activation")["dead_frac"] == pytest.approx(0.7)
    assert "dead_stay" not in stats_of(run, 0, "1", "activation")
    assert stats_of(run, 2, "1", "activation")["dead_stay"] == 1.0


def test_conv_units_are_channels(tmp_path):
    conv = nn.Conv2d(1, 4, 3, padding=1)
    with torch.no_grad():
        conv.bias.copy_(torch.tensor([0.0, -50.0, 0.0, -50.0]))
    model = nn.Sequential(conv, nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Monitor(model, tmp_path / "r", every=1, diagnose=False):
        opt.zero_grad()
        model(torch.randn(8, 1, 6, 6)).sum().backward()
        opt.step()
    run = open_run(tmp_path / "r")
    assert stats_of(run, 0, "1", "activation")["dead_frac"] == 0.5  # channels, not positions


def test_layer_statistics_reach_the_host_in_one_batch_per_recording_step(tmp_path, monkeypatch):
    """No ``.item()``/``float()`` on a tensor anywhere in the monitor; one ``tolist`` per shipped batch."""
    calls = {"item": 0, "float": 0, "bool": 0, "int": 0, "index": 0, "numpy": 0, "tolist": 0}
    for name, attr in (("item", "item"), ("float", "__float__"), ("bool", "__bool__"), ("int", "__int__"),
                       ("index", "__index__"), ("numpy", "numpy"), ("tolist", "tolist")):
        original = getattr(torch.Tensor, attr)

        def counting(self, *a, _o=original, _n=name, **k):
            import sys

            frame = sys._getframe(1)
            if frame.f_code.co_filename.endswith("_skips.py"):
                # the skip watch's wrapper of Tensor.item passes the caller's own call on (Adam's)
                frame = frame.f_back
            if frame.f_code.co_filename.endswith("_loss_watch.py"):
                calls["loss_graph_" + _n] = calls.get("loss_graph_" + _n, 0) + 1
            elif "trainguard" in frame.f_code.co_filename:
                calls[_n] += 1
            return _o(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, attr, counting)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = Monitor(model, tmp_path / "r", every=5, diagnose=False)
    for step in range(20):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    shipped_before_close = calls["tolist"]
    mon.close()
    monkeypatch.undo()
    assert calls["item"] == calls["float"] == calls["bool"] == calls["int"] == calls["index"] == calls["numpy"] == 0
    assert shipped_before_close == 4  # recording steps 0, 5, 10, 15: one transfer each
    # the loss graph's facts of the first three backward passes: one transfer in all
    assert {k: v for k, v in calls.items() if k.startswith("loss_graph_")} == {"loss_graph_tolist": 1}
    run = open_run(tmp_path / "r")
    assert len(run.scalars("loss")["loss"]) == 20
    assert len({(r["layer"], r["kind"]) for r in run.layer_stats() if r["step"] == 15}) > 10


def test_manual_loop_without_optimizer(tmp_path):
    model = mlp()
    losses = []
    with Monitor(model, tmp_path / "r", every=2, diagnose=False) as mon:
        for step in range(6):
            x, y = batch(step)
            model.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
            losses.append(loss.item())
            assert mon.step(loss) == step + 1
    run = open_run(tmp_path / "r")
    assert [v for _, v in run.scalars("loss")["loss"]] == pytest.approx(losses)
    assert [s for s, _ in run.scalars("grad_norm")["grad_norm"]] == list(range(6))
    assert "in_optimizer" not in stats_of(run, 2, "0.weight", "gradient")


def test_step_loss_replaces_the_scaled_loss_seen_by_backward(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    with Monitor(model, tmp_path / "r", every=3, diagnose=False) as mon:
        for step in range(5):
            x, y = batch(step)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            (loss * 1024.0).backward()  # as under a GradScaler
            opt.step()
            mon.step(loss)
            losses.append(loss.item())
    rows = open_run(tmp_path / "r").scalars("loss")["loss"]
    assert [s for s, _ in rows] == list(range(5))  # one row per step: no duplicates
    assert [v for _, v in rows] == pytest.approx(losses)


def test_attaches_to_unnamed_models_and_leaves_nothing_behind(tmp_path):
    import torch.nn.modules.module as module_mod

    original_backward = torch.autograd.backward
    original_clip = torch.nn.utils.clip_grad_norm_
    original_scaler_step = torch.amp.GradScaler.step
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()  # a top-level module without parameters: not a model
    with Monitor(None, tmp_path / "r", every=2, diagnose=False) as mon:
        for step in range(4):
            x, y = batch(step)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        assert mon.layers == ["0", "1", "2", "3", "4"]
    assert torch.autograd.backward is original_backward
    assert torch.nn.utils.clip_grad_norm_ is original_clip
    assert torch.amp.GradScaler.step is original_scaler_step
    assert not any(_monitor_tap._listeners.values())
    assert copyreg.dispatch_table.get(OrderedDict) is None
    assert not module_mod._global_forward_pre_hooks
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(not p._backward_hooks for p in model.parameters())
    assert _steps.clock.users == 0
    run = open_run(tmp_path / "r")
    assert run.meta["monitor"]["status"] == "finished"
    assert len(run.scalars("loss")["loss"]) == 4


def test_a_model_on_the_meta_device_counting_flops_is_no_model_being_trained(tmp_path, caplog):
    # litgpt/pretrain.py fit() (and Lightning's measure_flops) runs a GPT built on the meta device
    # forward and backward under a FlopCounterMode before training: the monitor took it for the
    # model, logged "finishing step N failed" (meta and cpu losses stacked) at every step, stored
    # no loss and reported objectives_in_sequence ("another optimizer took over at step 1").
    from torch.utils.flop_counter import FlopCounterMode

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(None, tmp_path / "r", every=5) as mon:
        with torch.device("meta"):
            meta = mlp()
            x = torch.randn(4, 8)
        with FlopCounterMode(display=False) as counter:
            meta(x).sum().backward()
        assert counter.get_total_flops() > 0
        for step in range(25):
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        assert mon.layers == ["0", "1", "2", "3", "4"]
    assert not [r for r in caplog.records if r.name.startswith("trainguard") and r.levelno >= 30]
    assert [s for s, _ in open_run(tmp_path / "r").scalars("loss")["loss"]] == list(range(25))
    assert [f.kind for f in mon.findings] == ["healthy"]


def test_two_models_get_prefixes(tmp_path):
    g, d = mlp(), nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(list(g.parameters()) + list(d.parameters()), lr=0.1)
    with Monitor({"gen": g, "disc": d}, tmp_path / "r", every=1, diagnose=False):
        x, _ = batch(0)
        opt.zero_grad()
        d(g(x)).mean().backward()
        opt.step()
    layers = open_run(tmp_path / "r").layers()
    assert "gen.<input>" in layers and "gen.1" in layers and "disc.1" in layers and "disc.2.weight" in layers


def test_models_trained_one_after_another_are_kept_apart(tmp_path):
    # An optuna sweep (each trial's objective builds a new model and optimizer and trains it) and
    # k-fold cross-validation (a fresh model per fold) under `trainguard monitor`: each new model was
    # named like the freed one before it ("0.weight" for all six trials, whatever their widths), its
    # statistics continued the previous model's series, and the meta held one "0.weight" of the
    # first trial's shape. Each model now has names of its own, and the run says where each began.
    def trial(hidden: int, steps: int = 4):
        model = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 3))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(steps):
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    with Monitor(None, tmp_path / "r", every=1, diagnose=False):
        for hidden in (16, 32, 64):
            trial(hidden)
            gc.collect()
    run = open_run(tmp_path / "r")
    params = run.meta["monitor"]["params"]
    assert {n: p["shape"] for n, p in params.items() if n.endswith("0.weight")} == {
        "0.weight": [16, 8], "sequential.0.weight": [32, 8], "sequential2.0.weight": [64, 8]}, sorted(params)
    assert {r["step"] for r in run.layer_stats(layer="0.weight", kind="weight")} == {0, 1, 2, 3}
    assert run.meta["monitor"]["models_in_sequence"] == [{"prefix": "", "first_step": 0},
                                                          {"prefix": "sequential.", "first_step": 4},
                                                          {"prefix": "sequential2.", "first_step": 8}]


def test_a_second_model_beside_a_live_first_is_no_sequence(tmp_path):
    # a GAN's two networks, an actor and a critic: both alive, both trained in every step
    g, d = mlp(), nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(list(g.parameters()) + list(d.parameters()), lr=0.1)
    with Monitor(None, tmp_path / "r", every=1, diagnose=False):
        for step in range(3):
            x, _ = batch(step)
            opt.zero_grad()
            d(g(x)).mean().backward()
            opt.step()
    assert "models_in_sequence" not in open_run(tmp_path / "r").meta["monitor"]


class _Agent(nn.Module):
    """cleanrl ppo.py's Agent (vwxyzjn/cleanrl): an actor and a critic with no forward of its own;
    the loop calls ``self.actor(x)`` and ``self.critic(x)`` directly."""

    def __init__(self):
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.actor = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))

    def get_action_and_value(self, x):
        logits = self.actor(x)
        return torch.distributions.Categorical(logits=logits).entropy(), self.critic(x)


def test_models_called_inside_a_container_without_forward_are_named_by_their_path(tmp_path):
    # The monitor of cleanrl's PPO named the actor's layers "0".."4" and the critic's
    # "sequential.0".."sequential.4": nothing said which network a finding was about, while the
    # Agent's state_dict (and the user) says "actor.0.weight". An nn.ModuleList of called
    # members (an ensemble) is such a container too.
    agent = _Agent()
    heads = nn.ModuleList([nn.Linear(4, 2), nn.Linear(4, 2)])
    opt = torch.optim.Adam(list(agent.parameters()) + list(heads.parameters()), lr=1e-3)
    with Monitor(None, tmp_path / "r", every=1, diagnose=False) as mon:
        for _ in range(2):
            x = torch.randn(8, 4)
            entropy, value = agent.get_action_and_value(x)
            loss = -entropy.mean() + value.pow(2).mean() + sum(h(x).pow(2).mean() for h in heads)
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert sorted(mon.layers) == ["0", "1", "actor.0", "actor.1", "actor.2", "critic.0", "critic.1", "critic.2"]
    layers = open_run(tmp_path / "r").layers()
    assert "actor.0.weight" in layers and "critic.2.bias" in layers and "1.weight" in layers


def test_activations_are_not_kept_alive(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    refs = []
    model[1].register_forward_hook(lambda m, a, o: refs.append(weakref.ref(o)))
    with Monitor(model, tmp_path / "r", every=1, diagnose=False):
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            del loss
        gc.collect()
        assert refs and all(r() is None for r in refs)


def test_histograms_on_request(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, tmp_path / "r", every=2, histograms=["1", "2.weight"], bins=8, diagnose=False):
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    run = open_run(tmp_path / "r")
    hists = run.histograms()
    assert {(h["layer"], h["kind"]) for h in hists} == {("1", "activation"), ("2.weight", "gradient"),
                                                          ("2.weight", "weight")}
    act = [h for h in hists if h["layer"] == "1" and h["step"] == 2][0]
    assert sum(act["counts"]) == 32 * 16 and len(act["edges"]) == 9
    s = stats_of(run, 2, "1", "activation")
    assert act["edges"][0] == pytest.approx(s["min"]) and act["edges"][-1] == pytest.approx(s["max"])


def test_stale_gradients_show_a_missing_zero_grad(tmp_path):
    def run_loop(path, zero: bool, accumulate: int = 1):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with Monitor(model, path, every=2, diagnose=False):
            for step in range(6):
                if zero:
                    opt.zero_grad()
                for k in range(accumulate):
                    x, y = batch(10 * step + k)
                    nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        return [r["value"] for r in open_run(path).layer_stats(stat="stale") if r["step"] > 0]

    assert set(run_loop(tmp_path / "a", zero=False)) == {1.0}
    assert set(run_loop(tmp_path / "b", zero=True)) == {0.0}
    assert set(run_loop(tmp_path / "c", zero=True, accumulate=3)) == {0.0}  # deliberate accumulation


def test_mode_counters(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, tmp_path / "r", every=5, diagnose=False) as mon:
        for step in range(4):
            if step == 2:
                model.eval()  # and never back to train()
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            with torch.no_grad():
                model(x)
    assert mon.modes["train_steps_in_eval"] == 2 and mon.modes["first_train_step_in_eval"] == 2
    assert mon.modes["eval_forwards"] == 4 and mon.modes["eval_forwards_in_train"] == 2
    assert open_run(tmp_path / "r").meta["monitor"]["modes"]["train_steps_in_eval"] == 2


def test_parameters_missing_from_the_optimizer_are_flagged(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(list(model[0].parameters()) + list(model[2].parameters()), lr=0.1)
    with Monitor(model, tmp_path / "r", every=1, diagnose=False):
        for step in range(2):
            x, y = batch(step)
            opt.zero_grad()
            model[4].zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    run = open_run(tmp_path / "r")
    assert stats_of(run, 1, "4.weight", "gradient")["in_optimizer"] == 0
    assert stats_of(run, 1, "0.weight", "gradient")["in_optimizer"] == 1
    assert stats_of(run, 1, "4.weight", "gradient")["present"] == 1


class MuonAdamW(torch.optim.Optimizer):
    """Shaped as karpathy/nanochat's nanochat/optim.py MuonAdamW: one optimizer holding AdamW groups
    (``kind="adamw"``) and Muon groups (``kind="muon"``). Its update here is plain SGD: the monitor
    reads only the class and the groups."""

    def __init__(self, groups):
        super().__init__(groups, defaults={})

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                p.add_(p.grad, alpha=-g["lr"])


def test_each_parameter_names_the_optimizer_that_updates_it(tmp_path):
    # nanochat trains its matrices with Muon and everything else with AdamW, in one optimizer;
    # torch.optim.Muon orthogonalises every update it makes. The diagnosis needs to know which
    # parameters' update sizes are set by the learning rate alone (clipping cannot shrink them).
    model = mlp()
    opt = MuonAdamW([dict(kind="adamw", params=[model[0].weight, model[0].bias], lr=0.01),
                     dict(kind="muon", params=[model[2].weight], lr=0.01)])
    muon = torch.optim.Muon([model[4].weight], lr=0.01)
    with Monitor(model, tmp_path / "r", every=1, diagnose=False):
        for step in range(3):
            x, y = batch(step)
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            muon.step()
    params = open_run(tmp_path / "r").meta["monitor"]["params"]
    assert params["0.weight"]["optimizer"] == "MuonAdamW" and params["0.weight"]["orthogonalised"] is False
    assert params["0.bias"]["optimizer"] == "MuonAdamW" and params["0.bias"]["orthogonalised"] is False
    assert params["2.weight"]["optimizer"] == "MuonAdamW" and params["2.weight"]["orthogonalised"] is True
    assert params["4.weight"]["optimizer"] == "Muon" and params["4.weight"]["orthogonalised"] is True
    assert "optimizer" not in params["2.bias"] and "optimizer" not in params["4.bias"]  # in no optimizer


class TimmMuon(torch.optim.Optimizer):
    """Shaped as timm's ``Muon`` (timm/optim/muon.py): one group list with no ``use_muon`` flag; at
    its first step it decides per parameter, by shape (``_is_suitable_for_muon``: at least two
    dimensions over 1, neither of the first two of size 1), whether the parameter takes Muon's
    orthogonalised step or the AdamW fallback, and caches it as ``state["use_muon"]``. Its update
    here is plain SGD: the monitor reads only the class, the groups and the state."""

    def __init__(self, params, lr):
        super().__init__(params, defaults=dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                state = self.state[p]
                if "use_muon" not in state:
                    s = p.shape
                    state["use_muon"] = p.ndim >= 2 and sum(d > 1 for d in s) >= 2 and s[0] != 1 and s[1] != 1
                p.add_(p.grad, alpha=-g["lr"])


def test_timm_muon_names_the_parameters_it_sends_to_adamw(tmp_path):
    # timm's train.py --opt muon on its test_vit: every parameter was stored as "orthogonalised"
    # (cls_token [1, 1, 64], pos_embed [1, 101, 64], the biases and norms), though timm's Muon sends
    # those to its AdamW fallback, as it does a depthwise conv's [C, 1, k, k] weight (ConvNeXt,
    # EfficientNet): a layer growing there was told that clipping cannot shrink its updates.
    torch.manual_seed(0)
    pos = nn.Parameter(torch.randn(1, 4, 8) * 0.02)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=4), nn.Conv2d(4, 8, 3, padding=1), nn.Flatten(),
                          nn.Linear(8 * 16, 3))
    model.register_parameter("pos", pos)
    opt = TimmMuon(model.parameters(), lr=0.01)
    with Monitor(model, tmp_path / "r", every=1, diagnose=False):
        for _ in range(3):
            x = torch.randn(2, 4, 4, 4)
            loss = model(x).square().mean() + (model.pos ** 2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    params = open_run(tmp_path / "r").meta["monitor"]["params"]
    got = {n: params[n]["orthogonalised"] for n in ("0.weight", "1.weight", "3.weight", "1.bias", "pos")}
    assert got == {"0.weight": False, "1.weight": True, "3.weight": True, "1.bias": False, "pos": False}, got
    assert all(params[n]["optimizer"] == "TimmMuon" for n in got)


def test_findings_are_stored_at_close(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainguard.Monitor(model, tmp_path / "r", every=5) as mon:
        for step in range(30):
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    kinds = [f.kind for f in mon.findings]
    assert kinds == ["healthy"]
    stored = open_run(tmp_path / "r").findings(source="monitor")
    assert [f["kind"] for f in stored] == kinds


def test_with_the_recorder_the_monitor_ops_are_not_recorded(tmp_path):
    def executions(with_monitor: bool, path):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = batch(0)
        with trainguard.record(path, mode="no_tensor", buffer=-1):
            mon = Monitor(model, path, every=1, diagnose=False) if with_monitor else None
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if mon is not None:
                mon.close()
        run = open_run(path)
        return run.count(), run

    plain, _ = executions(False, tmp_path / "a")
    monitored, run = executions(True, tmp_path / "b")
    assert monitored == plain
    assert len(run.scalars("loss")["loss"]) == 1 and run.layer_stats(layer="1")


@pytest.mark.parametrize(
    "kwargs, message",
    [({"every": 0}, "every must be an int >= 1, got 0"), ({"bins": 1}, "bins must be an int >= 2, got 1"),
     ({"histograms": "all"}, "histograms must be None, True or a list")],
)
def test_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Monitor(mlp(), tmp_path / "r", **kwargs)
    assert _steps.clock.users == 0


def test_nonfinite_values_are_stored_explicitly(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, tmp_path / "r", every=1, diagnose=False):
        x, y = batch(0)
        opt.zero_grad()
        (nn.functional.cross_entropy(model(x), y) * float("nan")).backward()
        opt.step()
    run = open_run(tmp_path / "r")
    assert math.isnan(run.scalars("loss")["loss"][0][1])
    assert stats_of(run, 0, "0.weight", "gradient")["nonfinite"] == 8 * 16


@pytest.mark.parametrize("closure", [False, True])
def test_a_float64_loss_and_gradient_norm_are_stored_as_the_program_computed_them(tmp_path, closure):
    # pytorch/examples' time_sequence_prediction trains a float64 LSTM with LBFGS; at lr=80 its loss
    # grows 0.53, 1.6e16, 1.7e34, 1.1e53: finite in float64. The monitor stored it in float32 (and
    # summed squared gradient norms there): "Loss became inf at step 3", a critical finding about a
    # value the program never had, and every loss rounded to float32.
    torch.manual_seed(0)
    model = nn.Linear(4, 1).double()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.0, max_iter=2) if closure else torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(8, 4, dtype=torch.float64)
    seen = []  # (loss, gradient norm) of each step, as the program computes them (a closure's first call)
    with Monitor(model, tmp_path / "r", every=1) as mon:
        for step, scale in enumerate((1.0, 1e25, 1e30)):
            def evaluate(step=step, scale=scale):
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), torch.full((8, 1), scale, dtype=torch.float64))
                loss.backward()
                if len(seen) == step:
                    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
                    seen.append((loss.item(), norm.item()))
                return loss

            if closure:
                opt.step(evaluate)
            else:
                evaluate()
                opt.step()
    run = open_run(tmp_path / "r")
    assert [v for _, v in run.scalars("loss")["loss"]] == [loss for loss, _ in seen]
    assert seen[-1][0] > 1e59 and seen[-1][1] > 1e29  # beyond float32 (the norm's square too)
    assert [v for _, v in run.scalars("grad_norm")["grad_norm"]] == pytest.approx([n for _, n in seen], rel=1e-12)
    assert not [f for f in mon.findings if f.kind in ("nonfinite_loss", "nonfinite_gradients")]


class _Features(nn.Module):
    """pytorch/examples' fast_neural_style in small: a frozen feature network (its Vgg16) gives the
    perceptual loss of a trained image network (its TransformerNet)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.requires_grad_(False)

    def forward(self, x):
        return torch.relu(self.conv(x))


def _perceptual_training():
    # the models live in this function, as in a script's main(): gone when the monitor closes
    torch.manual_seed(0)
    features, net = _Features(), nn.Sequential(nn.Conv2d(3, 3, 3, padding=1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(3):
        x = torch.rand(2, 3, 8, 8)
        loss = nn.functional.mse_loss(features(net(x)), features(x))
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_a_model_gone_before_the_monitor_closes_keeps_its_type(tmp_path):
    # "Model (the first model) (None) is not trained": the types of the models were read through
    # their weak references when the run's metadata was written at close, after main() had returned.
    with Monitor(None, tmp_path / "r", every=1) as mon:
        _perceptual_training()
    roots = open_run(tmp_path / "r").meta["monitor"]["roots"]
    assert sorted(str(r["type"]) for r in roots) == ["Sequential", "_Features"]
    [untrained] = [f for f in mon.findings if f.kind == "model_not_trained"]
    assert untrained.evidence["type"] == "_Features" and "None" not in untrained.title


def test_a_submodule_called_first_is_replaced_by_its_model(tmp_path):
    model = nn.Sequential(mlp(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(None, tmp_path / "r", every=1, diagnose=False) as mon:
        x, _ = batch(0)
        with torch.no_grad():
            model[0](x)  # the inner network alone first (say, a warm-up or a probe)
        for _ in range(2):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        assert mon.layers == ["0.0", "0.1", "0.2", "0.3", "0.4", "1"]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_scalars_reach_the_run_between_distant_recordings(tmp_path, monkeypatch):
    # the step count alone: the 2 s timer (tests/capture/test_kill.py) shipped at step 49 on a
    # loaded machine, and the next 50 steps never came
    monkeypatch.setattr(_monitor_events, "SHIP_SECONDS", float("inf"))
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, tmp_path / "r", every=1000, diagnose=False) as mon:
        for step in range(80):
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        mon._writer.flush()
        live = open_run(tmp_path / "r").scalars("loss")["loss"]
        assert 50 <= len(live) < 80  # shipped once the buffer passed 50 steps, before the end



def test_parameters_switched_off_around_the_other_optimizers_update_are_not_frozen(tmp_path):
    # Lightning's GAN example (domain_templates/generative_adversarial_net.py) calls
    # toggle_optimizer(opt_g) before the generator's update: every parameter outside opt_g has
    # requires_grad=False until untoggle_optimizer. The monitor attached the discriminator at its
    # first forward, inside that window, and called it frozen. A parameter an optimizer updated
    # with requires_grad=True is trainable; one never trained stays frozen.
    torch.manual_seed(0)
    gen, disc = nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 1), nn.Flatten(0))
    gen.append(nn.Linear(8, 8).requires_grad_(False))  # frozen for real
    opt_g = torch.optim.Adam([p for p in gen.parameters() if p.requires_grad], lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)

    def toggled(params, on):
        for p in params:
            p.requires_grad_(on)

    with Monitor(None, tmp_path / "r", every=2) as mon:
        for _ in range(6):
            toggled(disc.parameters(), False)  # toggle_optimizer(opt_g)
            g_loss = disc(gen(torch.randn(16, 4))).sub(1).pow(2).mean()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            toggled(disc.parameters(), True)  # untoggle_optimizer(opt_g)
            d_loss = disc(torch.randn(16, 8)).sub(1).pow(2).mean() + disc(gen(torch.randn(16, 4)).detach()).pow(2).mean()
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
    (frozen,) = [f for f in mon.findings if f.kind == "params_frozen"]
    assert sorted(frozen.evidence["params"]) == ["2.bias", "2.weight"], frozen.evidence  # gen is the first root


class GraphConv(nn.Module):
    """pytorch/examples gcn/main.py's layer: ``spmm(adj, input @ kernel) + bias``, whose model is
    called with sparse COO node features and a sparse adjacency matrix."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.empty(n_in, n_out))
        nn.init.xavier_normal_(self.kernel)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x, adj):
        return torch.spmm(adj, torch.mm(x, self.kernel)) + self.bias


class GCN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gc1, self.gc2 = GraphConv(12, 8), GraphConv(8, 3)

    def forward(self, x, adj):
        return nn.functional.log_softmax(self.gc2(torch.relu(self.gc1(x, adj)), adj), dim=1)


def test_a_sparse_input_is_measured_not_a_failing_hook(tmp_path, caplog):
    torch.manual_seed(0)
    dense = (torch.rand(40, 12) < 0.2).float() * torch.rand(40, 12)
    x = dense.to_sparse()
    adj = (torch.eye(40) + (torch.rand(40, 40) < 0.1).float()).to_sparse()
    y = torch.randint(0, 3, (40,))
    model = GCN()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with caplog.at_level("ERROR", logger="trainguard"), Monitor(model, tmp_path / "run", every=2, diagnose=False):
        for _ in range(5):
            opt.zero_grad()
            nn.functional.nll_loss(model(x, adj), y).backward()
            opt.step()
    assert not [r for r in caplog.records if "hook failed" in r.getMessage()], caplog.text
    with open_run(tmp_path / "run") as run:
        got = stats_of(run, 2, "<input>", "input")
        assert got["mean"] == pytest.approx(dense.mean().item(), rel=1e-5)
        assert got["std"] == pytest.approx(dense.std().item(), rel=1e-4)
        assert got["min"] == 0.0 and got["max"] == pytest.approx(dense.max().item())
        assert stats_of(run, 2, "gc1", "activation"), "the layers are measured too"


class SpectralConv2d(nn.Module):
    """zongyi-li/fourier_neural_operator fourier_2d.py's Fourier layer: complex weights
    (``torch.rand(..., dtype=torch.cfloat)``) on the lowest modes of ``torch.fft.rfft2``."""

    def __init__(self, width: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        self.weights1 = nn.Parameter(torch.rand(width, width, modes, modes, dtype=torch.cfloat) / width**2)

    def forward(self, x):
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(x.shape[0], x.shape[1], x.size(-2), x.size(-1) // 2 + 1, dtype=torch.cfloat)
        m = self.modes
        out_ft[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m, :m], self.weights1)
        return torch.fft.irfft2(out_ft, s=(x.size(-2), x.size(-1)))


def test_histograms_of_complex_weights_hold_both_parts_without_a_warning(tmp_path, recwarn):
    torch.manual_seed(0)
    model = nn.Sequential(SpectralConv2d(4, 3), nn.GELU())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Monitor(model, tmp_path / "run", every=1, histograms=True, diagnose=False):
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(2, 4, 8, 8)).pow(2).mean().backward()
            opt.step()
    assert not [w for w in recwarn if "complex" in str(w.message)], [str(w.message) for w in recwarn]
    w = torch.view_as_real(model[0].weights1.detach())
    with open_run(tmp_path / "run") as run:
        [h] = [h for h in run.histograms(layer="0.weights1", kind="weight") if h["step"] == 1]
    assert sum(h["counts"]) == w.numel()  # real and imaginary parts
    assert h["edges"][0] == pytest.approx(w.min().item()) and h["edges"][-1] == pytest.approx(w.max().item())


class PackedLSTM(nn.Module):
    """bentrevett/pytorch-sentiment-analysis "2 - Recurrent Neural Networks.ipynb"'s LSTM in small:
    an embedding with a padding index, ``pack_padded_sequence`` into a bidirectional two-layer
    ``nn.LSTM`` (which returns ``(PackedSequence, (hidden, cell))``), the last hidden states into
    a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(30, 8, padding_idx=0)
        self.lstm = nn.LSTM(8, 6, 2, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(12, 2)

    def forward(self, ids, length):
        packed = nn.utils.rnn.pack_padded_sequence(self.embedding(ids), length, batch_first=True,
                                                   enforce_sorted=False)
        packed_output, (hidden, cell) = self.lstm(packed)
        return self.fc(torch.cat([hidden[-1], hidden[-2]], dim=-1))


def test_a_packed_lstm_has_activation_stats(tmp_path):
    model = PackedLSTM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen = []
    model.lstm.register_forward_hook(lambda m, a, o: seen.append(o[0].data.detach().clone()))
    g = torch.Generator().manual_seed(0)
    with Monitor(model, tmp_path / "run", every=1, diagnose=False):
        for _ in range(2):
            length = torch.randint(1, 7, (4,), generator=g)
            ids = torch.randint(1, 30, (4, 6), generator=g) * (torch.arange(6) < length[:, None])
            opt.zero_grad()
            nn.functional.cross_entropy(model(ids, length), torch.tensor([0, 1, 1, 0])).backward()
            opt.step()
    with open_run(tmp_path / "run") as run:
        got = stats_of(run, 1, "lstm", "activation")
    assert got, "the LSTM's output (the PackedSequence's data) is measured"
    assert got["mean"] == pytest.approx(seen[1].mean().item(), rel=1e-4, abs=1e-6)
    assert got["max"] == pytest.approx(seen[1].max().item())


class _LoraLinear(nn.Module):
    """peft's LoRA ``Linear`` in small: a frozen base layer plus ``lora_B(lora_A(x)) * alpha / r``,
    B initialised to zero (the adapter starts as the identity change)."""

    def __init__(self, n_in, n_out, r=4, alpha=8):
        super().__init__()
        self.base_layer = nn.Linear(n_in, n_out).requires_grad_(False)
        self.lora_A = nn.Linear(n_in, r, bias=False)
        self.lora_B = nn.Linear(r, n_out, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


class _LoraLM(nn.Module):
    """A frozen embedding, two checkpointed blocks with LoRA adapters, a LoRA head (peft's
    ``target_modules=[..., "lm_head"]``): what ``gradient_checkpointing_enable()`` makes of a model
    under LoRA."""

    def __init__(self, input_grads: bool, head_adapter: bool = True):
        super().__init__()
        self.embed = nn.Embedding(40, 16).requires_grad_(False)
        self.blocks = nn.ModuleList(_LoraLinear(16, 16) for _ in range(2))
        self.head = _LoraLinear(16, 40) if head_adapter else nn.Linear(16, 40).requires_grad_(False)
        self.input_grads = input_grads  # transformers' enable_input_require_grads()

    def forward(self, ids):
        h = self.embed(ids)
        if self.input_grads:
            h.requires_grad_(True)
        for block in self.blocks:
            h = h + torch.utils.checkpoint.checkpoint(lambda x, b=block: torch.tanh(b(x)), h, use_reentrant=True)
        return self.head(h)


def _train_lora(tmp_path, input_grads, head_adapter=True):
    torch.manual_seed(0)
    model = _LoraLM(input_grads, head_adapter)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    perm = torch.randperm(40)
    with Monitor(model, tmp_path / "r", every=5) as mon:
        for step in range(30):
            ids = torch.randint(0, 40, (16, 8), generator=torch.Generator().manual_seed(step))
            loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), perm[ids].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model, mon.findings


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # torch says so too, per call
def test_lora_adapters_behind_reentrant_checkpointing_without_input_grads_are_named_with_the_fix(tmp_path):
    model, findings = _train_lora(tmp_path, input_grads=False)
    assert model.blocks[0].lora_A.weight.grad is None  # the classic failure: the adapters learn nothing
    (f,) = [f for f in findings if f.kind == "param_no_gradient"]
    assert f.evidence["params"] == [f"blocks.{i}.lora_{m}.weight" for i in range(2) for m in "AB"]
    assert f.evidence["checkpointed"] == f.evidence["params"]
    assert "enable_input_require_grads()" in f.suggestion and "use_reentrant=False" in f.suggestion
    assert "requires_grad=False" not in f.suggestion  # freezing the adapters is no fix


def test_lora_with_checkpointing_and_input_grads_is_healthy(tmp_path):
    """The frozen base is info at most, and lora_A's zero gradient at step 0 (B starts at zero) is
    by design."""
    model, findings = _train_lora(tmp_path, input_grads=True)
    assert model.blocks[0].lora_A.weight.grad is not None
    assert [f.kind for f in findings if f.severity not in ("info",)] == []
    assert {f.kind for f in findings} == {"params_frozen", "healthy"}


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_a_loss_without_grad_behind_reentrant_checkpointing_is_explained(tmp_path):
    """With every adapter inside the checkpoints, backward() raises torch's "element 0 of tensors
    does not require grad": the crash finding says why and what to call."""
    with pytest.raises(RuntimeError, match="does not require grad"):
        _train_lora(tmp_path, input_grads=False, head_adapter=False)
    (crash,) = [f for f in open_run(tmp_path / "r").findings() if f["kind"] == "script_crashed"]
    assert "activation checkpointing" in crash["suggestion"]
    assert "enable_input_require_grads()" in crash["suggestion"] and "use_reentrant=False" in crash["suggestion"]


class _Lora(nn.Module):
    """A frozen linear layer with a low-rank adapter as peft's ``LoraLayer`` makes it (peft
    ``tuners/lora/layer.py``: ``lora_A`` Kaiming-uniform, ``lora_B`` zeros): its output is exactly 0
    for every sample until the first update moves ``lora_B``."""

    def __init__(self, d: int = 8, r: int = 4):
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.lora_A, self.lora_B = nn.Linear(d, r, bias=False), nn.Linear(r, d, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


def _train_two_recordings(model, tmp_path):
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with Monitor(model, tmp_path, every=10) as mon:
        for step in range(11):  # recordings at steps 0 and 10
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
            loss = (model(x) - x.flip(1)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return [f for f in mon.findings if f.kind == "dead_units"]


def test_a_zero_initialised_adapter_is_not_dead_units(tmp_path):
    # huggingface/trl's DPOTrainer with --use_peft (lora_r 4 on q_proj, v_proj), 20 steps under
    # `trainguard run --monitor` (recordings at steps 0 and 10): "Dead units: 50% of layer
    # ...q_proj.lora_B.default's units output 0 for every sample; 0%+ of them stay dead", the step-0
    # zeros of the zero-initialised lora_B averaged with step 10, where every unit was alive.
    torch.manual_seed(0)
    assert _train_two_recordings(nn.Sequential(_Lora(), nn.Tanh(), _Lora()), tmp_path / "lora") == []
    # A layer dead at both recordings still is.
    torch.manual_seed(0)
    dead = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with torch.no_grad():
        dead[0].bias.fill_(-100.0)
    (found,) = _train_two_recordings(dead, tmp_path / "dead")
    assert "1" in found.layers


def test_a_ddp_wrapper_is_no_level_of_the_model(tmp_path, one_rank):
    # DINO's student is DistributedDataParallel(MultiCropWrapper), its teacher is not: the monitor
    # named the student's layers "distributeddataparallel.module.head", with DDP's own level in
    # them, while the state_dict trainguard's checkpoints save has no "module." (TrainState
    # strips it) and the model the user wrote is the wrapped one.
    teacher = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    student = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)))
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    with Monitor(None, tmp_path / "r", every=1, diagnose=False) as mon:
        for _ in range(2):
            x = torch.randn(4, 6)
            with torch.no_grad():
                target = teacher(x)
            loss = (student(x) - target).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        # the second model is named by the loop's variable (student), with no DDP level in it
        assert sorted(mon.layers) == ["0", "1", "2", "student.0", "student.1", "student.2"]
    layers = open_run(tmp_path / "r").layers()
    assert "student.0.weight" in layers and "0.weight" in layers


def test_an_activation_checkpoint_wrapper_is_no_level_of_the_model(tmp_path):
    # torchtune's recipes with enable_activation_checkpointing=True: training.set_activation_checkpointing
    # wraps each TransformerSelfAttentionLayer in torch's CheckpointWrapper, which holds it as
    # ``_checkpoint_wrapped_module``; the monitor named the layers
    # "layers.0._checkpoint_wrapped_module.attn.q_proj" while the model's state_dict (which the
    # wrapper's hooks strip) and torchtune's checkpoints say "layers.0.attn.q_proj.weight".
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2))
    model[1] = checkpoint_wrapper(model[1])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, tmp_path / "r", every=1, diagnose=False) as mon:
        for _ in range(2):
            loss = model(torch.randn(4, 6)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert sorted(mon.layers) == ["0", "1.0", "1.1", "2"]
    layers = open_run(tmp_path / "r").layers()
    assert sorted(n for n in layers if n.endswith(("weight", "bias"))) == sorted(model.state_dict())


@pytest.mark.parametrize("wrapper", ["GradSampleModule", "GradSampleModuleFastGradientClipping"])
def test_an_opacus_grad_sample_module_is_no_level_of_the_model(tmp_path, wrapper):
    # opacus' examples/mnist.py under `trainguard run --monitor`: make_private wraps SampleConvNet
    # in a GradSampleModule holding it as ``_module``, and every layer and parameter was named
    # "_module.conv1", "_module.conv1.weight", where the model the user wrote says "conv1.weight".
    import dp_models

    torch.manual_seed(0)
    model = getattr(dp_models, wrapper)(dp_models.SampleConvNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(None, tmp_path / "r", every=1, diagnose=False) as mon:
        for _ in range(2):
            loss = nn.functional.cross_entropy(model(torch.randn(4, 1, 28, 28)), torch.tensor([0, 1, 2, 3]))
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert sorted(mon.layers) == ["conv1", "conv2", "fc1", "fc2"]
    layers = open_run(tmp_path / "r").layers()
    assert sorted(n for n in layers if "." in n) == sorted(model._module.state_dict())


def test_opacus_ghost_clippings_reweighted_pass_is_not_the_loss(tmp_path):
    # opacus' examples/mnist.py with grad_sample_mode="ghost" under `trainguard run --monitor`: the
    # loss's backward() runs the loss (2.28), then the clipping-coefficient-weighted sum of the
    # per-sample losses (about 60 for 64 samples); the monitor stored their sum, 62.98 for 2.29,
    # and warned "Learning rate too high: the smoothed loss rose to 60.2 by step 1, from 2.31".
    import dp_models

    torch.manual_seed(0)
    model = dp_models.GradSampleModuleFastGradientClipping(dp_models.SampleConvNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    with Monitor(None, tmp_path / "r", every=5) as mon:
        for _ in range(25):
            y = torch.randint(0, 10, (16,))
            x = torch.randn(16, 1, 28, 28) * 0.3
            x[torch.arange(16), 0, y * 2, :] += 3.0  # the label is the bright row: learnable
            loss = dp_models.DPTensorFastGradientClipping(
                opt, nn.functional.cross_entropy(model(x), y, reduction="none"))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    stored = [v for _, v in open_run(tmp_path / "r").scalars("loss")["loss"]]
    assert stored == pytest.approx(losses, rel=1e-6)
    assert [f.kind for f in mon.findings if f.severity != "info"] == []


class _SACActor(nn.Module):
    """Stable-Baselines3's sac/policies.py Actor: ``action_log_prob`` calls its members
    ``latent_pi``, ``mu`` and ``log_std`` one by one, never the actor itself."""

    def __init__(self):
        super().__init__()
        self.latent_pi = nn.Sequential(nn.Linear(3, 16), nn.ReLU())
        self.mu = nn.Linear(16, 1)
        self.log_std = nn.Linear(16, 1)

    def forward(self, obs):
        return self.mu(self.latent_pi(obs))

    def action_log_prob(self, obs):
        latent = self.latent_pi(obs)
        dist = torch.distributions.Normal(self.mu(latent), self.log_std(latent).clamp(-20, 2).exp())
        action = dist.rsample()
        return action, dist.log_prob(action).sum(-1)


class _SACPolicy(nn.Module):
    """SB3's SACPolicy: a forward of its own (the actor's action, for predict), while SAC.train
    calls ``policy.actor.action_log_prob`` and ``policy.critic(obs, action)`` directly."""

    def __init__(self):
        super().__init__()
        self.actor = _SACActor()
        self.critic = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        self.critic_target = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, obs):
        return self.actor(obs)


def test_members_of_a_holder_with_its_own_forward_are_named_by_their_path(tmp_path):
    # SB3's SAC: the monitor named the actor's layers "0", "linear.", "linear2." and the critics
    # "sequential." / "sequential2.": which of them is the target network the report could not
    # say, while the policy's state_dict says "critic_target.0.weight".
    policy = _SACPolicy()
    actor_opt = torch.optim.Adam(policy.actor.parameters(), lr=1e-3)
    critic_opt = torch.optim.Adam(policy.critic.parameters(), lr=1e-3)
    with Monitor(None, tmp_path / "r", every=1, diagnose=False) as mon:
        for _ in range(2):
            obs = torch.randn(8, 3)
            with torch.no_grad():
                next_action, _ = policy.actor.action_log_prob(obs)
                target = policy.critic_target(torch.cat([obs, next_action], 1))
            critic_loss = (policy.critic(torch.cat([obs, torch.randn(8, 1)], 1)) - target).pow(2).mean()
            critic_opt.zero_grad()
            critic_loss.backward()
            critic_opt.step()
            action, log_prob = policy.actor.action_log_prob(obs)
            actor_loss = (log_prob - policy.critic(torch.cat([obs, action], 1)).squeeze(1)).mean()
            actor_opt.zero_grad()
            actor_loss.backward()
            actor_opt.step()
        assert sorted(mon.layers) == ["actor.latent_pi.0", "actor.latent_pi.1", "actor.log_std", "actor.mu",
                                      "critic.0", "critic.1", "critic.2",
                                      "critic_target.0", "critic_target.1", "critic_target.2"]
    layers = open_run(tmp_path / "r").layers()
    assert "critic_target.0.weight" in layers and "actor.mu.bias" in layers


class _PreferenceTrainer:
    """trl's DPOTrainer, reduced to what naming needs: not a module, it holds the policy as
    ``self.model`` and a frozen copy of it as ``self.ref_model``, and runs both in each step."""

    def __init__(self, model, ref_model):
        self.model, self.ref_model = model, ref_model
        self.opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(self, chosen, rejected):
        margin = self.model(chosen) - self.model(rejected)  # the policy first, as trl's _compute_loss
        with torch.no_grad():
            ref_margin = self.ref_model(chosen) - self.ref_model(rejected)
        margin = margin - ref_margin
        loss = -nn.functional.logsigmoid(0.1 * margin).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()


def test_a_model_held_by_an_object_that_is_no_module_is_named_by_its_attribute(tmp_path):
    # trainguard run --monitor on trl's DPOTrainer (a policy and its reference, both
    # LlamaForCausalLM): the reference's layers were "llamaforcausallm.model.layers.0.mlp.up_proj",
    # and the report said "Model llamaforcausallm (LlamaForCausalLM) is not trained": with two
    # models of that type, not which one. The trainer holds it as `ref_model`.
    def build():
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    trainer = _PreferenceTrainer(build(), build().requires_grad_(False).eval())
    with Monitor(None, tmp_path / "r", every=1) as mon:
        for step in range(3):
            x, _ = batch(step)
            trainer.step(x[:, :4], x[:, 4:])
        assert sorted(mon.layers) == ["0", "1", "2", "ref_model.0", "ref_model.1", "ref_model.2"], sorted(mon.layers)
    untrained = [f for f in mon.findings if f.kind == "model_not_trained"]
    assert len(untrained) == 1 and "ref_model" in untrained[0].title, [f.title for f in mon.findings]


class _QNetwork(nn.Module):
    """cleanrl's dqn.py QNetwork (vwxyzjn/cleanrl @fe8d8a0), 4 observations, 2 actions, 16 units."""

    def __init__(self):
        super().__init__()
        self.network = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x):
        return self.network(x)


def test_a_target_network_of_the_policys_own_type_is_named_by_the_scripts_variable(tmp_path):
    # cleanrl's dqn.py on CartPole-v1 under `trainguard monitor` (3000 env steps, 249 updates): its
    # q_network and target_network are both QNetwork, globals of the script; the target's layers
    # were "qnetwork.network.0" and the report said "Model qnetwork (QNetwork) is not trained",
    # which reads as the script's q_network, the one that is trained. The loop below is dqn.py's
    # with a fake environment: the rollout's greedy action, a replay buffer, the TD target from
    # the target network under no_grad, and the target soft-updated by hand every 4 updates.
    torch.manual_seed(0)
    q_network = _QNetwork()
    optimizer = torch.optim.Adam(q_network.parameters(), lr=2.5e-4)
    target_network = _QNetwork()
    target_network.load_state_dict(q_network.state_dict())
    obs_buf, act_buf, rew_buf, next_buf = torch.randn(64, 4), torch.randint(0, 2, (64, 1)), torch.rand(64), torch.randn(64, 4)
    with Monitor(None, tmp_path / "r", every=1) as mon:
        for step in range(12):
            with torch.no_grad():
                q_network(torch.randn(1, 4)).argmax(dim=1)  # the rollout's action (epsilon-greedy)
            idx = torch.randint(0, 64, (16,))
            with torch.no_grad():
                target_max, _ = target_network(next_buf[idx]).max(dim=1)
                td_target = rew_buf[idx] + 0.99 * target_max
            old_val = q_network(obs_buf[idx]).gather(1, act_buf[idx]).squeeze()
            loss = nn.functional.mse_loss(td_target, old_val)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 4 == 0:
                for target_param, q_param in zip(target_network.parameters(), q_network.parameters()):
                    target_param.data.copy_(0.5 * q_param.data + 0.5 * target_param.data)
        layers = sorted(mon.layers)
    assert "network.0" in layers and "target_network.network.0" in layers, layers
    assert not any(n.startswith("qnetwork") for n in layers), layers
    [untrained] = [f for f in mon.findings if f.kind == "model_not_trained"]
    assert "target_network" in untrained.title, untrained.title


def test_the_first_model_found_is_named_by_the_scripts_variable_in_findings(tmp_path):
    # facebookresearch/dino @ 7c446df5 main_dino.py calls `teacher(images[:2])` before `student(images)`:
    # the teacher is the first model found, whose layers have no prefix, and the findings called it
    # "(the first model)" ("Model (the first model) (...) is not trained").
    torch.manual_seed(0)
    teacher, student = _QNetwork(), _QNetwork()
    teacher.requires_grad_(False)
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-3)
    with Monitor(None, tmp_path / "r", every=1) as mon:
        for _ in range(8):
            x = torch.randn(16, 4)
            with torch.no_grad():
                target = teacher(x).softmax(-1)
            loss = -(target * student(x).log_softmax(-1)).sum(-1).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        layers = sorted(mon.layers)
    assert "network.0" in layers and "student.network.0" in layers, layers  # the teacher's names: unprefixed
    [untrained] = [f for f in mon.findings if f.kind == "model_not_trained"]
    assert untrained.evidence["model"] == "teacher" and "Model teacher (" in untrained.title, untrained.title


class _TrainingTask(nn.Module):
    """mlfoundations/open_clip's open_clip_train TrainingTask: holds the CLIP model as
    ``trainable_module`` and computes the loss in its forward; with ``--accum-freq 2`` the training
    loop calls the model directly, and evaluation calls the task."""

    def __init__(self, model):
        super().__init__()
        self.trainable_module = model

    def forward(self, x):
        return self.trainable_module(x).pow(2).mean()


def test_a_model_called_directly_then_through_its_holder_keeps_one_name(tmp_path):
    # open_clip under `trainguard monitor --accum-freq 2`: step 0's statistics were stored under
    # "visual.*" and, once evaluation had called the task, under "trainable_module.visual.*":
    # every layer listed twice, its history split in two.
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    task = _TrainingTask(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(None, tmp_path / "r", every=1, diagnose=False) as mon:
        for step in range(4):
            x = torch.randn(8, 4)
            loss = model(x).pow(2).mean() if step % 2 == 0 else task(x)
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert sorted(mon.layers) == ["trainable_module.0", "trainable_module.1", "trainable_module.2"]
    stats = open_run(tmp_path / "r").layer_stats()
    assert sorted({r["layer"] for r in stats if r["layer"].endswith(".0")}) == ["trainable_module.0"]
    assert sorted({r["step"] for r in stats if r["layer"] == "trainable_module.0"}) == [0, 1, 2, 3]
