"""What storing executions costs: plain vs the default circular buffer vs ``buffer=-1`` (keep all).

Each configuration records ``--steps`` training steps of one model (``full_health``) and closes the
run; its cost is the CPU time of the training process (all threads, the writer's included) plus
that of the writer's child process (the SQLite sink, reaped at close), divided by the CPU time of
the same steps run plain in the same round. Configurations are interleaved round by round in a
rotated order, so that the load of a shared machine hits them alike; a cell is the median of the
paired ratios with their range. ``sink us/row`` is the sink's CPU per execution it stored (the
training process's own share of storing, marshalling records onto the pipe, is about 0.6 us per
execution: lost in the noise of the step).

    python benchmarks/bench_writer.py                      # mlp and nanogpt, both backends
    python benchmarks/bench_writer.py --models mlp --rounds 3 --steps 100 --backends native
"""

from __future__ import annotations

import argparse
import os
import resource
import sqlite3
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_recorder import MODELS, run_steps  # noqa: E402

BACKENDS = ["native", "python"]
BUFFERS = {"default": 1000, "keep-all": -1}


def _child_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def measure(config: str, opt, loss_fn, steps: int, tmp: str) -> tuple[float, float, int]:
    """(training process CPU s, sink process CPU s, stored executions) of ``steps`` steps and the close."""
    import trainguard as tg

    child0, t0 = _child_cpu(), time.process_time()
    if config == "plain":
        run_steps(opt, loss_fn, steps)
        return time.process_time() - t0, 0.0, 0
    backend, buf = config.split(":")
    run = os.path.join(tmp, f"{backend}-{buf}-{time.monotonic_ns()}")
    with tg.record(run, mode="full_health", buffer=BUFFERS[buf], backend=backend):
        run_steps(opt, loss_fn, steps)
    cpu, child = time.process_time() - t0, _child_cpu() - child0
    with sqlite3.connect(os.path.join(run, "run.sqlite")) as con:
        rows = con.execute("SELECT COUNT(*) FROM executions").fetchone()[0]
    return cpu, child, rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,nanogpt")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    backends = [b for b in args.backends.split(",") if b]
    configs = ["plain"] + [f"{b}:{buf}" for b in backends for buf in BUFFERS]
    models = [m for m in args.models.split(",") if m]
    results: dict = {}
    for name in models:
        torch.manual_seed(0)
        model, opt, loss_fn = MODELS[name]()
        run_steps(opt, loss_fn, 3)
        ratio: dict[str, list[float]] = {c: [] for c in configs}
        sink: dict[str, list[float]] = {c: [] for c in configs}
        rows: dict[str, int] = {}
        per_row: dict[str, list[float]] = {c: [] for c in configs}
        plain_ms = []
        with tempfile.TemporaryDirectory() as tmp:
            for c in configs[1:]:  # a first recording per backend loads the native core, builds stacks
                measure(c, opt, loss_fn, 1, tmp)
            for r in range(args.rounds):
                order = configs[r % len(configs):] + configs[:r % len(configs)]
                got = {c: measure(c, opt, loss_fn, args.steps, tmp) for c in order}
                plain = got["plain"][0]
                plain_ms.append(plain / args.steps * 1e3)
                for c, (cpu, child, n) in got.items():
                    ratio[c].append((cpu + child) / plain)
                    sink[c].append(child / plain)
                    rows[c] = n
                    per_row[c].append(child / max(1, n) * 1e6)
        results[name] = {"plain_ms": statistics.median(plain_ms), "ratio": ratio, "sink": sink, "rows": rows,
                         "us_per_row": per_row}

    from rich.console import Console
    from rich.table import Table

    def cell(v: list[float]) -> str:
        return f"{statistics.median(v):.2f}x [{min(v):.2f}-{max(v):.2f}]"

    table = Table(title=f"storing executions: CPU (training process + sink process) / plain CPU, median [range] "
                        f"of {args.rounds} interleaved rounds x {args.steps} steps, {args.threads} thread(s)")
    table.add_column("config")
    for name in models:
        table.add_column(f"{name} ({results[name]['plain_ms']:.1f} ms plain)", justify="right")
    for c in configs:
        table.add_row(c, *[cell(results[m]["ratio"][c]) for m in models])
        if c != "plain":
            table.add_row("  of which sink", *[cell(results[m]["sink"][c]) for m in models])
            table.add_row("  rows stored, sink us/row", *[
                f"{results[m]['rows'][c]:,}, {statistics.median(results[m]['us_per_row'][c]):.1f} us" for m in models])
    Console().print(table)
    return results


if __name__ == "__main__":
    main()
