"""When the monitor reads gradients and where its steps end: closures (Lightning, LBFGS), gradient
accumulation, clipping, updates written by hand (no torch.optim), and the first recording's weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainguard
from trainguard import Monitor
from trainguard.store import open_run


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 8, generator=g)
    return x, x[:, :3].argmax(1)


def total_norm(model) -> float:
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()


def scalars(path, name):
    return open_run(path).scalars(name)[name]


def test_closure_gradients_belong_to_their_own_step(tmp_path):
    # Lightning's automatic optimisation runs training_step and backward inside optimizer.step(closure):
    # the gradients must be read when the closure returns, not before it runs (one step late).
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_loss, ref_norm = [], []
    with Monitor(model, tmp_path / "r", every=5, diagnose=False):
        for step in range(7):
            x, y = batch(step)

            def closure(x=x, y=y):
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                ref_loss.append(loss.item())
                ref_norm.append(total_norm(model))
                return loss

            opt.step(closure)
    norms = scalars(tmp_path / "r", "grad_norm")
    assert [s for s, _ in norms] == list(range(7))
    assert [v for _, v in norms] == pytest.approx(ref_norm, rel=1e-5)
    assert [v for _, v in scalars(tmp_path / "r", "loss")] == pytest.approx(ref_loss, rel=1e-6)


def test_closure_ops_are_forward_and_backward_not_optimizer(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainguard.record(tmp_path / "r", mode="no_tensor", buffer=-1):
        for step in range(2):
            x, y = batch(step)

            def closure(x=x, y=y):
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                return loss

            opt.step(closure)
    run = open_run(tmp_path / "r")
    execs = run.executions(begin=0, end=run.count())
    by_phase = {}
    for e in execs:
        by_phase.setdefault(e["phase"], set()).add(e["op"])
    assert any("addmm" in op for op in by_phase["forward"])
    assert any("mm" in op for op in by_phase["backward"])
    assert not any("addmm" in op or "log_softmax" in op for op in by_phase.get("optimizer", ()))
    assert any("add_" in op for op in by_phase["optimizer"])  # SGD's own update
    assert {e["step"] for e in execs if e["phase"] == "forward"} == {0, 1}


# found_inside_closure: ``trainguard monitor script.py`` (model=None) finds the model at its first
# forward; with LBFGS (pytorch/examples time_sequence_prediction) that forward runs inside
# optimizer.step(closure), after the optimizer's pre-hook: the closure's repeated backward
# passes must not end steps (they did: 6 steps for 3).
@pytest.mark.parametrize("found_inside_closure", [False, True])
def test_lbfgs_counts_one_step_and_the_first_closure_loss(tmp_path, found_inside_closure):
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    first_losses = []
    with Monitor(None if found_inside_closure else model, tmp_path / "r", every=1, diagnose=False) as mon:
        for step in range(3):
            x, y = batch(step)
            calls = []

            def closure(x=x, y=y, calls=calls):
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                calls.append(loss.item())
                return loss

            opt.step(closure)
            assert len(calls) > 1  # LBFGS evaluated the moved weights again
            first_losses.append(calls[0])
        assert mon.current_step == 3
    losses = scalars(tmp_path / "r", "loss")
    assert [s for s, _ in losses] == [0, 1, 2]
    assert [v for _, v in losses] == pytest.approx(first_losses, rel=1e-6)
    assert [s for s, _ in scalars(tmp_path / "r", "grad_norm")] == [0, 1, 2]


def test_a_gan_step_ends_after_the_generator_update_not_between_the_two(tmp_path):
    # pytorch/examples' dcgan: per iteration optimizerD.step() then optimizerG.step(). From the
    # second iteration on a step is one iteration, D's update and G's (not G's of the previous
    # iteration with D's of this one): the first iteration is split, steps 0 and 1.
    torch.manual_seed(0)
    gen, disc = nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 1), nn.Sigmoid(), nn.Flatten(0))
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-3)
    bce = nn.BCELoss()
    losses = []
    with Monitor({"gen": gen, "disc": disc}, tmp_path / "r", every=1, diagnose=False) as mon:
        for _ in range(5):
            real = torch.randn(16, 8)
            disc.zero_grad()
            err_real = bce(disc(real), torch.ones(16))
            err_real.backward()
            fake = gen(torch.randn(16, 4))
            err_fake = bce(disc(fake.detach()), torch.zeros(16))
            err_fake.backward()
            opt_d.step()
            gen.zero_grad()
            err_g = bce(disc(fake), torch.ones(16))
            err_g.backward()
            opt_g.step()
            losses.append((err_real + err_fake + err_g).item())
        assert mon.current_step == 5
    lrs = open_run(tmp_path / "r").scalars()
    lr_d, lr_g = ([s for s, v in lrs[k] if v == lr] for k, lr in (("lr/0", 1e-3), ("lr/1.0", 2e-3)))
    assert lr_d == [0, 1, 2, 3, 4] and lr_g == [1, 2, 3, 4]
    loss = dict(scalars(tmp_path / "r", "loss"))
    assert [loss[s] for s in (2, 3, 4)] == pytest.approx(losses[2:], rel=1e-5)


def test_layers_trained_one_after_another_by_their_own_optimizers_keep_counting_steps(tmp_path):
    # pytorch/examples' mnist_forward_forward: each layer has its own Adam and trains for its
    # epochs before the next layer starts. When the first optimizer stops, the next one ends steps
    # (from its second update: its first shares a step with it).
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Linear(8, 8)]
    opts = [torch.optim.Adam(la.parameters(), lr=1e-2) for la in layers]
    x = torch.randn(16, 8)
    with Monitor({"l0": layers[0], "l1": layers[1]}, tmp_path / "r", every=1, diagnose=False) as mon:
        h = x
        for layer, opt in zip(layers, opts):
            for _ in range(3):
                loss = layer(h).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            h = layer(h).detach()
        assert mon.current_step == 5
    assert [s for s, _ in scalars(tmp_path / "r", "loss")] == [0, 1, 2, 3, 4]


def test_the_step_where_the_next_layer_takes_over_holds_one_loss_and_no_separate_objectives(tmp_path):
    # pytorch/examples mnist_forward_forward/main.py (with layer(x) for layer.forward(x)): the step
    # where the second layer's Adam takes over holds its first two updates. It stored their
    # losses' sum (2.19 between 0.66 and 0.94 on synthetic MNIST: a spike that never was), and its
    # second backward, after the same optimizer's update, marked the whole run as summing separate
    # objectives (a GAN's), which turns every loss-trend rule off.
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Linear(8, 8)]
    opts = [torch.optim.Adam(la.parameters(), lr=1e-2) for la in layers]
    x = torch.randn(16, 8)
    losses = []
    with Monitor({"l0": layers[0], "l1": layers[1]}, tmp_path / "r", every=1, diagnose=False) as mon:
        h = x
        for layer, opt in zip(layers, opts):
            for _ in range(3):
                loss = layer(h).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            h = layer(h).detach()
        assert mon.current_step == 5
    stored = dict(scalars(tmp_path / "r", "loss"))
    # steps 0-2: the first layer's; step 3 its first two updates (the later one's loss), step 4 its third
    assert [stored[s] for s in range(5)] == pytest.approx(losses[:3] + losses[4:], rel=1e-6)
    with open_run(tmp_path / "r") as run:
        assert not run.meta["monitor"].get("separate_losses")


@pytest.mark.parametrize("clip,how", [(None, None), (0.05, "clip_grad_norm_"), (0.05, "get_total_norm")])
def test_accumulation_sums_the_micro_losses_and_reads_complete_gradients(tmp_path, clip, how):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_loss, ref_norm = [], []
    with Monitor(model, tmp_path / "r", every=2, diagnose=False):
        for step in range(5):
            opt.zero_grad()
            total = 0.0
            for micro in range(2):
                x, y = batch(10 * step + micro)
                loss = nn.functional.cross_entropy(model(x), y) / 2
                loss.backward()
                total += loss.item()
            ref_loss.append(total)
            ref_norm.append(total_norm(model))
            if how == "clip_grad_norm_":
                got = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            elif how == "get_total_norm":  # the two-call spelling accelerate >= 1.16 uses
                params = [p for p in model.parameters() if p.grad is not None]
                got = torch.nn.utils.get_total_norm([p.grad for p in params])
                torch.nn.utils.clip_grads_with_norm_(params, clip, got)
            if clip:
                assert got.item() == pytest.approx(ref_norm[-1], rel=1e-6)
            opt.step()
    # The norm before clipping (what clip_grad_norm_ returns and frameworks log), also at step 0,
    # where the monitor does not know yet that an optimizer will step.
    assert [v for _, v in scalars(tmp_path / "r", "grad_norm")] == pytest.approx(ref_norm, rel=1e-5)
    assert [v for _, v in scalars(tmp_path / "r", "loss")] == pytest.approx(ref_loss, rel=1e-6)
    # How the script clips, so that the diagnosis does not advise clipping to a loop that clips
    # already (found on karpathy/nanochat clipping at 0.1: a loss spike was told to clip at 8.3).
    clipping = open_run(tmp_path / "r").meta["monitor"].get("clipping")
    if how is None:
        assert clipping is None
    else:
        fn = "clip_grad_norm_" if how == "clip_grad_norm_" else "clip_grads_with_norm_"
        assert clipping == {"function": fn, "value": clip, "first_step": 0}


def test_accelerates_accumulation_gives_each_step_the_mean_of_its_micro_losses(tmp_path):
    # accelerate's examples/by_feature/gradient_accumulation.py and automatic_gradient_accumulation.py:
    # `with accelerator.accumulate(model): accelerator.backward(loss)`, which divides every
    # micro-batch's loss by gradient_accumulation_steps, also in an epoch's last step, which syncs
    # on fewer micro-batches when the loader's length is no multiple of it. That step's loss read
    # a third of the others' (a dip at every epoch's end).
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    try:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
        model = mlp()
        data = [batch(i) for i in range(7)]  # two steps of 3 micro-batches and one of 1 per epoch
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt, loader = accelerator.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=None))
        expected, micro = [], []
        with Monitor(model, tmp_path / "r", every=2, diagnose=False):
            for _ in range(2):
                for x, y in loader:
                    with accelerator.accumulate(model):
                        loss = nn.functional.cross_entropy(model(x), y)
                        accelerator.backward(loss)
                        micro.append(loss.item())
                        opt.step()
                        opt.zero_grad()
                    if accelerator.sync_gradients:
                        expected.append(sum(micro) / len(micro))
                        micro = []
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert len(expected) == 6
    assert [v for _, v in scalars(tmp_path / "r", "loss")] == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------------------------ updates written by hand
class _NoisedOptimizer(torch.optim.Optimizer):
    """The shape of Opacus' DPOptimizer (opacus/optimizers/optimizer.py): it wraps the user's optimizer
    without Optimizer.__init__ (so its own step has no hooks) and, in step(), replaces each p.grad
    with a clipped, noised one before calling the wrapped optimizer's step. The monitor read the
    noise (2.52 at every step of Opacus' MNIST example, whose gradients measured 0.4-0.7)."""

    def __init__(self, optimizer, noise: float):
        self.original_optimizer, self.noise = optimizer, noise

    @property
    def param_groups(self):
        return self.original_optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True):
        self.original_optimizer.zero_grad(set_to_none)

    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = p.grad.clamp(-0.01, 0.01) + self.noise * torch.randn_like(p)
        return self.original_optimizer.step()


def test_gradients_a_wrapping_optimizer_replaces_are_read_as_backward_left_them(tmp_path):
    model = mlp()
    opt = _NoisedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), noise=1.0)
    ref = []
    with Monitor(model, tmp_path / "r", every=2, diagnose=False):
        for step in range(6):
            opt.zero_grad()
            x, y = batch(step)
            nn.functional.cross_entropy(model(x), y).backward()
            ref.append(total_norm(model))
            opt.step()
    assert [v for _, v in scalars(tmp_path / "r", "grad_norm")] == pytest.approx(ref, rel=1e-5)
    assert open_run(tmp_path / "r").meta["monitor"]["gradients_replaced"] is True


class RNNModel(nn.Module):
    """pytorch/examples word_language_model/model.py (RNNModel, LSTM), shrunk: embedding, LSTM,
    dropout, linear decoder, log_softmax."""

    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers, self.ntoken = nhid, nlayers, ntoken
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, x, hidden):
        emb = self.drop(self.encoder(x))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        w = next(self.parameters())
        return (w.new_zeros(self.nlayers, bsz, self.nhid), w.new_zeros(self.nlayers, bsz, self.nhid))


def word_lm_train(batches: int, lr: float = 20.0, clip: float = 0.25, seed: int = 0):
    """word_language_model/main.py's train(): model.zero_grad(), backward, clip, p.data.add_(p.grad, alpha=-lr)."""
    torch.manual_seed(seed)
    ntokens, bptt, bsz = 40, 8, 4
    # A corpus with structure to learn: each column repeats a short random phrase.
    phrase = torch.randint(0, ntokens, (7,))
    data = phrase.repeat(batches * bptt // 7 + 2)[: batches * bptt + 1 + bsz].unfold(0, bsz, 1)[: batches * bptt + 1]
    model = RNNModel(ntokens, 16, 16, 2)
    criterion = nn.NLLLoss()
    initial = {n: p.detach().norm().item() for n, p in model.named_parameters()}
    model.train()
    hidden = model.init_hidden(bsz)
    losses, norms = [], []
    for i in range(0, batches * bptt, bptt):
        x, target = data[i:i + bptt], data[i + 1:i + 1 + bptt].reshape(-1)
        model.zero_grad()
        hidden = tuple(h.detach() for h in hidden)
        output, hidden = model(x, hidden)
        loss = criterion(output, target)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        losses.append(loss.item())
    return model, initial, losses, norms


def test_hand_written_sgd_counts_every_update(tmp_path):
    with Monitor(None, tmp_path / "r", every=10) as mon:
        model, initial, losses, norms = word_lm_train(85)
    loss = scalars(tmp_path / "r", "loss")
    assert [s for s, _ in loss] == list(range(85))
    assert [v for _, v in loss] == pytest.approx(losses, rel=1e-5)
    assert [v for _, v in scalars(tmp_path / "r", "grad_norm")] == pytest.approx(norms, rel=1e-5)
    run = open_run(tmp_path / "r")
    # Weight norms are taken before the update: step 0's are the initial weights (lr=20 moves the
    # LSTM's weights far in one step, which made "started with RMS 19" claims before).
    w0 = {r["layer"]: r["value"] for r in run.layer_stats(kind="weight", stat="norm") if r["step"] == 0}
    assert w0 == pytest.approx(initial, rel=1e-5)
    assert run.meta["monitor"]["weights_initial"] is True
    upd = {r["layer"]: r["value"] for r in run.layer_stats(kind="update", stat="norm") if r["step"] == 10}
    assert upd["decoder.weight"] > 0  # the hand-written update is measured too
    assert mon.current_step == 84  # the last step, closed with the monitor
    assert [f.kind for f in mon.findings] == ["healthy"]  # the phrase is learnt
    assert "over 85 steps" in mon.findings[0].title


def test_hand_written_accumulation_is_one_step(tmp_path):
    model = mlp()
    with Monitor(model, tmp_path / "r", every=1, diagnose=False):
        for step in range(4):
            for micro in range(3):
                x, y = batch(10 * step + micro)
                nn.functional.cross_entropy(model(x), y).div(3).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    assert [s for s, _ in scalars(tmp_path / "r", "loss")] == [0, 1, 2, 3]


def test_few_steps_are_insufficient_data_even_with_layer_statistics(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, tmp_path / "r", every=1) as mon:
        for step in range(7):
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert [f.kind for f in mon.findings] == ["insufficient_data"]
    assert "7 step(s) with a loss, 20 needed" in mon.findings[0].title


def test_a_crashed_run_is_never_healthy(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="out of data"):
        with Monitor(model, tmp_path / "r", every=5) as mon:
            for step in range(40):
                x, y = batch(step)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            raise RuntimeError("out of data")
    kinds = [f.kind for f in mon.findings]
    assert "healthy" not in kinds and kinds[0] == "script_crashed"
    assert mon.findings[0].severity == "error"
    assert mon.findings[0].title == "The script crashed at step 40: RuntimeError: out of data"
    run = open_run(tmp_path / "r")
    # Stored as ``trainguard run`` stores a crash: one record, read by the report and the UI too.
    assert (run.status, run.meta["error"], run.meta["crash_step"]) == ("crashed", "RuntimeError: out of data", 40)
    assert run.meta["monitor"]["status"] == "crashed"


DIES_OPEN = """
import sys
import torch
from torch import nn
import trainguard

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if sys.argv[2] == "monitor":
    trainguard.Monitor(model, sys.argv[1], every=5)  # no with-block, no close()
else:
    trainguard.enable(sys.argv[1])
for step in range(30):
    x = torch.randn(16, 8)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), x[:, :3].argmax(1)).backward()
    opt.step()
    if step == 24:
        raise RuntimeError("out of data")
"""


@pytest.mark.parametrize("opened", ["monitor", "enable"])
def test_a_script_that_dies_with_trainguard_open_is_stored_as_crashed(tmp_path, opened):
    # Closed at interpreter exit, not by the script: the exit handlers must still see the error.
    import subprocess
    import sys

    script = tmp_path / "dies.py"
    script.write_text(DIES_OPEN)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "r"), opened], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1 and "RuntimeError: out of data" in proc.stderr  # the traceback still shows
    run = open_run(tmp_path / "r")
    assert (run.status, run.meta["error"], run.meta["crash_step"]) == ("crashed", "RuntimeError: out of data", 25)


def test_resumed_weights_are_not_called_initial(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):  # trained before the monitor starts: the optimizer holds momentum
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    with Monitor(model, tmp_path / "r", every=5, diagnose=False):
        x, y = batch(9)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert open_run(tmp_path / "r").meta["monitor"]["weights_initial"] is False


def test_a_monitor_started_mid_training_can_start_at_the_loops_step(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, tmp_path / "r", every=5, diagnose=False, start_step=4000):
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    run = open_run(tmp_path / "r")
    assert [s for s, _ in run.scalars("loss")["loss"]] == [4000, 4001, 4002]
    assert run.meta["monitor"]["weights_initial"] is False
    with pytest.raises(ValueError, match="start_step must be a non-negative int, got -1"):
        Monitor(model, tmp_path / "bad", start_step=-1)


def test_a_step_the_framework_clock_jumped_over_records_no_weights(tmp_path):
    # trainguard run --monitor on a resumed Lightning script: the monitor opens at step 0 (a
    # recording step), then the framework's global_step (12) takes over before anything trained.
    from trainguard.capture import drive_step, release_step

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with Monitor(model, tmp_path / "r", every=5, diagnose=False):
            drive_step(12)
            for step in range(12, 16):
                x, y = batch(step)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                drive_step(step + 1)
    finally:
        release_step()
    run = open_run(tmp_path / "r")
    assert sorted({r["step"] for r in run.layer_stats()}) == [15]
    assert run.meta["monitor"]["weights_initial"] is False


def test_a_gans_summed_losses_are_not_judged_as_one_loss(tmp_path):
    # A step of a GAN loop holds the discriminator's losses and the generator's, each followed by
    # its own optimizer's update: their sum is no loss to fit, and its rise is no divergence (on
    # main this loop got "Learning rate too high: the smoothed loss rose to 2.65 by step 1").
    torch.manual_seed(0)
    gen, disc = nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 1), nn.Flatten(0))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    with trainguard.Monitor({"gen": gen, "disc": disc}, tmp_path / "r", every=5) as mon:
        for _ in range(30):
            g_loss = disc(gen(torch.randn(16, 4))).sub(1).pow(2).mean()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            d_loss = disc(torch.randn(16, 8)).sub(1).pow(2).mean() + disc(gen(torch.randn(16, 4)).detach()).pow(2).mean()
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
    kinds = {f.kind for f in mon.findings}
    assert "losses_summed" in kinds
    assert not kinds & {"lr_too_high", "loss_not_decreasing", "loss_oscillating", "loss_spike"}, kinds


def test_a_backward_given_a_scalar_gradient_counts_that_objective(tmp_path):
    # caogang/wgan-gp gan_toy.py: the critic maximises D(real) with D_real.backward(mone) (mone =
    # -1), minimises D(fake) with D_fake.backward(one), and adds a gradient penalty (backward()
    # with no argument). The monitor took only the penalty as the loss, whose rise as the critic
    # sharpens read "learning rate too high"; a backward(c) of a scalar minimises c * it.
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))
    critic = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
    opt_d = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.5, 0.9))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-4, betas=(0.5, 0.9))
    one, mone = torch.tensor(1.0), torch.tensor(-1.0)
    seen = []
    with trainguard.Monitor({"gen": gen, "critic": critic}, tmp_path / "r", every=5) as mon:
        for _ in range(25):
            real = torch.randn(64, 2) * 0.02 + 2.0
            critic.zero_grad()
            d_real = critic(real).mean()
            d_real.backward(mone)
            with torch.no_grad():
                fake = gen(torch.randn(64, 2))
            d_fake = critic(fake).mean()
            d_fake.backward(one)
            alpha = torch.rand(64, 1)
            mid = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
            grads = torch.autograd.grad(critic(mid), mid, torch.ones(64, 1), create_graph=True)[0]
            penalty = ((grads.norm(2, dim=1) - 1) ** 2).mean() * 0.1
            penalty.backward()
            opt_d.step()
            seen.append(float(d_fake - d_real + penalty))
            gen.zero_grad()
            g = critic(gen(torch.randn(64, 2))).mean()
            g.backward(mone)
            opt_g.step()
            seen[-1] -= float(g)
    losses = [v for _, v in open_run(tmp_path / "r").scalars("loss")["loss"]]
    # each step: the critic's cost (-D(real) + D(fake) + penalty) plus the generator's -D(G(z))
    # (the first generator loss goes to step 1: where a step ends is learnt on the first one)
    assert losses[2:] == pytest.approx(seen[2:], abs=1e-5)
    assert sum(losses[:2]) == pytest.approx(sum(seen[:2]), abs=1e-5)
    kinds = {f.kind for f in mon.findings}
    assert "losses_summed" in kinds and "lr_too_high" not in kinds, kinds


def test_accumulated_micro_batches_with_two_optimizers_are_one_loss(tmp_path):
    # Two optimizers over parameter groups after accumulated backward passes: one objective.
    model = mlp()
    opts = [torch.optim.SGD(list(model.parameters())[:2], lr=0.1), torch.optim.Adam(list(model.parameters())[2:])]
    with trainguard.Monitor(model, tmp_path / "r", every=5) as mon:
        for step in range(25):
            for o in opts:
                o.zero_grad()
            for micro in range(2):
                x, y = batch(10 * step + micro)
                (nn.functional.cross_entropy(model(x), y) / 2).backward()
            for o in opts:
                o.step()
    assert "losses_summed" not in {f.kind for f in mon.findings}


class _FFLayer(nn.Linear):
    """pytorch/examples mnist_forward_forward/main.py's Layer (its ``train`` named ``fit`` here,
    and ``self(x)`` for ``self.forward(x)``, which the monitor needs to see the layer)."""

    def __init__(self, n_in, n_out):
        super().__init__(n_in, n_out)
        self.opt = torch.optim.Adam(self.parameters(), lr=0.03)

    def forward(self, x):
        x_direction = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return torch.relu(torch.mm(x_direction, self.weight.T) + self.bias.unsqueeze(0))

    def fit(self, x_pos, x_neg, epochs):
        for _ in range(epochs):
            g_pos, g_neg = self(x_pos).pow(2).mean(1), self(x_neg).pow(2).mean(1)
            loss = torch.log1p(torch.exp(torch.cat([-g_pos + 2, g_neg - 2]))).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        return self(x_pos).detach(), self(x_neg).detach()


def test_layers_trained_in_sequence_are_not_judged_as_one_loss_curve(tmp_path):
    """Each forward-forward layer has its own loss: the run's loss is one curve per layer, the
    next starting high again. Judged as one curve, the first layer's start against the second's
    end read as little progress, and with Adam's first step (every weight moved by about lr, 0.03,
    more than their initial size) lr_too_high said to lower the example's rate 1000x; a lower rate
    trains worse there (train error 0.21 at 0.003 against 0 at 0.03, synthetic MNIST)."""
    torch.manual_seed(0)
    protos = (torch.rand(10, 64) < 0.3).float()
    y = torch.randint(0, 10, (256,))
    x = protos[y] + 0.1 * torch.randn(256, 64)
    pos, neg = x.clone(), x.clone()
    pos[:, :10], neg[:, :10] = 0, 0
    pos[range(256), y] = x.max()
    neg[range(256), (y + torch.randint(1, 10, (256,))) % 10] = x.max()
    with Monitor(None, tmp_path / "r", every=5) as mon:
        for layer in [_FFLayer(64, 64), _FFLayer(64, 64)]:
            pos, neg = layer.fit(pos, neg, 30)
    kinds = {f.kind: f.severity for f in mon.findings}
    assert not [k for k, s in kinds.items() if s in ("warning", "error", "critical")], kinds
    assert kinds.get("objectives_in_sequence") == "info" and "losses_summed" not in kinds, kinds


def test_an_optimizer_of_a_bare_parameter_takes_no_optimizer_index_from_the_models(tmp_path):
    # stable-baselines3's SAC (stable_baselines3/sac/sac.py:SAC.train): per gradient step the entropy
    # coefficient's Adam steps first (log_ent_coef, a bare tensor in no module), then the critic's,
    # then the actor's. The entropy optimizer took index 0, so the critic's rate was stored as
    # "lr/1.0" and the actor's as "lr/2.0", with no "lr/0": SAC at learning_rate=1.0 was told
    # "lower the learning rate about 10x" with no rate named.
    torch.manual_seed(0)
    actor, critic = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 1)), nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    target = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    target.load_state_dict(critic.state_dict())
    log_ent_coef = torch.zeros(1, requires_grad=True)
    ent_opt = torch.optim.Adam([log_ent_coef], lr=3e-4)
    critic_opt, actor_opt = torch.optim.Adam(critic.parameters(), lr=1e-3), torch.optim.Adam(actor.parameters(), lr=2e-3)
    with Monitor(None, tmp_path / "r", every=1, diagnose=False) as mon:
        for _ in range(4):
            obs, act, nxt = torch.randn(8, 3), torch.randn(8, 1), torch.randn(8, 3)
            pi = torch.tanh(actor(obs))
            ent_loss = -(log_ent_coef * (pi.detach() ** 2 - 1)).mean()
            ent_opt.zero_grad()
            ent_loss.backward()
            ent_opt.step()
            with torch.no_grad():
                q_target = target(torch.cat([nxt, torch.tanh(actor(nxt))], 1))
            critic_loss = nn.functional.mse_loss(critic(torch.cat([obs, act], 1)), q_target)
            critic_opt.zero_grad()
            critic_loss.backward()
            critic_opt.step()
            actor_loss = -critic(torch.cat([obs, pi], 1)).mean()
            actor_opt.zero_grad()
            actor_loss.backward()
            actor_opt.step()
        assert mon.current_step == 4
    lrs = {k: {v for _, v in s} for k, s in open_run(tmp_path / "r").scalars().items() if k.startswith("lr/")}
    assert lrs == {"lr/0": {1e-3}, "lr/1.0": {2e-3}}, lrs


def test_delayed_actor_updates_are_not_called_forward_forward(tmp_path):
    """cleanrl's sac_continuous_action.py: the critic's Adam steps every step, the actor's
    (policy_frequency=2) twice every 2nd step, each after a backward of its own loss. The finding
    said "layers trained one after another ... as in forward-forward", untrue of SAC: it says what
    it saw, optimizers stepping in turn on different parameters, each after its own loss."""
    torch.manual_seed(0)
    qf = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 1))
    actor = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1), nn.Tanh())
    q_opt = torch.optim.Adam(qf.parameters(), lr=1e-3)
    a_opt = torch.optim.Adam(actor.parameters(), lr=3e-4)
    with Monitor(nn.ModuleDict({"qf": qf, "actor": actor}), tmp_path / "r", every=5) as mon:
        for step in range(24):
            g = torch.Generator().manual_seed(step)
            obs, act, target = torch.randn(32, 4, generator=g), torch.rand(32, 1, generator=g) * 2 - 1, \
                torch.randn(32, 1, generator=g)
            q_loss = nn.functional.mse_loss(qf(torch.cat([obs, act], 1)), target)
            q_opt.zero_grad()
            q_loss.backward()
            q_opt.step()
            if step % 2 == 0:
                for _ in range(2):
                    a_loss = -qf(torch.cat([obs, actor(obs)], 1)).mean()
                    a_opt.zero_grad()
                    a_loss.backward()
                    a_opt.step()
    found = [f for f in mon.findings if f.kind == "objectives_in_sequence"]
    assert len(found) == 1 and found[0].severity == "info", [f.kind for f in mon.findings]
    text = found[0].title + " " + found[0].suggestion
    # what it saw first; forward-forward only as one example beside SAC's
    assert not found[0].title.startswith("Another optimizer took over"), found[0].title
    assert "stepped in turn on different parameters" in found[0].title and "SAC" in found[0].title, text
    assert found[0].evidence["takeover_step"] == 1, found[0].evidence
