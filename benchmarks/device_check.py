"""The accelerator paths in one short run: what a session lent a GPU runs first.

Every check trains a small model on ``--device`` (default ``cuda``) and asserts what trainguard
must say there; each prints PASS or FAIL with the reason, and the exit code is the number of
failures. ``--bench`` then runs ``bench_recorder.py`` and ``bench_compile.py`` on the device (three
rounds each).

    python benchmarks/device_check.py                  # on a GPU machine
    python benchmarks/device_check.py --bench          # and the recorder benchmark there
    python benchmarks/device_check.py --device cpu     # the same checks on the CPU (the logic)

What each check covers (the CUDA halves of issues 16 and 17):

- ``origin``: the reference NaN (``log`` of a softmax with zeros) recorded on each backend, the
  native core's device summaries deferred without a host sync; the origin is ``aten.log`` at
  its line, and both backends store the same ops with the same health.
- ``check_numerics``: raises at that op with its line.
- ``compiled``: the same loss compiled with inductor (Triton on CUDA) under ``record``: one graph
  as without trainguard, and the origin inside the graph at the same line.
- ``monitor_amp``: a monitor over float16 autocast with a GradScaler: every layer's statistics,
  a finite loss per step.
- ``guard``: a NaN batch under the guard: one rewind, the batch skipped, training goes on finite.
- ``resume``: a checkpoint (device RNG included) restored into a fresh model: the next losses
  equal the uninterrupted run's bitwise.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch import nn

import trainguard as tg
from trainguard.analysis import origin

torch.manual_seed(0)


def _model(device: str) -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)


def _data(device: str, n: int = 64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 64, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return x.to(device), y.to(device)


def nan_loss(model, x, y):
    probs = torch.softmax(model(x) * 200.0, dim=1)  # saturated: many exact zeros
    onehot = nn.functional.one_hot(y, 10).to(probs.dtype)
    return -(onehot * torch.log(probs)).sum(dim=1).mean()


LOG_LINE = inspect.getsourcelines(nan_loss)[1] + 3  # the line of torch.log above


def _train_nan(device: str, loss_fn=nan_loss, steps: int = 2) -> None:
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data(device)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()


def _crosscheck():
    """The test suite's comparison of the two backends (tests/capture/crosscheck.py)."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests", "capture")
    sys.path.insert(0, os.path.normpath(here))
    try:
        from crosscheck import crosscheck
    finally:
        sys.path.pop(0)
    return crosscheck


def check_origin(device: str, tmp: str) -> str:
    for backend in ("native", "python"):
        logdir = os.path.join(tmp, f"origin-{backend}")
        with tg.record(logdir, mode="full_health", backend=backend):
            _train_nan(device)
        with tg.open(logdir) as run:
            ran = run.meta.get("backend")
            o = origin(run)
        assert o is not None, f"{backend}: no origin found"
        assert o.origin.op.startswith("aten.log") and o.origin.line == LOG_LINE, \
            f"{backend} ({ran}): origin {o.origin.op} at line {o.origin.line}, expected aten.log at {LOG_LINE}"
    problems, _, py, _ = _crosscheck()(lambda: (lambda: _train_nan(device)), Path(tmp) / "crosscheck")
    assert not problems, "the backends differ: " + "; ".join(map(str, problems[:5]))
    return f"aten.log at line {LOG_LINE} on both backends; their {len(py['records'])} records match"


def check_numerics(device: str, tmp: str) -> str:
    try:
        with tg.check_numerics():
            _train_nan(device)
    except tg.NonFiniteError as exc:
        text = str(exc)
        assert "log" in text and f":{LOG_LINE}" in text, text.splitlines()[0]
        return text.splitlines()[0]
    raise AssertionError("no NonFiniteError raised")


def check_compiled(device: str, tmp: str) -> str:
    import torch._dynamo as dynamo

    compiled_loss = torch.compile(nan_loss)
    dynamo.reset()
    dynamo.utils.counters.clear()
    _train_nan(device, compiled_loss, steps=1)
    plain_graphs = dynamo.utils.counters["stats"]["unique_graphs"]
    dynamo.reset()
    dynamo.utils.counters.clear()
    logdir = os.path.join(tmp, "compiled")
    with tg.record(logdir, mode="full_health"):
        _train_nan(device, torch.compile(nan_loss), steps=2)
    graphs = dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == plain_graphs, f"{graphs} graphs under record, {plain_graphs} without"
    with tg.open(logdir) as run:
        o = origin(run)
    assert o is not None and o.origin.op.startswith("aten.log") and o.origin.line == LOG_LINE, \
        f"origin {o and o.origin.op} at line {o and o.origin.line}"
    return f"{graphs} graph(s) with and without recording; origin aten.log at line {LOG_LINE} inside the graph"


def check_monitor_amp(device: str, tmp: str) -> str:
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cuda = torch.device(device).type == "cuda"
    scaler = torch.amp.GradScaler(device, enabled=cuda)
    x, y = _data(device)
    logdir = os.path.join(tmp, "monitor")
    with tg.Monitor(model, logdir, every=2):
        for _ in range(10):
            opt.zero_grad()
            with torch.autocast(torch.device(device).type, dtype=torch.float16 if cuda else torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    with tg.open(logdir) as run:
        losses = run.scalars("loss")["loss"]
        layers = set(run.layers())
    assert len(losses) == 10 and all(v == v for _, v in losses), losses
    assert {"0", "2"} <= layers, layers
    return f"{len(losses)} finite losses, layers {sorted(layers)}"


def check_guard(device: str, tmp: str) -> str:
    x, y = _data(device, 256)
    x[64 + 3, 5] = float("nan")  # a sample of batch 2
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = tg.TrainState(model=model, optimizer=opt, loader=loader)
    guard = tg.Guard(os.path.join(tmp, "guard"), snapshot_every=4)
    ckpt = tg.CheckpointManager(os.path.join(tmp, "guard-ckpt"), every_steps=100)
    losses = []
    for _, (bx, by) in ckpt.resume(state, total_steps=12, guard=guard).batches():
        loss = nn.functional.cross_entropy(state.model(bx), by)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    events = guard.events
    assert len(events) == 1, events
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert finite, "non-finite weights after the guard"
    return f"1 rewind at step {events[0]['step']}, weights finite after {len(losses)} steps"


def check_resume(device: str, tmp: str) -> str:
    def run(steps: int, ckdir: str, resume_from: str | None = None) -> list[float]:
        torch.manual_seed(1)
        model = _model(device)
        drop = nn.Dropout(0.3)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        state = tg.TrainState(model=model, optimizer=opt)
        ckpt = tg.CheckpointManager(resume_from or ckdir, every_steps=3)
        x, y = _data(device)
        out = []
        for _ in ckpt.resume(state, total_steps=steps):
            loss = nn.functional.cross_entropy(drop(model(x)), y)  # dropout draws from the device RNG
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    whole = run(8, os.path.join(tmp, "whole"))
    first = run(6, os.path.join(tmp, "part"))  # checkpoints at 3 and 6
    rest = run(8, "", resume_from=os.path.join(tmp, "part"))
    assert first + rest == whole, (first + rest, whole)
    return f"{len(whole)} losses bitwise equal after a restore at step 6"


CHECKS = {"origin": check_origin, "check_numerics": check_numerics, "compiled": check_compiled,
          "monitor_amp": check_monitor_amp, "guard": check_guard, "resume": check_resume}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--checks", default=",".join(CHECKS))
    p.add_argument("--bench", action="store_true", help="then run bench_recorder.py and bench_compile.py there")
    args = p.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(f"device_check: no CUDA device here (torch {torch.__version__}); use --device cpu", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu"
    print(f"device_check on {args.device} ({name}), torch {torch.__version__}", flush=True)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for check in [c for c in args.checks.split(",") if c]:
            t = time.perf_counter()
            try:
                said = CHECKS[check](args.device, tmp)
                print(f"PASS {check} ({time.perf_counter() - t:.1f} s): {said}", flush=True)
            except Exception as exc:  # a check's failure is reported, the others still run
                failed += 1
                print(f"FAIL {check} ({time.perf_counter() - t:.1f} s): {type(exc).__name__}: {exc}", flush=True)
                traceback.print_exc()
    if args.bench:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_recorder

        bench_recorder.main(["--device", args.device, "--models", "mlp,transformer,nanogpt", "--rounds", "3",
                             "--backends", "native,python", "--modes", "no_tensor,full_health"])
        import bench_compile

        bench_compile.main(["--device", args.device, "--rounds", "3"])
    return failed


if __name__ == "__main__":
    sys.exit(main())
