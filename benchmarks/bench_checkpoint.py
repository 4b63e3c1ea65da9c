"""Checkpoint save and restore: torch.save/torch.load against trainguard, synchronous and asynchronous.

One process, one ~100M-parameter model (six 4096x4096 linear layers, 400 MB of fp32), measured
side by side in interleaved rounds so that machine noise hits every method alike; each cell is
the median over the rounds. Rows:

* ``torch.save`` / ``torch.load(weights_only=True)``: what a hand-written loop does (a new file
  per save, no fsync); ``torch.save + fsync`` makes the bytes durable, as trainguard always does;
* trainguard sync: ``CheckpointManager.save`` (temporary dir, DCP, fsync, SHA-256 per file,
  manifest, rename) and ``restore`` (full SHA-256 verification, then load);
* trainguard async: ``save`` returns once the state is copied to reused host buffers ("held":
  the time the training loop waits); the write finishes in a background thread ("total").

Also measured: training steps (forward + backward + SGD on the same model) run while an async
save is writing, against steps with no save in flight. Target: held <= 10% of the sync save.

    python benchmarks/bench_checkpoint.py                 # 3 rounds, 400 MB model
    python benchmarks/bench_checkpoint.py --rounds 1 --width 1024 --layers 4   # a quick look
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from trainguard.resilience import CheckpointManager, TrainState


def make_model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def torch_save(model: nn.Module, path: Path, *, fsync: bool) -> None:
    with open(path, "wb") as f:
        torch.save(model.state_dict(), f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def torch_load(model: nn.Module, path: Path) -> None:
    model.load_state_dict(torch.load(path, weights_only=True))


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args()

    root = Path(tempfile.mkdtemp(prefix="tg-bench-", dir=args.dir))
    model = make_model(args.width, args.layers)
    n_params = sum(p.numel() for p in model.parameters())
    state = TrainState(model=model)
    sync = CheckpointManager(root / "sync", keep=1)
    background = CheckpointManager(root / "async", keep=1, async_save=True)
    background.save(state, 0)  # the first async save allocates the staging buffers; later ones reuse them
    background.wait()
    results: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        results.setdefault(name, []).append(seconds)

    try:
        for r in range(1, args.rounds + 1):
            step = r
            # A new file per save, as a loop writing ckpt_<step>.pt does (rewriting one file in place
            # is faster on some file systems, and is not what keeps an older checkpoint safe).
            plain, durable = root / f"plain-{r}.pt", root / f"durable-{r}.pt"
            record("torch.save", timed(lambda plain=plain: torch_save(model, plain, fsync=False)))
            record("torch.save + fsync", timed(lambda durable=durable: torch_save(model, durable, fsync=True)))
            record("torch.load", timed(lambda plain=plain: torch_load(model, plain)))
            plain.unlink()
            durable.unlink()
            record("trainguard sync save", timed(lambda s=step: sync.save(state, s)))
            record("trainguard restore", timed(lambda: sync.restore(state)))
            t0 = time.perf_counter()
            background.save(state, step)
            held = time.perf_counter() - t0
            background.wait()
            record("trainguard async save: held", held)
            record("trainguard async save: total", time.perf_counter() - t0)
            print(f"round {r}/{args.rounds} done", flush=True)

        # Training while a background save writes, against training alone.
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)
        x = torch.randn(16, args.width)
        train_steps(model, opt, x, 2)  # warm up
        alone = statistics.median(train_steps(model, opt, x, 5))
        background.save(state, args.rounds + 1)
        during = []
        while background._thread is not None and background._thread.is_alive():
            during += train_steps(model, opt, x, 1)
        background.wait()
    finally:
        background.close()
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in results.items()}
    sync_save = med["trainguard sync save"]
    size_mb = n_params * 4 / 1e6
    print()
    print(f"model: {args.layers} x Linear({args.width}, {args.width}), {n_params / 1e6:.1f}M parameters, "
          f"{size_mb:.0f} MB fp32; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"median of {args.rounds} rounds")
    print()
    print("| operation | seconds | MB/s | vs torch.save | vs trainguard sync save |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, seconds in med.items():
        mbps = f"{size_mb / seconds:.0f}" if "held" not in name else "-"
        print(f"| {name} | {seconds:.3f} | {mbps} | {seconds / med['torch.save']:.2f}x | {seconds / sync_save:.1%} |")
    print()
    held = med["trainguard async save: held"]
    verdict = "meets" if held <= 0.10 * sync_save else "misses"
    print(f"loop held by an async save: {held * 1000:.0f} ms = {held / sync_save:.1%} of a sync save "
          f"({verdict} the <= 10% target)")
    if during:
        print(f"training step alone: {alone * 1000:.0f} ms; during a background write: "
              f"{statistics.median(during) * 1000:.0f} ms median over {len(during)} steps")


if __name__ == "__main__":
    warnings.simplefilter("ignore", UserWarning)
    main()
