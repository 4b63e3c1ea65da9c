"""The guard's cost: training steps of the MLP and the transformer block of ``bench_monitor.py``
under ``trainguard.Guard`` (sentry every step, a host-memory snapshot every 50 steps), beside the
same steps in a plain PyTorch loop and in ``loop.batches()`` without a guard.

Configurations run in paired rounds, in a shuffled order per round, in one process: a round
times one block of steps per configuration, and its ratios divide each block's mean step time by
the plain block of the same round. The tables show the median ratio over rounds and its range,
and the guard's own CPU time per step counted inside its hooks (steadier on a loaded machine).

    python benchmarks/bench_guard.py                        # mlp, transformer
    python benchmarks/bench_guard.py --models mlp --rounds 3 --steps 100
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_monitor import make_mlp, make_transformer  # noqa: E402

MODELS = {"mlp": make_mlp, "transformer": make_transformer}
CONFIGS = ["plain", "loop", "guard", "guard+spike"]


class OneBatch(Dataset):
    """The same prepared batch every time: the data pipeline costs nothing and is the same for all."""

    def __init__(self, batch, n: int):
        self.batch, self.n = batch, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return self.batch


def setup(name: str):
    """The model of bench_monitor.py, its optimizer and a loader of its batch."""
    torch.manual_seed(0)
    model, opt, loss_fn = MODELS[name]()
    # bench_monitor's loss closures hold their batch; take it back out to feed it through a loader.
    cells = {c.cell_contents for c in loss_fn.__closure__ if isinstance(c.cell_contents, torch.Tensor)}
    x = max(cells, key=lambda t: t.numel())
    y = next((t for t in cells if t is not x), None)
    if name == "mlp":
        step_loss = lambda b: torch.nn.functional.cross_entropy(model(b[0]), b[1])  # noqa: E731
    else:
        step_loss = lambda b: model(b[0]).pow(2).mean()  # noqa: E731
    batch = (x, y if y is not None else torch.zeros(1))
    return model, opt, step_loss, batch


def block(config: str, model, opt, step_loss, batch, steps: int, tmp: str) -> tuple[float, float]:
    """Mean wall and process-CPU seconds per step over ``steps`` steps (after one untimed step)."""
    import trainguard as tg
    from trainguard.resilience import ResumeLoop

    def train_step(b):
        loss = step_loss(b)
        opt.zero_grad()
        loss.backward()
        opt.step()

    if config == "plain":
        train_step(batch)
        t, c = time.perf_counter(), time.process_time()
        for _ in range(steps):
            train_step(batch)
        return (time.perf_counter() - t) / steps, (time.process_time() - c) / steps
    state = tg.TrainState(model=model, optimizer=opt, loader=DataLoader(OneBatch(batch, steps + 1), batch_size=None))
    if config == "loop":
        it = ResumeLoop(None, state, total_steps=steps + 1, epochs=None, delete_on_success=False,
                        handle_signals=False).batches()
    else:
        guard = tg.Guard(os.path.join(tmp, f"g-{time.monotonic_ns()}"), snapshot_every=50,
                         spike_factor=10.0 if config == "guard+spike" else None)
        it = guard.batches(state, total_steps=steps + 1)
    _, b = next(it)  # attaching (the guard's first snapshot) is not a step
    train_step(b)
    t, c = time.perf_counter(), time.process_time()
    for _, b in it:
        train_step(b)
    wall, cpu = (time.perf_counter() - t) / steps, (time.process_time() - c) / steps
    if config.startswith("guard"):
        assert not guard.events, guard.events  # a healthy run: nothing rewound
    return wall, cpu


def hook_time(model, opt, step_loss, batch, steps: int, tmp: str) -> dict:
    """The guard's own CPU time per step, measured inside its hooks (a direct count, steadier than
    a ratio of two noisy step times): the sentry's loss and optimizer taps, the step hooks, and
    the boundary (reading the vector one step late, the verdict, the snapshot every 50 steps)."""
    from trainguard.guard._guard import Guard
    from trainguard.guard._sentry import Sentry

    spent = {"sentry": 0.0, "boundary": 0.0}
    patched = []

    def wrap(cls, name, bucket):
        original = getattr(cls, name)

        def timed(*args, **kwargs):
            c = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                spent[bucket] += time.process_time() - c

        patched.append((cls, name, original))
        setattr(cls, name, timed)

    for name in ("_on_loss", "_before_optimizer"):
        wrap(Sentry, name, "sentry")
    for name in ("_begin_step", "_end_step"):
        wrap(Guard, name, "sentry")
    for name in ("_flags", "_decide"):
        wrap(Guard, name, "boundary")
    try:
        block("guard", model, opt, step_loss, batch, steps, tmp)
    finally:
        for cls, name, original in patched:
            setattr(cls, name, original)
    return {k: v / steps for k, v in spent.items()}


def time_model(name: str, rounds: int, steps: int) -> dict:
    model, opt, step_loss, batch = setup(name)
    for _ in range(3):
        opt.zero_grad()
        step_loss(batch).backward()
        opt.step()
    per: dict[str, list[tuple[float, float]]] = {c: [] for c in CONFIGS}
    order = list(CONFIGS)
    shuffle = random.Random(0).shuffle
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            shuffle(order)
            for c in order:
                gc.collect()
                per[c].append(block(c, model, opt, step_loss, batch, steps, tmp))
    out: dict = {}
    for i, clock in enumerate(("wall", "cpu")):
        ratios = {c: [per[c][r][i] / per["plain"][r][i] for r in range(rounds)] for c in CONFIGS}
        out[clock] = {
            "step_ms": {c: statistics.median(v[i] for v in per[c]) * 1e3 for c in CONFIGS},
            "ratio": {c: statistics.median(ratios[c]) for c in CONFIGS},
            "range": {c: [min(ratios[c]), max(ratios[c])] for c in CONFIGS},
            "guard_vs_loop": statistics.median(per["guard"][r][i] / per["loop"][r][i] for r in range(rounds)),
        }
    with tempfile.TemporaryDirectory() as tmp:
        hooks = [hook_time(model, opt, step_loss, batch, steps, tmp) for _ in range(3)]
    plain_cpu = out["cpu"]["step_ms"]["plain"] / 1e3
    out["hooks"] = {k: statistics.median(h[k] for h in hooks) * 1e6 for k in ("sentry", "boundary")}
    out["hooks"]["share_of_plain_step"] = sum(out["hooks"].values()) / 1e6 / plain_cpu
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,transformer")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=100, help="timed steps per configuration per round (>= 50: a snapshot)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("trainguard").setLevel(logging.ERROR)
    results: dict = {"threads": args.threads, "rounds": args.rounds, "steps": args.steps,
                     "load": os.getloadavg()[0], "models": {}}
    for name in [m for m in args.models.split(",") if m]:
        results["models"][name] = time_model(name, args.rounds, args.steps)

    from rich.console import Console
    from rich.table import Table

    for clock in ("wall", "cpu"):
        table = Table(title=f"guard overhead, {clock} time: step time / plain PyTorch (median \\[range] of "
                            f"{args.rounds} paired rounds of {args.steps} steps, {args.threads} threads, "
                            f"load {results['load']:.1f})")
        table.add_column("model")
        table.add_column("plain ms", justify="right")
        for c in CONFIGS[1:]:
            table.add_column(c, justify="right")
        table.add_column("guard / loop", justify="right")
        for name, r in results["models"].items():
            r = r[clock]
            cells = [f"{r['ratio'][c]:.3f}x [{r['range'][c][0]:.2f}-{r['range'][c][1]:.2f}]" for c in CONFIGS[1:]]
            table.add_row(name, f"{r['step_ms']['plain']:.2f}", *cells, f"{r['guard_vs_loop']:.3f}x")
        Console().print(table)
    table = Table(title="the guard's own CPU time per step, measured in its hooks (median of 3 blocks)")
    for col in ("model", "sentry µs", "boundary + snapshots µs", "share of the plain step"):
        table.add_column(col, justify="right")
    for name, r in results["models"].items():
        hk = r["hooks"]
        table.add_row(name, f"{hk['sentry']:.0f}", f"{hk['boundary']:.0f}", f"{hk['share_of_plain_step'] * 100:.2f}%")
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
