"""Monitor overhead: training steps plain, under trainguard.Monitor (every=10 and every=1), and under
a hook-based monitor that calls ``.item()`` per statistic per layer (the NetworkDebugger lesson's
approach), at every step and every 10th.

``monitor every=10 validation=off`` is the monitor without its validation watch (the wrapped
losses and the signatures of sampled input rows, ``trainguard.capture._monitor_leak``): the
difference to ``monitor every=10`` is what hashing the training inputs costs.

Configurations are interleaved round by round, in a shuffled order, in one process so that machine
noise hits them alike. A cell is the mean step time over a block of steps (so the one recording step in ten
counts), median over rounds, divided by plain's. ``swish_mlp`` has a custom autograd Function, which
the monitor's live gradient check checks once per monitor (here once per round, on its background
thread): ``monitor every=10 no-gradcheck`` beside ``monitor every=10`` is that check's share, and
the seconds each check took are printed below the tables.

    python benchmarks/bench_monitor.py                      # mlp, cnn, transformer, swish_mlp
    python benchmarks/bench_monitor.py --models mlp --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import random
import statistics
import tempfile
import time

import torch
from torch import nn


def make_mlp():
    """About 100 ops per step (forward, backward, Adam), a few ms on 2 CPU threads."""
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 784), torch.randint(0, 10, (256,))
    return model, opt, lambda: nn.functional.cross_entropy(model(x), y)


def make_cnn():
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    return model, opt, lambda: nn.functional.cross_entropy(model(x), y)


def make_transformer():
    """One pre-norm transformer encoder block, >= 30 ms per step on 2 CPU threads."""
    model = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True,
                                       norm_first=True, dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, 128, 256)
    return model, opt, lambda: model(x).pow(2).mean()


class Swish(torch.autograd.Function):
    """A custom autograd Function (correct backward): what the live gradient check checks."""

    @staticmethod
    def forward(ctx, x):
        s = torch.sigmoid(x)
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx, grad):
        x, s = ctx.saved_tensors
        return grad * (s + x * s * (1 - s))


class SwishMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(784, 512), nn.Linear(512, 256), nn.Linear(256, 10)])

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = Swish.apply(layer(x))
        return self.layers[-1](x)


def make_swish_mlp():
    """The mlp with a custom autograd Function as its activation (checked once per monitor)."""
    model = SwishMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 784), torch.randint(0, 10, (256,))
    return model, opt, lambda: nn.functional.cross_entropy(model(x), y)


MODELS = {"mlp": make_mlp, "cnn": make_cnn, "transformer": make_transformer, "swish_mlp": make_swish_mlp}
# Seconds each live gradient check took (on the monitor's background thread), per model.
GRADCHECK_SECONDS: dict[str, list[float]] = {}


class ItemHookMonitor:
    """The lesson's approach: forward hooks and gradient hooks that read each statistic with ``.item()``.

    Per leaf module: activation mean, std, min, max, fraction of zeros, fraction of dead units;
    per parameter: gradient mean |g|, max |g|, norm. Every ``.item()`` is a host sync.
    """

    def __init__(self, model: nn.Module, every: int):
        self.every = every
        self.step = 0
        self.stats: list[tuple[str, str, float]] = []
        self.handles = []
        for name, m in model.named_modules():
            if list(m.children()):
                continue
            self.handles.append(m.register_forward_hook(self._forward(name)))
        for name, p in model.named_parameters():
            self.handles.append(p.register_hook(self._grad(name)))
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.opt_hook = register_optimizer_step_post_hook(self._stepped)

    def _on(self) -> bool:
        return self.step % self.every == 0

    def _forward(self, name):
        def hook(module, args, out):
            if not self._on() or not isinstance(out, torch.Tensor) or not out.is_floating_point():
                return
            x = out.detach()
            self.stats += [
                (name, "mean", x.mean().item()),
                (name, "std", x.std().item()),
                (name, "min", x.min().item()),
                (name, "max", x.max().item()),
                (name, "zero_frac", (x == 0).float().mean().item()),
                (name, "dead_frac", (~(x != 0).any(0)).float().mean().item() if x.dim() > 1 else 0.0),
            ]

        return hook

    def _grad(self, name):
        def hook(g):
            if self._on():
                self.stats += [
                    (name, "grad_mean_abs", g.abs().mean().item()),
                    (name, "grad_max_abs", g.abs().max().item()),
                    (name, "grad_norm", g.norm().item()),
                ]

        return hook

    def _stepped(self, opt, args, kwargs):
        self.step += 1

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.opt_hook.remove()


@contextlib.contextmanager
def configured(config: str, model: nn.Module, tmp: str):
    if config == "plain":
        yield
        return
    if config.startswith("item_hooks"):
        mon = ItemHookMonitor(model, every=int(config.split("every=")[1]))
        try:
            yield
        finally:
            mon.close()
        return
    from trainguard import Monitor

    every = int(config.split("every=")[1].split()[0])
    mon = Monitor(model, os.path.join(tmp, f"m-{time.monotonic_ns()}"), every=every, diagnose=False,
                  gradcheck="no-gradcheck" not in config,
                  validation="validation=off" not in config)
    try:
        yield
    finally:
        mon.close()
        if mon._gradcheck is not None:
            GRADCHECK_SECONDS.setdefault(type(model).__name__, []).extend(
                r["seconds"] for r in mon._gradcheck.results)


def run_block(opt, loss_fn, n: int) -> tuple[float, float]:
    """Mean wall-clock and process-CPU seconds per step over ``n`` steps.

    CPU time counts the work of this process (all its threads, the writer thread included) and is
    the steadier of the two on a machine shared with other jobs.
    """
    t, c = time.perf_counter(), time.process_time()
    for _ in range(n):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    return (time.perf_counter() - t) / n, (time.process_time() - c) / n


CONFIGS = ["plain", "monitor every=10", "monitor every=1", "item_hooks every=10", "item_hooks every=1",
           # the live gradient check's share: each round's new monitor checks the custom Function once
           "monitor every=10 no-gradcheck"]
# The validation pass's share (loss wrappers, input-row signatures): the monitor without it.
CONFIGS.append("monitor every=10 validation=off")


def time_model(name: str, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """Median over rounds of the mean step time, per configuration, for the wall and the CPU clock."""
    torch.manual_seed(0)
    model, opt, loss_fn = MODELS[name]()
    run_block(opt, loss_fn, 3)  # warm up allocator and kernels
    per: dict[str, list[tuple[float, float]]] = {c: [] for c in CONFIGS}
    order = list(CONFIGS)
    shuffle = random.Random(0).shuffle
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            shuffle(order)  # no configuration always runs right after another one's teardown
            for c in order:
                gc.collect()
                with configured(c, model, tmp):
                    run_block(opt, loss_fn, 1)  # the first step attaches (and records, step 0)
                    per[c].append(run_block(opt, loss_fn, steps))
    return {
        clock: {c: statistics.median(v[i] for v in per[c]) for c in CONFIGS}
        for i, clock in enumerate(("wall", "cpu"))
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,cnn,transformer,swish_mlp")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration per round (multiple of 10)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    GRADCHECK_SECONDS.clear()
    results: dict = {"threads": args.threads, "rounds": args.rounds, "steps": args.steps, "models": {}}
    for name in [m for m in args.models.split(",") if m]:
        t = time_model(name, args.rounds, args.steps)
        results["models"][name] = {
            clock: {"step_ms": {c: v[c] * 1e3 for c in CONFIGS}, "ratio": {c: v[c] / v["plain"] for c in CONFIGS}}
            for clock, v in t.items()
        }

    from rich.console import Console
    from rich.table import Table

    for clock in ("wall", "cpu"):
        table = Table(title=f"monitor overhead, {clock} time: step time / plain (median of {args.rounds} rounds of "
                            f"{args.steps} steps, {args.threads} threads)")
        table.add_column("model")
        table.add_column("plain ms", justify="right")
        for c in CONFIGS[1:]:
            table.add_column(c, justify="right")
        for name, r in results["models"].items():
            r = r[clock]
            table.add_row(name, f"{r['step_ms']['plain']:.2f}", *[f"{r['ratio'][c]:.2f}x" for c in CONFIGS[1:]])
        Console().print(table)
    checks = {name: sorted(v) for name, v in GRADCHECK_SECONDS.items() if v}
    results["gradcheck_seconds"] = checks
    for name, v in checks.items():
        Console().print(f"live gradient check of {name}'s custom Functions: {len(v)} checks, median "
                        f"{statistics.median(v) * 1e3:.1f} ms, max {max(v) * 1e3:.1f} ms on the background thread "
                        f"(one check per monitor, i.e. per round of {args.steps} steps here)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    logging.getLogger("trainguard").setLevel(logging.ERROR)  # here, not in main(): tests call main()
    main()
