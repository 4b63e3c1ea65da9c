"""Fixture runs for the UI tests, written with the store's own RunWriter.

``logdir`` holds several runs side by side, as a user's folder would:

- ``ref``: shaped like the reference scenario (MLP, hand-written cross-entropy): from step 2 the
  softmax output holds zeros, ``log`` makes -inf, and the NaN spreads downstream;
- ``train``: training-health data only (scalars, layer statistics, findings, doctor results);
- ``group/nested``: a run one folder down;
- ``damaged``: a ``run.sqlite`` that is not a database.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from trainguard.store import ExecBatch, RunWriter

# The training script the fake reference run was "recorded" from; only its text matters.
SCRIPT = '''"""A small MLP on 8x8 digits with a hand-written cross-entropy."""
import torch
from torch import nn

model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
opt = torch.optim.SGD(model.parameters(), lr=5.0)


def loss_fn(logits, onehot):
    probs = torch.softmax(logits, dim=1)
    return -(onehot * torch.log(probs)).sum(dim=1).mean()


def train_step(x, onehot):
    opt.zero_grad()
    logits = model(x)
    loss = loss_fn(logits, onehot)
    loss.backward()
    opt.step()
    return loss


for step in range(4):
    train_step(x, onehot)
'''


def _line(needle: str) -> int:
    for i, text in enumerate(SCRIPT.splitlines(), start=1):
        if needle in text:
            return i
    raise ValueError(needle)


LINE = {
    "softmax": _line("torch.softmax("),
    "log": _line("torch.log("),
    "model": _line("logits = model(x)"),
    "loss_call": _line("loss = loss_fn("),
    "backward": _line("loss.backward()"),
    "opt": _line("opt.step()"),
    "loop": _line("    train_step(x, onehot)"),
}
TORCH_FILE = "/opt/py/lib/python3.11/site-packages/torch/nn/modules/linear.py"
FULL = ("size", "neg", "zero", "pos", "neg_inf", "pos_inf", "nan")


def _summary(size, neg=0, zero=0, neg_inf=0, pos_inf=0, nan=0):
    pos = size - neg - zero - neg_inf - pos_inf - nan
    return (float(size), float(neg), float(zero), float(pos), float(neg_inf), float(pos_inf), float(nan))


@dataclass
class RefRun:
    """What the fixture wrote, so tests compare against the builder instead of pinned numbers."""

    path: Path
    script: Path
    first_bad_seq: int = -1
    first_bad_softmax_seq: int = -1
    bad_seqs: list[int] = field(default_factory=list)
    seq_of: dict[tuple[int, str], int] = field(default_factory=dict)
    total: int = 0
    steps: int = 0


def build_reference_like(run_dir: Path, script_dir: Path, steps: int = 4, bad_from: int = 2) -> RefRun:
    script_dir.mkdir(parents=True, exist_ok=True)
    script = script_dir / "digits_mlp.py"
    script.write_text(SCRIPT)
    s = str(script)
    ref = RefRun(run_dir, script, steps=steps)
    w = RunWriter(run_dir, mode="full_health", meta={"argv": [s]})
    for mid, (path, typ) in enumerate([("0", "Linear"), ("1", "ReLU"), ("2", "Linear")], start=1):
        w.put_module(mid, path, typ)
    outer = [(s, LINE["loop"], "<module>")]
    stacks = {
        "fc0": outer + [(s, LINE["model"], "train_step"), (TORCH_FILE, 125, "forward")],
        "relu": outer
        + [
            (s, LINE["model"], "train_step"),
            ("/opt/py/lib/python3.11/site-packages/torch/nn/functional.py", 1704, "relu"),
        ],
        "softmax": outer + [(s, LINE["loss_call"], "train_step"), (s, LINE["softmax"], "loss_fn")],
        "log": outer + [(s, LINE["loss_call"], "train_step"), (s, LINE["log"], "loss_fn")],
        "backward": outer
        + [
            (s, LINE["backward"], "train_step"),
            ("/opt/py/lib/python3.11/site-packages/torch/_tensor.py", 626, "backward"),
        ],
        "opt": outer
        + [
            (s, LINE["opt"], "train_step"),
            ("/opt/py/lib/python3.11/site-packages/torch/optim/sgd.py", 80, "step"),
        ],
    }
    sid = {name: i for i, name in enumerate(stacks, start=1)}
    for name, frames in stacks.items():
        w.put_stack(sid[name], frames)
    f32 = "torch.float32"
    recs: list[tuple] = []
    x = 32 * 10  # batch 32, 10 classes
    for step in range(steps):
        bad = step >= bad_from
        first = len(recs)
        # (op, phase, module id, stack, inputs, output shape, summary, forward op row) per row;
        # inputs ["op", k] name row k of this step, turned into a sequence number below.
        # fmt: off
        rows = [
            ("aten.addmm.default", "forward", 1, "fc0", [["param", "0.bias"], ["input", {"shape": [32, 64]}],
             ["param", "0.weight"]], (32, 32), _summary(1024, neg=500), None),
            ("aten.relu.default", "forward", 2, "relu", [["op", 0]], (32, 32), _summary(1024, zero=500), None),
            ("aten.addmm.default", "forward", 3, "fc0", [["param", "2.bias"], ["op", 1], ["param", "2.weight"]],
             (32, 10), _summary(x, neg=150), None),
            ("aten._softmax.default", "forward", None, "softmax", [["op", 2]], (32, 10),
             _summary(x, zero=7 if bad else 0), None),
            ("aten.log.default", "forward", None, "log", [["op", 3]], (32, 10),
             _summary(x, neg=x - 7, neg_inf=7) if bad else _summary(x, neg=x), None),
            ("aten.mul.Tensor", "forward", None, "log", [["input", {"shape": [32, 10]}], ["op", 4]], (32, 10),
             _summary(x, zero=x - 32, neg=25, nan=7) if bad else _summary(x, zero=x - 32, neg=32), None),
            ("aten.neg.default", "forward", None, "log", [["op", 5]], (32, 10),
             _summary(x, zero=x - 32, nan=7) if bad else _summary(x, zero=x - 32), None),
            ("aten.mean.default", "forward", None, "log", [["op", 6]], (), _summary(1, nan=1) if bad else _summary(1),
             None),
            ("aten.log_backward.default", "backward", None, "backward", [["op", 7], ["op", 3]], (32, 10),
             _summary(x, nan=x) if bad else _summary(x, neg=10), 4),
            ("aten._softmax_backward_data.default", "backward", None, "backward", [["op", 8], ["op", 3]],
             (32, 10), _summary(x, nan=x) if bad else _summary(x, neg=5), 3),
            ("aten.add_.Tensor", "optimizer", None, "opt", [["param", "0.weight"]], (32, 64),
             _summary(2048, nan=2048) if bad else _summary(2048, neg=1000), None),
        ]
        # fmt: on
        for k, (op, phase, module, stack, inputs, shape, summ, fwd) in enumerate(rows):
            seq = first + k
            inputs = [["op", first + ref_] if kind == "op" else [kind, ref_] for kind, ref_ in inputs]
            fwd_seq = None if fwd is None else first + fwd
            recs.append((seq, step, phase, op, module, sid[stack], fwd_seq, None, inputs,
                         [[f32, list(shape), "cpu"]], [summ]))
            ref.seq_of[(step, op)] = seq
            if summ[4] or summ[5] or summ[6]:
                ref.bad_seqs.append(seq)
        if bad and ref.first_bad_seq < 0:
            ref.first_bad_seq = first + 4
            ref.first_bad_softmax_seq = first + 3
    w.put_executions(ExecBatch(recs), must_keep=True)
    for step in range(steps):
        w.add_scalars(step, {"loss": 2.30 - 0.1 * step if step < bad_from else math.nan, "lr/0": 5.0})
    w.close()
    ref.total = len(recs)
    return ref


def build_training_run(run_dir: Path, steps: int = 60) -> Path:
    w = RunWriter(run_dir, mode="no_tensor")
    for step in range(steps):
        loss = 2.3 * math.exp(-step / 20) + 0.05 * math.sin(step)
        w.add_scalars(
            step, {"loss": loss, "lr/0": 0.1 * (0.5 ** (step // 20)), "grad_norm": 5.0 / (1 + step)}
        )
        if step % 5 == 0:
            rows = []
            for i, layer in enumerate(["fc1", "fc2", "fc3"]):
                rows += [
                    (step, layer, "gradient", "mean_abs", 10.0 ** (-2 - 2 * i) / (1 + step)),
                    (step, layer, "gradient", "norm", 1.0 / (1 + i)),
                    (step, layer, "activation", "zero_frac", 0.1 + 0.3 * i),
                    (step, layer, "activation", "mean", math.inf if (layer == "fc3" and step == 55) else 0.5),
                ]
            w.add_layer_stats(rows)
    w.add_findings(
        "monitor",
        [
            {
                "kind": "vanishing_gradient",
                "severity": "warning",
                "title": "Gradients vanish towards the input",
                "evidence": {"first_last_ratio": 1e4, "layer": "fc3"},
                "suggestion": "use Kaiming initialisation",
                "steps": [0, 55],
                "layers": ["fc3"],
            },
            {  # a symptom the vanishing gradient explains: shown folded under it
                "kind": "loss_not_decreasing",
                "severity": "info",
                "title": "Loss is not decreasing (explained by vanishing_gradient)",
                "evidence": {"explained_by": ["vanishing_gradient"]},
                "steps": [0, 59],
            },
            {
                "kind": "dead_units",
                "severity": "info",
                "title": "fc3 has 70% dead units",
                "evidence": {"dead_frac": 0.7},
                "suggestion": "revive dead units",
                "steps": [10, 55],
                "layers": ["fc3"],
            },
        ],
    )
    report = {"checks": [{"name": "lr_range_test", "passed": True, "suggestion": 0.03}]}
    w.put_artifact("doctor/report.json", "application/json", json.dumps(report).encode())
    csv_text = "lr,loss,smoothed_loss\n" + "".join(
        f"{1e-5 * 10 ** (i / 10):.6g},{2.3 - 0.02 * i},{2.3 - 0.02 * i}\n" for i in range(40)
    )
    w.put_artifact("doctor/lr_range_test.csv", "text/csv", csv_text.encode())
    w.close()
    (run_dir / "doctor").mkdir()
    (run_dir / "doctor" / "lr_range_test.png").write_bytes(_tiny_png())
    (run_dir / "doctor" / "notes.txt").write_text("doctor notes inside the run\n")
    return run_dir


def _tiny_png() -> bytes:
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    raw = b"".join(b"\x00" + b"\xff\x80\x00" * 4 for _ in range(4))
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 4, 4, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def build_big_run(run_dir: Path, n: int, per_step: int = 100, bad_every: int = 0) -> Path:
    """``n`` executions in big batches (for navigation across 100k+ rows)."""
    w = RunWriter(run_dir, mode="curt_health", queue_items=16)
    ops = [
        "aten.addmm.default",
        "aten.relu.default",
        "aten.mul.Tensor",
        "aten.sum.default",
        "aten.add_.Tensor",
    ]
    batch = []
    for seq in range(n):
        bad = bool(bad_every) and seq % bad_every == bad_every - 1
        batch.append(
            (
                seq,
                seq // per_step,
                "forward",
                ops[seq % len(ops)],
                None,
                None,
                None,
                None,
                [["op", seq - 1]] if seq else [],
                [["torch.float32", [8], "cpu"]],
                [(1.0 if bad else 0.0,)],
            )
        )
        if len(batch) == 50_000:
            w.put_executions(ExecBatch(batch), must_keep=True)
            batch = []
    if batch:
        w.put_executions(ExecBatch(batch), must_keep=True)
    w.close()
    return run_dir


@dataclass
class Logdir:
    root: Path
    ref: RefRun
    train: Path
    nested: Path
    damaged: Path
    outside: Path


@pytest.fixture(scope="session")
def logdir(tmp_path_factory) -> Logdir:
    base = tmp_path_factory.mktemp("ui")
    root = base / "logs"
    root.mkdir()
    ref = build_reference_like(root / "ref", base / "src")
    train = build_training_run(root / "train")
    nested = build_reference_like(root / "group" / "nested", base / "src2", steps=2, bad_from=99).path
    damaged = root / "damaged"
    damaged.mkdir()
    (damaged / "run.sqlite").write_bytes(b"this is not a database" * 100)
    outside = base / "secret.txt"
    outside.write_text("SECRET-OUTSIDE-THE-RUN\n")
    # A symlink inside a run that points outside it; the server must refuse to follow it.
    os.symlink(outside, train / "doctor" / "leak.txt")
    os.symlink(base / "src", train / "doctor" / "srcdir")
    return Logdir(root, ref, train, nested, damaged, outside)


@pytest.fixture(scope="session")
def app(logdir):
    from trainguard.ui import create_app

    return create_app(logdir.root)


@pytest.fixture(scope="session")
def client(app):
    from starlette.testclient import TestClient

    with TestClient(app, raise_server_exceptions=True) as c:
        yield c


class LiveServer:
    """uvicorn on a free loopback port in a thread, for the browser and the benchmark."""

    def __init__(self, logdir: Path):
        import uvicorn

        from trainguard.ui import bind, create_app

        self.sock = bind("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(logdir, allowed_hosts=["127.0.0.1", "localhost"])
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        with contextlib.suppress(OSError):
            self.sock.close()


@pytest.fixture(scope="session")
def live_server():
    """A factory: ``with live_server(logdir) as srv: srv.url``."""
    return LiveServer


@pytest.fixture(scope="session")
def builders():
    """The run builders, for tests that write their own runs."""

    class B:
        reference_like = staticmethod(build_reference_like)
        training = staticmethod(build_training_run)
        big = staticmethod(build_big_run)
        script = SCRIPT
        line = LINE

    return B


# ---------------------------------------------------------------------- browser tests
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
                 "--no-first-run", "--disable-component-update", "--disable-sync"]


@dataclass
class BrowserRuns:
    root: Path
    reference: Path  # `trainguard demo`: the reference NaN scenario, recorded
    monitored: Path  # the same scenario under `trainguard run --monitor`: loss, LR, layer statistics
    synthetic: Path  # doctor results and real checkpoints, written by the test
    big: Path
    big_total: int
    big_bad: list[int]


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainguard", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="session")
def browser_runs(tmp_path_factory) -> BrowserRuns:
    root = tmp_path_factory.mktemp("browser") / "logs"
    root.mkdir()
    # The two real recordings run side by side while the test writes the others.
    jobs = [
        _cli("demo", "--logdir", str(root / "reference"), "--quiet"),
        _cli("run", "--monitor", "--every", "1", "--buffer", "-1", "--logdir", str(root / "reference-monitored"),
             "-m", "trainguard.examples.nan_digits"),
    ]
    synthetic = build_training_run(root / "synthetic")
    _add_checkpoints(synthetic)
    n, every = 120_000, 10_007
    big = build_big_run(root / "big", n, bad_every=every)
    (root / "damaged").mkdir()
    (root / "damaged" / "run.sqlite").write_bytes(b"not a database" * 100)
    for job in jobs:
        out, _ = job.communicate(timeout=300)
        assert job.returncode == 0, f"{job.args} failed:\n{out[-3000:]}"
    return BrowserRuns(root, root / "reference", root / "reference-monitored", synthetic, big, n,
                       [s for s in range(n) if s % every == every - 1])


def _add_checkpoints(run_dir: Path) -> None:
    import torch

    import trainguard as tg

    model = torch.nn.Linear(4, 2)
    state = tg.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    mgr = tg.CheckpointManager(run_dir / "checkpoints", keep=3)
    for step in (10, 20, 30):
        mgr.save(state, step)


@pytest.fixture(scope="session")
def ui_server(browser_runs):
    with LiveServer(browser_runs.root) as srv:
        yield srv


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    exe = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    assert os.path.exists(exe), "the browser tests drive Debian's chromium: apt-get install chromium (make test does)"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        yield b
        b.close()


def _page(browser, *, bypass_csp: bool):
    context = browser.new_context(viewport={"width": 1600, "height": 1000}, bypass_csp=bypass_csp)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.set_default_timeout(15_000)
    yield pg
    context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


@pytest.fixture
def page(browser):
    """A fresh page; uncaught script errors fail the test. Playwright's wait_for_function
    evaluates strings, which the app's Content-Security-Policy forbids, so these pages bypass it."""
    yield from _page(browser, bypass_csp=True)


@pytest.fixture
def strict_page(browser):
    """A page under the app's own Content-Security-Policy: the app must work within it."""
    yield from _page(browser, bypass_csp=False)


@pytest.fixture(scope="session")
def screenshot_dir(tmp_path_factory) -> Path:
    """Where the browser tests save their screenshots: TRAINGUARD_UI_SCREENSHOTS (e.g. docs), else a temp dir."""
    target = os.environ.get("TRAINGUARD_UI_SCREENSHOTS")
    if target:
        path = Path(target)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("screenshots")
