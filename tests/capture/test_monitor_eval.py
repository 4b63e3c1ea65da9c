"""The validation pass under the monitor: its loss and accuracy per step, the mode it is seen in,
and the signatures of sampled input rows that find validation copies of training samples."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from ts_models import DLinear

from trainguard import Monitor
from trainguard.capture import _monitor_eval, _monitor_leak
from trainguard.store import open_run


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))


def data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, x[:, :3].argmax(1)


def train(model, opt, steps: int, seed: int = 0):
    for s in range(steps):
        x, y = data(32, 1000 * seed + s)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def scalars(path, name):
    with open_run(path) as run:
        return run.scalars(name).get(name, [])


@pytest.mark.parametrize("style", ["functional", "module", "sum", "none"])
def test_validation_loss_and_accuracy_match_a_reference(tmp_path, style):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xv, yv = data(100, 99)
    ref = {}
    with Monitor(model, tmp_path / "run", every=5, diagnose=False):
        for epoch in range(3):
            train(model, opt, 10, seed=epoch)
            model.eval()
            with torch.no_grad():
                total, correct = 0.0, 0
                for i in range(0, 100, 40):  # batches of 40, 40, 20: the mean is per sample
                    out = model(xv[i : i + 40])
                    t = yv[i : i + 40]
                    if style == "functional":
                        total += F.cross_entropy(out, t).item() * len(t)
                    elif style == "module":
                        total += nn.CrossEntropyLoss()(out, t).item() * len(t)
                    elif style == "sum":
                        total += F.cross_entropy(out, t, reduction="sum").item()
                    else:
                        total += F.cross_entropy(out, t, reduction="none").sum().item()
                    correct += int((out.argmax(1) == t).sum())
            model.train()
            ref[10 * (epoch + 1)] = (total / 100, correct / 100)
    loss = dict(scalars(tmp_path / "run", "val_loss"))
    acc = dict(scalars(tmp_path / "run", "val_accuracy"))
    assert sorted(loss) == sorted(ref) == sorted(acc)
    for step, (want_loss, want_acc) in ref.items():
        assert loss[step] == pytest.approx(want_loss, rel=1e-5)
        assert acc[step] == pytest.approx(want_acc, abs=1e-6)
    with open_run(tmp_path / "run") as run:
        val = run.meta["monitor"]["validation"]
    assert val["loss_fn"] == "cross_entropy" and val["classes"] == 3 and val["batches"] == 9
    assert val["label_counts"] == (3 * torch.bincount(yv, minlength=3)).tolist()


def test_training_losses_are_not_validation(tmp_path):
    """Training in eval mode (the eval_mode_training bug) is training: its backward says so."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, tmp_path / "run", every=5, diagnose=False):
        model.eval()
        train(model, opt, 12)
    assert scalars(tmp_path / "run", "val_loss") == []
    assert scalars(tmp_path / "run", "loss")


def test_eval_mode_without_no_grad_is_validation(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xv, yv = data(50, 5)
    with Monitor(model, tmp_path / "run", every=5, diagnose=False):
        train(model, opt, 5)
        model.eval()
        want = F.cross_entropy(model(xv), yv).item()
        model.train()
        train(model, opt, 5)
    assert scalars(tmp_path / "run", "val_loss") == [(5, pytest.approx(want, rel=1e-5))]


def test_an_evaluation_after_the_last_step_is_kept(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xv, yv = data(50, 5)
    with Monitor(model, tmp_path / "run", every=5, diagnose=False):
        train(model, opt, 7)
        with torch.no_grad():
            want = F.nll_loss(F.log_softmax(model(xv), 1), yv).item()
    assert scalars(tmp_path / "run", "val_loss") == [(7, pytest.approx(want, rel=1e-5))]


@pytest.mark.parametrize("attach", ["model", "discovered"])
def test_an_evaluation_before_the_first_step_is_kept(tmp_path, attach):
    # karpathy/llm.c train_gpt2.py and nanoGPT evaluate at iteration 0, before training: the loss
    # at initialisation is step 0's validation loss (it was lost).
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xv, yv = data(50, 5)
    want = []
    with Monitor(model if attach == "model" else None, tmp_path / "run", every=5, diagnose=False):
        for step in range(4):
            if step % 3 == 0:
                model.eval()
                with torch.no_grad():
                    want.append((step, F.cross_entropy(model(xv), yv).item()))
                model.train()
            train(model, opt, 1, seed=step)
    assert scalars(tmp_path / "run", "val_loss") == [(s, pytest.approx(v, rel=1e-5)) for s, v in want]


def test_losses_are_unwrapped_when_the_last_monitor_closes(tmp_path):
    before = F.cross_entropy
    with Monitor(mlp(), tmp_path / "a", diagnose=False):
        assert F.cross_entropy is not before and F.cross_entropy.__wrapped__ is before
        with Monitor(mlp(), tmp_path / "b", diagnose=False):
            pass
        assert F.cross_entropy is not before
    assert F.cross_entropy is before and not _monitor_eval._listeners


def test_validation_off(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = F.cross_entropy
    with Monitor(model, tmp_path / "run", every=5, diagnose=False, validation=False):
        assert F.cross_entropy is before
        train(model, opt, 5)
        with torch.no_grad():
            F.cross_entropy(model(data(10, 1)[0]), data(10, 1)[1])
    assert scalars(tmp_path / "run", "val_loss") == []


def leak_summary(tmp_path, copies: int, train_eval: bool = False):
    """Train on a fixed set of 512 rows; validate on 256 rows of which ``copies`` are training rows."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    xt, yt = data(512, 1)
    xv, yv = data(256, 2)
    xv[:copies] = xt[torch.randperm(512)[:copies]]
    with Monitor(model, tmp_path / "run", every=5, diagnose=False):
        for _ in range(2):
            for i in range(0, 512, 64):
                opt.zero_grad()
                F.cross_entropy(model(xt[i : i + 64]), yt[i : i + 64]).backward()
                opt.step()
            with torch.no_grad():
                if train_eval:
                    for i in range(0, 512, 128):
                        model(xt[i : i + 128])
                for i in range(0, 256, 128):
                    model(xv[i : i + 128])
    with open_run(tmp_path / "run") as run:
        return run.meta["monitor"]["validation"]["leak"]


def test_leak_hashing_finds_the_copied_rows(tmp_path):
    leak = leak_summary(tmp_path, copies=40)
    assert leak["train_rows"] == 1024 and leak["eval_rows"] == 512
    close = [d for b in leak["batches"] for d in b["close"] if d < 0.05]
    assert len(close) == 40 and max(close) == 0  # 40 copies; the second pass evaluates the same rows again
    assert [b["seen_before"] for b in leak["batches"]] == [0, 0, 128, 128]
    assert [b["pass"] for b in leak["batches"]] == [1, 1, 2, 2]


def test_leak_hashing_finds_no_copies_in_fresh_data(tmp_path):
    leak = leak_summary(tmp_path, copies=0)
    # in 8 dimensions some unrelated rows are neighbours (about 0.2 of the typical distance)
    assert min((d for b in leak["batches"] for d in b["close"]), default=1) > 0.1


def test_leak_hashing_is_bounded(tmp_path):
    watch = _monitor_leak.LeakWatch()
    x = torch.randn(1000, 20)
    for step in range(200):
        watch.on_forward(x, evaluating=False, step=step)
        watch.on_forward(x, evaluating=True, step=step)
    (sk,) = watch._sketches.values()
    assert sk.n_train == _monitor_leak.TRAIN_ROWS and sk.n_eval == _monitor_leak.EVAL_ROWS
    assert sum(b[3] for b in sk.batches) == _monitor_leak.EVAL_ROWS
    summary = watch.summary()
    # every evaluated row is one of the first 256 rows, all of which were trained on
    assert all(len(b["close"]) + b["seen_before"] == b["rows"] for b in summary["batches"])
    assert all(math.isfinite(d) for b in summary["batches"] for d in b["close"])


def test_scalar_inputs_are_not_hashed():
    watch = _monitor_leak.LeakWatch()
    watch.on_forward(torch.randn(64, 1), evaluating=False, step=0)
    watch.on_forward(torch.randint(0, 5, (64,)), evaluating=True, step=0)
    assert watch.summary() is None


def test_the_validation_watch_reads_nothing_back_before_close(tmp_path, monkeypatch):
    """On an accelerator every read of a device value is a sync: the validation watch (losses,
    accuracy, label counts, row signatures) adds none while training and evaluating; it reads its
    sums once, when the monitor closes. Counted against the same loop with the watch off."""
    reads = {"n": 0}
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"):
        orig = getattr(torch.Tensor, name)

        def counting(self, *a, _orig=orig, **k):
            reads["n"] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counting)

    def loop(validation: bool) -> int:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        xv, yv = data(64, 3)
        mon = Monitor(model, tmp_path / f"run-{validation}", every=5, diagnose=False, validation=validation)
        reads["n"] = 0
        for epoch in range(3):
            train(model, opt, 10, seed=epoch)
            model.eval()
            with torch.no_grad():
                F.cross_entropy(model(xv), yv)
                nn.NLLLoss()(F.log_softmax(model(xv), 1), yv)
            model.train()
        n = reads["n"]
        mon.close()
        return n

    assert loop(validation=True) == loop(validation=False)


def test_a_target_network_under_no_grad_inside_a_training_step_is_not_validation(tmp_path):
    """DQN-style: the target network runs under no_grad inside each training step, and the loss
    that follows is a training loss; neither its value nor its input rows are validation."""
    torch.manual_seed(0)
    qnet, target = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), nn.Linear(8, 3)
    opt = torch.optim.SGD(qnet.parameters(), lr=0.01)
    states = torch.randn(64, 8)
    with Monitor(None, tmp_path / "run", every=5, diagnose=False):
        for _ in range(12):
            s, s_next = states[torch.randint(0, 64, (16,))], states[torch.randint(0, 64, (16,))]
            q = qnet(s)
            with torch.no_grad():
                y = target(s_next)
            opt.zero_grad()
            F.mse_loss(q, y).backward()
            opt.step()
    assert scalars(tmp_path / "run", "val_loss") == []
    with open_run(tmp_path / "run") as run:
        assert run.meta["monitor"]["validation"]["leak"] is None


def test_a_target_network_is_not_said_to_miss_its_gradients(tmp_path):
    """The PyTorch DQN tutorial's target network: a copy of the policy network, soft-updated by
    hand, run under no_grad, in no optimizer, with requires_grad left True. It got "6 trainable
    parameter(s) never received a gradient", whose fix (look for .detach() or no_grad) is wrong."""
    torch.manual_seed(0)

    def dqn():
        return nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

    policy, target = dqn(), dqn()
    target.load_state_dict(policy.state_dict())
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3, amsgrad=True)
    with Monitor(None, tmp_path / "run", every=5) as mon:
        for _ in range(30):
            with torch.no_grad():  # acting
                policy(torch.randn(1, 4)).max(1)
            s, a, r, s2 = torch.randn(16, 4), torch.randint(0, 2, (16, 1)), torch.randn(16), torch.randn(16, 4)
            q = policy(s).gather(1, a)
            with torch.no_grad():
                expected = r + 0.99 * target(s2).max(1).values
            loss = nn.SmoothL1Loss()(q, expected.unsqueeze(1))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_value_(policy.parameters(), 100)
            opt.step()
            tsd, psd = target.state_dict(), policy.state_dict()
            for k in psd:
                tsd[k] = psd[k] * 0.005 + tsd[k] * 0.995
            target.load_state_dict(tsd)
    problems = [(f.kind, f.title) for f in mon.findings if f.is_problem]
    assert problems == [], problems
    untrained = [f for f in mon.findings if f.kind == "model_not_trained"]
    assert len(untrained) == 1 and untrained[0].evidence["model"] == "target", untrained  # the loop's variable


def test_a_loss_computed_after_the_no_grad_block_is_validation(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xv, yv = data(50, 5)
    with Monitor(model, tmp_path / "run", every=5, diagnose=False):
        train(model, opt, 5)
        with torch.no_grad():
            out = model(xv)
        want = F.cross_entropy(out, yv).item()
        train(model, opt, 5)
    assert scalars(tmp_path / "run", "val_loss") == [(5, pytest.approx(want, rel=1e-5))]


def _evaluate(model, x, y, mask):
    """pytorch/examples gcn/main.py's test(): one forward over the whole graph, the loss over the
    rows of one mask; its loop calls it for the training rows, then for the validation rows."""
    model.eval()
    with torch.no_grad():
        out = model(x)
        loss = F.cross_entropy(out[mask], y[mask])
    model.train()
    return loss.item()


def test_an_evaluation_of_the_training_rows_before_the_validation_rows_is_not_averaged_in(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = data(60, 5)
    y[40:] = torch.randint(0, 3, (20,), generator=torch.Generator().manual_seed(1))  # unlearnable rows
    train_rows = torch.arange(60) < 40
    wanted = []
    with Monitor(model, tmp_path / "run", every=1, diagnose=False):
        for _ in range(4):
            opt.zero_grad()
            F.cross_entropy(model(x)[train_rows], y[train_rows]).backward()
            opt.step()
            _evaluate(model, x, y, train_rows)
            wanted.append(_evaluate(model, x, y, ~train_rows))
    got = [v for _, v in scalars(tmp_path / "run", "val_loss")]
    assert got == pytest.approx(wanted, rel=1e-5)
    with open_run(tmp_path / "run") as run:
        assert run.meta["monitor"]["validation"]["passes"] == 2


class _CharModel(nn.Module):
    """karpathy/makemore makemore.py's Bigram, smaller: token ids in, per-position logits out, and
    the loss inside ``forward`` with ``ignore_index=-1`` for the padding after a word."""

    def __init__(self, vocab: int = 27):
        super().__init__()
        self.logits = nn.Embedding(vocab, vocab)

    def forward(self, idx, targets=None):
        logits = self.logits(idx)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def _encode(words, width: int = 12):
    """makemore's CharDataset: ``x`` = <START> then the letters, ``y`` = the letters then <STOP>,
    -1 after it."""
    x = torch.zeros(len(words), width, dtype=torch.long)
    y = torch.full((len(words), width), -1, dtype=torch.long)
    for i, w in enumerate(words):
        ix = torch.tensor([ord(c) - 96 for c in w])
        x[i, 1 : 1 + len(ix)] = ix
        y[i, : len(ix)] = ix
        y[i, len(ix)] = 0
    return x, y


def _words(n: int, seed: int, shortest: int = 3):
    """``n`` distinct random words of ``shortest`` to 9 letters."""
    g = torch.Generator().manual_seed(seed)
    words = {"".join(chr(97 + int(c)) for c in torch.randint(0, 26, (int(k),), generator=g))
             for k in torch.randint(shortest, 10, (2 * n,), generator=g)}
    return sorted(words)[:n]


def _makemore_evaluate(model, x, y, batch_size=100):
    """makemore's evaluate(): inference mode, eval mode, the mean of the batch losses."""
    model.eval()
    with torch.inference_mode():
        losses = [model(x[i : i + batch_size], y[i : i + batch_size])[1].item() for i in range(0, len(x), batch_size)]
    model.train()
    return sum(losses) / len(losses)


def _makemore_findings(tmp_path, train_words, test_words, steps=40):
    """makemore's loop: batches of 32 drawn with replacement (its InfiniteDataLoader), then at one
    step ``evaluate(model, train_dataset)`` and ``evaluate(model, test_dataset)`` from two lines."""
    torch.manual_seed(0)
    model = _CharModel()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    xt, yt = _encode(train_words)
    xv, yv = _encode(test_words)
    with Monitor(model, tmp_path / "run", every=10) as mon:
        for step in range(steps):
            i = torch.randint(0, len(xt), (32,))
            _, loss = model(xt[i], yt[i])
            model.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step == steps // 2:
                _makemore_evaluate(model, xt, yt)
                _makemore_evaluate(model, xv, yv)
    return mon.findings


def test_an_evaluation_of_the_training_set_before_the_test_set_is_not_leakage(tmp_path):
    """makemore evaluates the training set and then the test set: the rows of the first pass are
    the training data (the half of it trained on so far: batches drawn with replacement), the test
    set holds none of them. Only the validation pass, the last to start (as for ``val_loss``), is
    judged for copies; before, both evaluations were one pass and half the rows were "copies"."""
    words = _words(1300, seed=1, shortest=6)  # long enough that no test word is a training word's neighbour
    words = [words[i] for i in torch.randperm(1300, generator=torch.Generator().manual_seed(2))]
    findings = _makemore_findings(tmp_path, words[:1000], words[1000:])
    assert [f.kind for f in findings if f.is_problem] == []
    with open_run(tmp_path / "run") as run:
        leak = run.meta["monitor"]["validation"]["leak"]
    assert sorted({b["pass"] for b in leak["batches"]}) == [1, 2]


def test_token_sequences_one_letter_apart_are_not_copies(tmp_path):
    """Token ids have no distance: "adriana" is not a near copy of "adrian" because its ids differ
    from it by 1 in one position (makemore's names.txt holds many such pairs: 20 of the 200 test
    names of its first 2,000 lines were "near copies" of training names). For integer inputs only
    exact copies count."""
    words = _words(1150, seed=1, shortest=6)
    train = words[:1000]
    test = words[1000:] + [w + "a" for w in train[:50] if len(w) < 9]
    findings = _makemore_findings(tmp_path, train, test)
    assert [f.kind for f in findings if f.is_problem] == []
    # an exact copy of a training name still is one
    findings = _makemore_findings(tmp_path / "copies", train, words[1000:] + train[:50])
    (leak,) = [f for f in findings if f.kind == "train_val_leakage"]
    # the batches, drawn with replacement, trained on about 3/4 of the training names
    assert leak.evidence["exact_copies"] >= 30 and leak.evidence["near_copies"] == 0


def _evaluate_every_10_steps(tmp_path, copies: int):
    """A fixed validation set of 64 token rows, ``copies`` of them also in the training data,
    evaluated every 10 steps, as the loop written for johnma2006/mamba-minimal's model does (a
    noise-free sequence of its synthetic data occurs in both splits)."""
    torch.manual_seed(0)
    model = _CharModel(64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    xt, xv = torch.randint(0, 64, (640, 33), generator=g), torch.randint(0, 64, (64, 33), generator=g)
    xv[:copies] = xt[:copies]
    with Monitor(model, tmp_path / "run", every=10) as mon:
        for step in range(40):
            x = xt[16 * step : 16 * step + 16]
            _, loss = model(x[:, :-1], x[:, 1:].contiguous())
            opt.zero_grad()
            loss.backward()
            opt.step()
            if (step + 1) % 10 == 0:
                with torch.no_grad():
                    model(xv[:, :-1], xv[:, 1:].contiguous())
    return mon.findings


def test_a_validation_set_evaluated_again_counts_its_copies_once(tmp_path):
    """``leak_min_rows``: one or two copies can be chance. A validation row evaluated at each of
    four evaluations is one sample: the one copy of the mamba loop's validation set read as 4 of
    256 rows, above the limit. Repeats of a validation row are left out of the count."""
    # (random tokens: the loss does not decrease, which is right and beside the point here)
    assert "train_val_leakage" not in [f.kind for f in _evaluate_every_10_steps(tmp_path / "one", copies=1)]
    (f,) = [f for f in _evaluate_every_10_steps(tmp_path / "five", copies=5) if f.kind == "train_val_leakage"]
    assert (f.evidence["copies_of_training_rows"], f.evidence["eval_rows_sampled"]) == (5, 64)


def test_a_test_set_evaluated_after_training_is_not_the_last_validation_point(tmp_path):
    """pytorch/examples gcn/main.py evaluates the training and validation rows after every update
    and, once training is over, the test rows (from another line, in the same last step): the last
    ``val_loss`` was the test loss. The validation pass is the one evaluated from where earlier
    steps' validation was."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = data(90, 5)
    rows = torch.arange(90)
    train_rows, val_rows, test_rows = rows < 40, (rows >= 40) & (rows < 60), rows >= 60
    y[60:] = (y[60:] + 1) % 3  # a test set unlike the rest: its loss stands out
    wanted = []
    with Monitor(model, tmp_path / "run", every=1, diagnose=False):
        for _ in range(4):
            opt.zero_grad()
            F.cross_entropy(model(x)[train_rows], y[train_rows]).backward()
            opt.step()
            _evaluate(model, x, y, train_rows)
            wanted.append(_evaluate(model, x, y, val_rows))
        test_loss = _evaluate(model, x, y, test_rows)
    got = [v for _, v in scalars(tmp_path / "run", "val_loss")]
    assert got == pytest.approx(wanted, rel=1e-5), (got, wanted, test_loss)


@pytest.mark.parametrize("sample_every", [10, 0])
def test_an_ema_copy_run_only_to_sample_is_not_trained_not_frozen(tmp_path, sample_every):
    """lucidrains/denoising-diffusion-pytorch's training: ema_pytorch keeps a deepcopy of the model
    with requires_grad_(False), lerped towards it after each step, and samples from it under
    inference_mode (here every 10 steps, or once after training). It got "141 of 282 parameters
    are frozen ... otherwise set `requires_grad=True`" (both times) beside "not trained" (the first)."""
    import copy

    torch.manual_seed(0)
    model = mlp()
    ema = copy.deepcopy(model).requires_grad_(False).eval()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = data(64, 0)
    with Monitor(None, tmp_path / "run", every=5) as mon:
        for step in range(30):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.lerp_(p, 0.01)
            if sample_every and (step + 1) % sample_every == 0:
                with torch.inference_mode():
                    ema(torch.randn(4, x.shape[1]))
        if not sample_every:
            with torch.inference_mode():
                ema(torch.randn(4, x.shape[1]))
    kinds = [f.kind for f in mon.findings]
    assert "params_frozen" not in kinds, [(f.kind, f.title, f.suggestion) for f in mon.findings]
    assert "model_not_trained" in kinds


class _GraphConv(nn.Module):
    """torch_geometric.nn.GCNConv's message passing without its normalisation: a linear map, then
    each node sums the rows of its in-neighbours (PyG's ``propagate`` with ``aggr="add"``)."""

    def __init__(self, i: int, o: int):
        super().__init__()
        self.lin = nn.Linear(i, o)

    def forward(self, x, edge_index):
        h = self.lin(x)
        return torch.zeros_like(h).index_add_(0, edge_index[1], h[edge_index[0]]) / 4 + h


class _LinkNet(nn.Module):
    """PyG examples/link_pred.py's Net: the loop calls ``encode`` and ``decode``, never ``forward``."""

    def __init__(self):
        super().__init__()
        self.conv1 = _GraphConv(16, 32)
        self.conv2 = _GraphConv(32, 16)

    def encode(self, x, edge_index):
        return self.conv2(self.conv1(x, edge_index).relu(), edge_index)

    def decode(self, z, pairs):
        return (z[pairs[0]] * z[pairs[1]]).sum(-1)


def test_link_prediction_on_one_graph_is_not_leakage(tmp_path):
    """PyG examples/link_pred.py (transductive): the same node features go through ``encode`` in
    training and in evaluation, and the splits are edges. Under ``trainguard run --monitor`` its
    two convolutions were found as two models (``forward`` never runs), and the second one's input
    rows, hidden activations of the whole graph, read as 75% of the validation rows copied from
    training: a ``train_val_leakage`` warning on a healthy run."""
    torch.manual_seed(0)
    n = 200
    x = torch.randn(n, 16)
    edges = torch.randint(0, n, (2, 600))
    train_e, val_e, test_e = edges[:, :500], edges[:, 500:550], edges[:, 550:]
    model = _LinkNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def test(edge_index, pairs):  # link_pred.py's test(data)
        model.eval()
        with torch.no_grad():
            z = model.encode(x, edge_index)
            out = model.decode(z, pairs).sigmoid()
        return out

    with Monitor(None, tmp_path / "run", every=5) as mon:
        for _ in range(30):
            model.train()
            opt.zero_grad()
            z = model.encode(x, train_e)
            neg = torch.randint(0, n, (2, 500))
            out = model.decode(z, torch.cat([train_e, neg], 1))
            label = torch.cat([torch.ones(500), torch.zeros(500)])
            F.binary_cross_entropy_with_logits(out, label).backward()
            opt.step()
            test(train_e, val_e)  # val_data.edge_index: the training edges
            test(torch.cat([train_e, val_e], 1), test_e)  # test_data's: the validation edges added
    problems = [(f.kind, f.title) for f in mon.findings if f.is_problem]
    assert problems == [], problems


def test_a_losss_own_warning_points_at_the_users_line_not_the_wrapper(tmp_path):
    # A regression loss whose prediction is [N, 1] and target [N]: torch warns "Using a target
    # size ... different to the input size" at its caller's line. Under the monitor the caller was
    # the functional-loss wrapper, so the warning read "trainguard/capture/_monitor_eval.py:97"
    # and the user could not find their line.
    import warnings

    model = nn.Linear(4, 1)
    with Monitor(model, tmp_path / "run", every=1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, y = torch.randn(8, 4), torch.randn(8)
        line = __import__("inspect").currentframe().f_lineno + 1
        F.mse_loss(model(x), y).backward()
    [w] = [w for w in caught if "target size" in str(w.message)]
    assert (w.filename, w.lineno) == (__file__, line), (w.filename, w.lineno)
    assert issubclass(w.category, UserWarning)


def _nanogpt_estimate_loss(model, get_batch, eval_iters=5):
    """karpathy/nanoGPT train.py's estimate_loss(): eval mode, no grad, both splits through one
    line in a loop over ``split``, the mean of each split's batch losses."""
    out = {}
    model.eval()
    with torch.no_grad():
        for split in ["train", "val"]:
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                X, Y = get_batch(split)
                logits, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
    model.train()
    return out


def test_nanogpt_evaluates_both_splits_from_one_line_and_the_val_split_is_the_validation(tmp_path):
    """nanoGPT's estimate_loss computes the train split's and the val split's losses on the same
    line (``logits, loss = model(X, Y)`` in ``for split in ['train', 'val']``): one pass by where it
    was computed. ``val_loss`` was the mean of both splits (4.1714 where nanoGPT printed val loss
    4.1776 and train loss 4.1652), and the train split's windows, drawn from the training data,
    were "exact copies of training rows" (a ``train_val_leakage`` warning: 109 of 317 rows on
    random tokens). The loop variable naming the split tells the passes apart."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    block, batch = 16, 16
    splits = {"train": torch.randint(0, 65, (1500,), generator=g), "val": torch.randint(0, 65, (400,), generator=g)}

    def get_batch(split):
        d = splits[split]
        ix = torch.randint(len(d) - block - 1, (batch,))
        return (torch.stack([d[i : i + block] for i in ix]), torch.stack([d[i + 1 : i + 1 + block] for i in ix]))

    model = _CharModel(65)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wanted = []
    with Monitor(model, tmp_path / "run", every=10) as mon:
        for it in range(81):
            if it % 20 == 0:
                wanted.append(_nanogpt_estimate_loss(model, get_batch)["val"])
            X, Y = get_batch("train")
            _, loss = model(X, Y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    got = [v for _, v in scalars(tmp_path / "run", "val_loss")]
    assert got == pytest.approx(wanted, rel=1e-5)
    assert "train_val_leakage" not in [f.kind for f in mon.findings]
    with open_run(tmp_path / "run") as run:
        leak = run.meta["monitor"]["validation"]["leak"]
    assert {b["validation"] for b in leak["batches"] if b["pass"] % 2 == 1} == {False}  # the train split's


# An engine of an installed framework, as pytorch-ignite's: ``Engine.run`` fires the iteration's
# event, whose handler (a ``Loss`` metric's ``update``) computes the loss, more than _PASS_FRAMES
# frames of the framework's own code below the script's ``evaluator.run(loader)``.
_ENGINE = '''
import torch


class Engine:
    def __init__(self, model, loss_fn):
        self.model, self.loss_fn, self.total = model, loss_fn, 0.0

    def run(self, loader):
        return self._internal_run(loader)

    def _internal_run(self, loader):
        return self._run_as_gen(loader)

    def _run_as_gen(self, loader):
        self.model.eval()
        with torch.no_grad():
            for x, y in loader:
                self._fire_event(x, y)
        self.model.train()

    def _fire_event(self, x, y):
        self._completed(x, y)

    def _completed(self, x, y):
        self._update(x, y)

    def _update(self, x, y):
        self.total += self.loss_fn(self.model(x), y).item() * len(y)
'''


def test_two_evaluator_runs_inside_an_installed_engine_are_two_passes(tmp_path, monkeypatch):
    """pytorch-ignite's examples/mnist/mnist.py runs one evaluator on the training loader, then on
    the validation loader, from two handlers of EPOCH_COMPLETED: at the loss call the innermost
    frames outside torch are ignite's own (``Loss.update``, ``Engine._fire_event``, ...), the same
    for both runs, so both were one pass and ``val_loss`` was the mean over the training and the
    validation rows (2.3021 at epoch 1 where ignite printed validation loss 2.3049, training
    2.3007). The script's frames further out (the two ``evaluator.run`` lines) tell them apart."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "tg_fake_engine.py").write_text(_ENGINE)
    monkeypatch.syspath_prepend(str(lib))
    monkeypatch.setattr(_monitor_eval, "_LIBRARIES", (str(lib) + "/",), raising=False)
    from tg_fake_engine import Engine  # noqa: PLC0415

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xt, yt = data(96, 1)
    xv, yv = data(64, 2)
    xv = xv * 3  # another distribution: its loss differs from the training rows'
    train_loader = [(xt[i : i + 32], yt[i : i + 32]) for i in range(0, 96, 32)]
    val_loader = [(xv[i : i + 32], yv[i : i + 32]) for i in range(0, 64, 32)]
    evaluator = Engine(model, nn.NLLLoss())
    wanted = []

    def log_training_results():
        evaluator.total = 0.0
        evaluator.run(train_loader)

    def log_validation_results():
        evaluator.total = 0.0
        evaluator.run(val_loader)
        wanted.append(evaluator.total / 64)

    with Monitor(model, tmp_path / "run", every=5) as mon:
        for _ in range(3):
            for x, y in train_loader:
                opt.zero_grad()
                F.nll_loss(F.log_softmax(model(x), 1), y).backward()
                opt.step()
            log_training_results()
            log_validation_results()
    got = [v for _, v in scalars(tmp_path / "run", "val_loss")]
    assert got == pytest.approx(wanted, rel=1e-5)
    assert "train_val_leakage" not in [f.kind for f in mon.findings]
    with open_run(tmp_path / "run") as run:
        leak = run.meta["monitor"]["validation"]["leak"]
    assert [b["validation"] for b in leak["batches"] if b["step"] == 3] == [False] * 3 + [True] * 2


class _TimeMajorSeq2Seq(nn.Module):
    """bentrevett/pytorch-seq2seq, legacy/4 (packed padded sequences) @ b3cd54c, cut down: the
    batches are time-major, ``src`` ``[src len, batch]`` with its lengths and ``trg``
    ``[trg len, batch]``, every column starting with <sos> and padded with <pad>."""

    def __init__(self, vocab: int = 50):
        super().__init__()
        self.src_emb, self.trg_emb = nn.Embedding(vocab, 8), nn.Embedding(vocab, 8)
        self.encoder = nn.GRU(8, 16, bidirectional=True)
        self.bridge = nn.Linear(32, 16)
        self.decoder = nn.GRU(8, 16)
        self.out = nn.Linear(16, vocab)

    def forward(self, src, src_len, trg):
        packed = nn.utils.rnn.pack_padded_sequence(self.src_emb(src), src_len)
        _, hidden = self.encoder(packed)
        hidden = torch.tanh(self.bridge(torch.cat((hidden[-2], hidden[-1]), dim=1))).unsqueeze(0)
        out, _ = self.decoder(self.trg_emb(trg[:-1]), hidden)  # teacher forcing
        return self.out(out)


def _reverse_pairs(n: int, g: torch.Generator) -> list[list[int]]:
    # token sequences of 4 to 9 ids in 3..49 (0 <pad>, 1 <sos>, 2 <eos>), the first of the longest length
    lengths = [9] + torch.randint(4, 10, (n - 1,), generator=g).tolist()
    return [torch.randint(3, 50, (k,), generator=g).tolist() for k in lengths]


def _time_major(seqs: list[list[int]]):
    """A batch as torchtext's BucketIterator made it: sorted by length, [len, batch], with lengths."""
    seqs = sorted(seqs, key=len, reverse=True)
    src = nn.utils.rnn.pad_sequence([torch.tensor([1, *s, 2]) for s in seqs])
    trg = nn.utils.rnn.pad_sequence([torch.tensor([1, *s[::-1], 2]) for s in seqs])
    return src, torch.tensor([len(s) + 2 for s in seqs]), trg


def _seq2seq_leakage(tmp_path, copies: int):
    torch.manual_seed(0)
    model = _TimeMajorSeq2Seq()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    train_seqs = [_reverse_pairs(16, g) for _ in range(20)]
    val = _reverse_pairs(32, g)
    val[1 : 1 + copies] = [s for batch in train_seqs for s in batch[1:]][:copies]
    with Monitor(model, tmp_path / "run", every=10) as mon:
        for step, seqs in enumerate(train_seqs):
            src, src_len, trg = _time_major(seqs)
            loss = F.cross_entropy(model(src, src_len, trg).flatten(0, 1), trg[1:].flatten(), ignore_index=0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 10 == 9:
                with torch.no_grad():
                    for i in (0, 16):
                        src, src_len, trg = _time_major(val[i : i + 16])
                        F.cross_entropy(model(src, src_len, trg).flatten(0, 1), trg[1:].flatten(), ignore_index=0)
    return [f for f in mon.findings if f.kind == "train_val_leakage"]


def test_time_major_token_batches_are_hashed_by_sample(tmp_path):
    """An RNN encoder-decoder's batches are time-major (``[src len, batch]``, torch's RNN default
    and torchtext's): the rows of the first dimension are time steps, the first all <sos> and the
    last mostly <pad> in every batch, which read as validation rows copied from training (a
    ``train_val_leakage`` warning on a healthy run of bentrevett/pytorch-seq2seq). The lengths and
    the target, whose second dimension is the batch's, say which dimension the samples are in."""
    assert _seq2seq_leakage(tmp_path / "fresh", copies=0) == []
    (f,) = _seq2seq_leakage(tmp_path / "copied", copies=6)
    assert f.evidence["exact_copies"] == 6 and f.evidence["eval_rows_sampled"] == 32


def test_position_ids_beside_batch_first_tokens_leave_the_batch_as_it_is():
    """A 1-D integer input says the batch is time-major only when it reads as the sequences'
    lengths (the longest is the padded length): ``position_ids`` of ``[seq len]`` beside
    ``input_ids`` of ``[batch, seq len]`` are no lengths, and the rows stay the samples."""
    ids = torch.randint(0, 50, (4, 6))
    assert _monitor_leak.samples_first(ids, [torch.arange(6)]) is ids
    time_major = torch.randint(0, 50, (6, 4))  # [src len, batch]
    assert torch.equal(_monitor_leak.samples_first(time_major, [torch.tensor([6, 5, 3, 2])]), time_major.T)


class _TimeMajorLSTMSeq2Seq(nn.Module):
    """bentrevett/pytorch-seq2seq notebook 1's Seq2Seq (@ b3cd54c), cut down: ``model(src, trg)``
    with ``[src len, batch]`` and ``[trg len, batch]`` tokens and no lengths, LSTM encoder and
    decoder, teacher forcing throughout."""

    def __init__(self, vocab: int = 50):
        super().__init__()
        self.src_emb, self.trg_emb = nn.Embedding(vocab, 8), nn.Embedding(vocab, 8)
        self.encoder, self.decoder = nn.LSTM(8, 16), nn.LSTM(8, 16)
        self.out = nn.Linear(16, vocab)

    def forward(self, src, trg):
        _, state = self.encoder(self.src_emb(src))
        out, _ = self.decoder(self.trg_emb(trg[:-1]), state)
        return self.out(out)


def test_a_time_major_model_stays_time_major_in_batches_that_do_not_say_so(tmp_path):
    """Where the source and target are as long (a batch's longest sentences of equal length),
    ``[src len, batch]`` beside ``[trg len, batch]`` does not say which dimension is the batch's;
    the batches before said it of this model, whose layout does not change from batch to batch.
    Here every validation batch is such one: its 11 time steps were hashed as its rows, not its 16
    samples (the <sos> row and the padded last rows are the same in many batches)."""
    torch.manual_seed(0)
    model = _TimeMajorLSTMSeq2Seq()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)

    def batch(extra: int):  # target = source reversed, ``extra`` tokens longer
        seqs = _reverse_pairs(16, g)
        src = nn.utils.rnn.pad_sequence([torch.tensor([1, *s, 2]) for s in seqs])
        trg = nn.utils.rnn.pad_sequence([torch.tensor([1, *s[::-1], *[3] * extra, 2]) for s in seqs])
        return src, trg

    val = [batch(0) for _ in range(2)]
    with Monitor(model, tmp_path / "run", every=10) as mon:
        for step in range(20):
            src, trg = batch(step % 2)  # every other batch's source and target are as long
            loss = F.cross_entropy(model(src, trg).flatten(0, 1), trg[1:].flatten(), ignore_index=0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 10 == 9:
                with torch.no_grad():
                    for src, trg in val:
                        F.cross_entropy(model(src, trg).flatten(0, 1), trg[1:].flatten(), ignore_index=0)
    assert [f for f in mon.findings if f.kind == "train_val_leakage"] == []
    with open_run(tmp_path / "run") as run:
        leak = run.meta["monitor"]["validation"]["leak"]
    assert [b["rows"] for b in leak["batches"]] == [16] * 4




def _windows(series, seq_len=24, pred_len=8):
    n = len(series) - seq_len - pred_len + 1
    x = torch.stack([series[i : i + seq_len] for i in range(n)])
    return x, torch.stack([series[i + seq_len : i + seq_len + pred_len] for i in range(n)])


def test_the_vali_split_is_the_validation_not_the_test_split_evaluated_after_it(tmp_path):
    """thuml/Time-Series-Library exp/exp_long_term_forecasting.py (and Informer2020, LTSF-Linear,
    Autoformer) ends every epoch with ``vali_loss = self.vali(vali_data, vali_loader, criterion)``
    then ``test_loss = self.vali(test_data, test_loader, criterion)``: one function, two lines, no
    split named in a string. ``val_loss`` was the test split's (the last pass to start); on a
    healthy DLinear whose test split drifts away, its rise read as ``overfitting`` while the
    validation loss that early stopping watches kept falling. The loaders the lines pass name
    the splits."""
    torch.manual_seed(0)
    t = torch.arange(600.0)
    series = torch.stack([torch.sin(t / 4 + k) for k in range(3)], 1) + 0.1 * torch.randn(600, 3)
    series[500:] += torch.linspace(0, 3, 100)[:, None]  # the test split drifts
    xs, ys = _windows(series[:400])
    # batches of 25 windows (93 in each split; the last 18 left out): the monitor weighs batches by rows
    vali_loader = [(x[i : i + 25], y[i : i + 25]) for x, y in [_windows(series[376:500])] for i in range(0, 75, 25)]
    test_loader = [(x[i : i + 25], y[i : i + 25]) for x, y in [_windows(series[476:])] for i in range(0, 75, 25)]
    model = DLinear()
    criterion = nn.MSELoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def vali(vali_data, vali_loader, criterion):  # Exp_Long_Term_Forecast.vali: the mean of batch losses
        total_loss = []
        model.eval()
        with torch.no_grad():
            for batch_x, batch_y in vali_loader:
                total_loss.append(criterion(model(batch_x), batch_y).item())
        model.train()
        return sum(total_loss) / len(total_loss)

    vali_data, test_data = vali_loader, test_loader  # the Dataset_Custom objects there
    vali_losses, test_losses = [], []
    with Monitor(model, tmp_path / "run", every=10, diagnose=False):
        for _epoch in range(4):
            for i in range(0, 368, 46):
                opt.zero_grad()
                criterion(model(xs[i : i + 46]), ys[i : i + 46]).backward()
                opt.step()
            vali_loss = vali(vali_data, vali_loader, criterion)
            test_loss = vali(test_data, test_loader, criterion)
            vali_losses.append(vali_loss)
            test_losses.append(test_loss)
    got = [v for _, v in scalars(tmp_path / "run", "val_loss")]
    assert got == pytest.approx(vali_losses, rel=1e-5), (got, vali_losses, test_losses)


def test_windows_of_a_series_with_rare_outliers_are_not_near_copies(tmp_path):
    """A multichannel series with rare spikes of 40 sigma (a meter's glitches: 2% of the time
    steps, in 38% of the windows), standardised with the training split's mean and std as
    Time-Series-Library's StandardScaler does, windowed for DLinear: the spikes inflate the std, so
    the spike-free windows are small, and every pair of windows holding a spike is far apart. The
    typical distance, the median over pairs of rows, was a spike's: a fifth of the validation
    windows read as near copies of training windows (a ``train_val_leakage`` warning)."""
    torch.manual_seed(0)
    t = torch.arange(1200.0)
    series = torch.stack([torch.sin(2 * math.pi * t / (24 * (k + 1)) + k) for k in range(4)], 1)
    series += 0.1 * torch.randn(1200, 4)
    spikes = torch.rand(1200) < 0.02
    series[spikes] += 40 * torch.randn(int(spikes.sum()), 4)
    series = (series - series[:840].mean(0)) / series[:840].std(0)
    xs, ys = _windows(series[:840])
    xv, yv = _windows(series[840 - 24 : 1000])
    model = DLinear()
    criterion = nn.L1Loss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Monitor(model, tmp_path / "run", every=10) as mon:
        for _epoch in range(3):
            for i in torch.randperm(len(xs)).split(32):
                opt.zero_grad()
                criterion(model(xs[i]), ys[i]).backward()
                opt.step()
            model.eval()
            with torch.no_grad():
                for j in range(0, len(xv), 32):
                    criterion(model(xv[j : j + 32]), yv[j : j + 32])
            model.train()
    assert "train_val_leakage" not in [f.kind for f in mon.findings]


def test_an_mse_validation_pass_keeps_its_targets_moments(tmp_path):
    """The chance level of a regression: the MSE of always predicting the validation targets'
    mean, their variance. The monitor sums their count, sum and sum of squares on the device, for
    the validation pass only (the last to start here, not the pass over other rows before it)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    xv, yv = torch.randn(50, 8, generator=g), 3 + 2 * torch.randn(50, 4, generator=g)
    xt, yt = torch.randn(50, 8, generator=g), torch.randn(50, 4, generator=g)
    with Monitor(model, tmp_path / "run", every=1, diagnose=False):
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(model(torch.randn(16, 8)), torch.randn(16, 4)).backward()
            opt.step()
            with torch.no_grad():
                F.mse_loss(model(xt), yt)
                F.mse_loss(model(xv), yv)
    with open_run(tmp_path / "run") as run:
        n, s, ss = run.meta["monitor"]["validation"]["target_moments"]
    assert n == 2 * yv.numel()
    assert (s, ss) == pytest.approx((2 * float(yv.sum()), 2 * float((yv**2).sum())), rel=1e-5)
