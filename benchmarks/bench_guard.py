"""The guard's cost: training steps of the MLP and the transformer block of ``bench_monitor.py``
in a plain PyTorch loop, in a ``CheckpointManager`` loop (``ckpt.resume(...).batches()``), in the
same loop under ``trainguard.Guard`` (sentry every step, a host-memory snapshot every 50 steps,
with and without a spike factor), and under a guard on its own (no manager); and what one
rewind + replay costs (a batch that makes the loss NaN, replayed from the last snapshot).

Configurations run in interleaved rounds, in a shuffled order per round, in one process: a round
times one block of steps per configuration, and its ratios divide each block's mean step time by
the plain block of the same round (wall clock and the process's CPU time). The tables show the
median ratio over rounds and its range, the guard's own CPU time per step counted inside its
hooks (steadier on a loaded machine), and the rewind's cost as the extra time of a block with one
poisoned batch over the healthy guarded block of the same round.

    python benchmarks/bench_guard.py                        # mlp, transformer
    python benchmarks/bench_guard.py --models mlp --rounds 3 --steps 100 --threads 1
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
CONFIGS = ["plain", "ckpt", "ckpt+guard", "ckpt+guard+spike", "guard"]
FAULT = "ckpt+guard+fault"  # not a ratio: the rewind's cost, against ckpt+guard


class OneBatch(Dataset):
    """The same prepared batch every time: the data pipeline costs nothing and is the same for
    all; the batch at ``poison`` holds NaN (the loss goes NaN, the guard rewinds)."""

    def __init__(self, batch, n: int, poison: int | None = None):
        self.batch, self.n, self.poison = batch, n, poison

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if i == self.poison:
            return (torch.full_like(self.batch[0], float("nan")), *self.batch[1:])
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


def block(config: str, model, opt, step_loss, batch, steps: int, tmp: str, fault_at: int = 25) -> dict:
    """Wall and process-CPU seconds of ``steps`` steps (after one untimed step, which attaches the
    guard and takes its first snapshot), in all and per step. The timing stops after the last
    step's body: the loop's final checkpoint is not a step."""
    import trainguard as tg

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
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        return {"wall": wall, "cpu": cpu, "wall_step": wall / steps, "cpu_step": cpu / steps}
    tag = f"{config}-{time.monotonic_ns()}"
    poison = fault_at if config == FAULT else None
    # one item more than the steps: a skipped batch is replaced by the next one
    loader = DataLoader(OneBatch(batch, steps + 2, poison), batch_size=None)
    state = tg.TrainState(model=model, optimizer=opt, loader=loader)
    guard = None
    if config != "ckpt":
        guard = tg.Guard(os.path.join(tmp, f"run-{tag}"), snapshot_every=50,
                         spike_factor=10.0 if config == "ckpt+guard+spike" else None)
    ckpt = tg.CheckpointManager(os.path.join(tmp, f"ckpt-{tag}")) if config != "guard" else None
    try:
        if ckpt is not None:
            it = ckpt.resume(state, total_steps=steps + 1, guard=guard, handle_signals=False).batches()
        else:
            it = guard.batches(state, total_steps=steps + 1)
        _, b = next(it)
        train_step(b)
        t, c = time.perf_counter(), time.process_time()
        end = None
        for step, b in it:
            train_step(b)
            if step == steps and end is None:  # the last step (a replay hands out earlier ones again)
                end = time.perf_counter(), time.process_time()
    finally:
        if ckpt is not None:
            ckpt.close()
    wall, cpu = end[0] - t, end[1] - c
    out = {"wall": wall, "cpu": cpu, "wall_step": wall / steps, "cpu_step": cpu / steps}
    if guard is not None:
        if config == FAULT:
            [event] = guard.events  # exactly one rewind, replayed and skipped
            assert event["action"] == "skip" and event["step"] == fault_at, event
            out["replayed"] = event["replay"]["steps"]
        else:
            assert not guard.events, guard.events  # a healthy run: nothing rewound
    return out


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


def time_model(name: str, rounds: int, steps: int, fault_at: int) -> dict:
    model, opt, step_loss, batch = setup(name)
    for _ in range(3):
        opt.zero_grad()
        step_loss(batch).backward()
        opt.step()
    per: dict[str, list[dict]] = {c: [] for c in [*CONFIGS, FAULT]}
    order = [*CONFIGS, FAULT]
    shuffle = random.Random(0).shuffle
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            shuffle(order)
            for c in order:
                gc.collect()
                per[c].append(block(c, model, opt, step_loss, batch, steps, tmp, fault_at))
    out: dict = {}
    for clock in ("wall", "cpu"):
        key = f"{clock}_step"
        ratios = {c: [per[c][r][key] / per["plain"][r][key] for r in range(rounds)] for c in CONFIGS}
        guard_vs_ckpt = [per["ckpt+guard"][r][key] / per["ckpt"][r][key] for r in range(rounds)]
        # one rewind + replay: what the poisoned block took beyond the healthy guarded block
        extra = [per[FAULT][r][clock] - per["ckpt+guard"][r][clock] for r in range(rounds)]
        out[clock] = {
            "step_ms": {c: statistics.median(v[key] for v in per[c]) * 1e3 for c in CONFIGS},
            "ratio": {c: statistics.median(ratios[c]) for c in CONFIGS},
            "range": {c: [min(ratios[c]), max(ratios[c])] for c in CONFIGS},
            "guard_vs_ckpt": statistics.median(guard_vs_ckpt),
            "guard_vs_ckpt_range": [min(guard_vs_ckpt), max(guard_vs_ckpt)],
            "rewind_ms": statistics.median(extra) * 1e3,
            "rewind_range_ms": [min(extra) * 1e3, max(extra) * 1e3],
            "rewind_in_plain_steps": statistics.median(extra) / statistics.median(v[key] for v in per["plain"]),
        }
    out["replayed_steps"] = per[FAULT][0]["replayed"]
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
    p.add_argument("--fault-at", type=int, default=25,
                   help="the poisoned step of the rewind's block (25: half the snapshot interval, the mean replay)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if not 1 <= args.fault_at < args.steps:
        p.error(f"--fault-at must be in 1..{args.steps - 1}")
    torch.set_num_threads(args.threads)
    results: dict = {"threads": args.threads, "rounds": args.rounds, "steps": args.steps, "fault_at": args.fault_at,
                     "load_before": os.getloadavg(), "models": {}}
    for name in [m for m in args.models.split(",") if m]:
        results["models"][name] = time_model(name, args.rounds, args.steps, args.fault_at)
    results["load_after"] = os.getloadavg()

    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)  # the tables are wide; a pipe would wrap them at 80 columns
    load = "/".join(f"{v:.1f}" for v in results["load_before"])
    for clock in ("wall", "cpu"):
        table = Table(title=f"guard overhead, {'process CPU' if clock == 'cpu' else 'wall'} time: step time / plain "
                            f"PyTorch (median \\[range] of {args.rounds} interleaved rounds of {args.steps} steps, "
                            f"{args.threads} threads, load {load})")
        table.add_column("model")
        table.add_column("plain ms", justify="right")
        for c in CONFIGS[1:]:
            table.add_column(c, justify="right")
        table.add_column("ckpt+guard / ckpt", justify="right")
        for name, r in results["models"].items():
            r = r[clock]
            cells = [f"{r['ratio'][c]:.3f}x [{r['range'][c][0]:.2f}-{r['range'][c][1]:.2f}]" for c in CONFIGS[1:]]
            lo, hi = r["guard_vs_ckpt_range"]
            table.add_row(name, f"{r['step_ms']['plain']:.2f}", *cells, f"{r['guard_vs_ckpt']:.3f}x [{lo:.2f}-{hi:.2f}]")
        console.print(table)
    table = Table(title=f"one rewind + replay (NaN at step {args.fault_at}, replayed from the snapshot at step 0): the poisoned "
                        "block's extra time over the healthy ckpt+guard block (median \\[range])")
    for col in ("model", "replayed steps", "wall ms", "CPU ms", "= plain steps (CPU)"):
        table.add_column(col, justify="right")
    for name, r in results["models"].items():
        w, c = r["wall"], r["cpu"]
        table.add_row(name, str(r["replayed_steps"]),
                      f"{w['rewind_ms']:.0f} [{w['rewind_range_ms'][0]:.0f}-{w['rewind_range_ms'][1]:.0f}]",
                      f"{c['rewind_ms']:.0f} [{c['rewind_range_ms'][0]:.0f}-{c['rewind_range_ms'][1]:.0f}]",
                      f"{c['rewind_in_plain_steps']:.1f}")
    console.print(table)
    table = Table(title="the guard's own CPU time per step, measured in its hooks (median of 3 blocks)")
    for col in ("model", "sentry µs", "boundary + snapshots µs", "share of the plain step"):
        table.add_column(col, justify="right")
    for name, r in results["models"].items():
        hk = r["hooks"]
        table.add_row(name, f"{hk['sentry']:.0f}", f"{hk['boundary']:.0f}", f"{hk['share_of_plain_step'] * 100:.2f}%")
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    logging.getLogger("trainguard").setLevel(logging.ERROR)  # here, not in main(): tests call main()
    main()
