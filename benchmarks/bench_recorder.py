"""Recorder overhead: training steps plain, under each mode, and under detect_anomaly.

Configurations are interleaved round by round in one process (in a rotated order each round)
so that machine noise hits them alike. Each recording mode runs on both backends: ``native:MODE``
(the C++ core on RecordFunction) and ``python:MODE`` (the dispatch mode). Each round gives a paired ratio, the configuration's
median step time over plain's median in the same round; a cell is the median of those ratios
with their range. ``dispatch_floor`` is a ``TorchDispatchMode`` that only calls the op: what
any recorder built on Python dispatch pays before it records anything. Peak memory is
measured per configuration in a fresh subprocess (peak RSS of the whole process).

    python benchmarks/bench_recorder.py                 # all models, all modes
    python benchmarks/bench_recorder.py --models mlp --rounds 3 --steps 5 --backends native
    python benchmarks/bench_recorder.py --device cuda   # on a GPU: steps end with a synchronize,
                                                        # peak memory is the device's allocator peak
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

MODES = ["no_tensor", "curt_health", "concise_health", "full_health", "shape", "stats", "full_tensor"]


def make_mlp():
    """About 100 ops per step (forward, backward, Adam), ~5 ms on 2 CPU threads."""
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


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import make_nanogpt, make_ppo, make_vae  # noqa: E402

MODELS = {"mlp": make_mlp, "cnn": make_cnn, "transformer": make_transformer, "nanogpt": make_nanogpt,
          "vae": make_vae, "ppo": make_ppo}
BACKENDS = ["native", "python"]


class _BareMode(TorchDispatchMode):
    """Calls the op and nothing else: the floor of interception through Python dispatch."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func._op(*args, **kwargs) if kwargs else func._op(*args)


FLOOR = "dispatch_floor"


def context(config: str, tmp: str):
    import trainguard as tg

    if config == "plain":
        return contextlib.nullcontext()
    if config == FLOOR:
        return _BareMode()
    if config == "detect_anomaly":
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        return torch.autograd.detect_anomaly(check_nan=True)
    backend, mode = config.split(":") if ":" in config else ("auto", config)
    return tg.record(os.path.join(tmp, f"{backend}-{mode}-{time.monotonic_ns()}"), mode=mode, buffer=1000,
                     backend=backend)


# What a step costs: wall time, or (--clock cpu) the CPU time of every thread of this process,
# which the load of other processes on a shared machine disturbs much less (the run writer's
# child process is not counted, for any configuration).
_step_clock = time.perf_counter


def _no_sync() -> None:
    return None


# Waits for the device's queued work before a step's time is read (--device cuda).
_sync = _no_sync


def run_steps(opt, loss_fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = _step_clock()
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
        _sync()
        times.append(_step_clock() - t)
    return times


WARMUP_SECONDS = 0.5


def warm_up(opt, loss_fn, seconds: float) -> None:
    """At least one step, and steps until ``seconds`` have passed (every config alike)."""
    end = time.perf_counter() + seconds
    run_steps(opt, loss_fn, 1)
    while time.perf_counter() < end:
        run_steps(opt, loss_fn, 1)


def time_model(name: str, configs: list[str], rounds: int, steps: int) -> tuple[dict, dict]:
    """Median step time per config (s), and per config the paired ratio to plain of each round."""
    torch.manual_seed(0)
    model, opt, loss_fn = MODELS[name]()
    run_steps(opt, loss_fn, 3)  # warm up allocator and kernels
    per: dict[str, list[float]] = {c: [] for c in configs}
    ratios: dict[str, list[float]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            this: dict[str, float] = {}
            for c in order:
                with context(c, tmp):
                    # Steady state: the first steps of a recording intern stacks and overlap the
                    # start of the writer process (~0.2 s of CPU), a one-off cost per run.
                    warm_up(opt, loss_fn, WARMUP_SECONDS)
                    times = run_steps(opt, loss_fn, steps)
                per[c].extend(times)
                this[c] = statistics.median(times)
            for c in configs:
                ratios[c].append(this[c] / this["plain"])
    return {c: statistics.median(v) for c, v in per.items()}, ratios


def use_device(device: str) -> None:
    """Make ``device`` the default for every tensor the models and their data create (a default
    device is a torch-function mode on every call: left unset for the CPU, the default anyway)."""
    global _sync
    if torch.device(device).type == "cpu":
        return
    torch.set_default_device(device)
    if torch.device(device).type == "cuda":
        _sync = torch.cuda.synchronize


def peak_memory(name: str, config: str, steps: int, device: str = "cpu") -> tuple[float, float]:
    """Peak RSS (MiB) while training ``steps`` steps under ``config``, in a fresh process that
    imports the same modules (the native core included, which a recording loads once);
    the peak is reset after the imports (Linux ``clear_refs``), so import-time spikes do not
    hide the training's own peak. Also the RSS (MiB) that loading the native core added to the
    process, which had imported torch and trainguard.capture."""
    code = f"""
import re, sys, tempfile
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import bench_recorder as b, torch, trainguard.capture
from trainguard.capture import _native
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
before = rss()
assert _native.load() is not None
loaded = rss() - before
b.use_device({device!r})
torch.manual_seed(0)
model, opt, loss_fn = b.MODELS[{name!r}]()
cuda = torch.device({device!r}).type == "cuda"
with tempfile.TemporaryDirectory() as tmp:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the peak (VmHWM) to the current RSS
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with b.context({config!r}, tmp):
        b.run_steps(opt, loss_fn, {steps})
    status = open("/proc/self/status").read()
kib = torch.cuda.max_memory_allocated() // 1024 if cuda else int(re.search(r"VmHWM:\\s+(\\d+)", status).group(1))
print(kib, loaded)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    kib, loaded = out.stdout.strip().splitlines()[-1].split()
    return int(kib) / 1024, int(loaded) / 1024


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,cnn,transformer,nanogpt,vae,ppo")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration per round")
    p.add_argument("--memory-steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=None,
                   help="torch's intra-op threads (default 2; 1 with --clock cpu: on a loaded machine an "
                        "OpenMP worker spin-waits for a descheduled partner, and that CPU time is noise "
                        "of the load, not the recorder's: measured 0.11x-10x ranges with 2)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="time steps by wall clock or by the process's CPU time (all its threads)")
    p.add_argument("--device", default="cpu",
                   help="where the models train (cuda: each step ends with a synchronize; peak memory is "
                        "torch.cuda.max_memory_allocated instead of the process's RSS)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    use_device(args.device)
    cuda = torch.device(args.device).type == "cuda"
    memory = "peak device memory" if cuda else "peak RSS"
    global _step_clock
    _step_clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads is None:
        args.threads = 1 if args.clock == "cpu" else 2
    torch.set_num_threads(args.threads)
    models = [m for m in args.models.split(",") if m]
    backends = [b for b in args.backends.split(",") if b]
    configs = (["plain", FLOOR] + [f"{b}:{m}" for m in args.modes.split(",") if m for b in backends]
               + ["detect_anomaly"])

    results: dict = {"threads": args.threads, "clock": args.clock, "device": args.device, "models": {}}
    for name in models:
        # full_tensor writes thousands of files whose write-back and deletion go on in the kernel
        # after its rounds end: timed in its own rounds beside plain, so it disturbs no other mode.
        heavy = [c for c in configs if c.endswith("full_tensor")]
        t, rounds = time_model(name, [c for c in configs if c not in heavy], args.rounds, args.steps)
        if heavy:
            t2, rounds2 = time_model(name, ["plain"] + heavy, args.rounds, args.steps)
            rounds.update({c: rounds2[c] for c in heavy})  # paired with its own plain rounds
            t.update({c: t2[c] for c in heavy})
            t["plain (full_tensor rounds)"] = t2["plain"]
        ratio = {c: statistics.median(v) for c, v in rounds.items()}
        mem_plain, results["kernel_rss_mib"] = peak_memory(name, "plain", args.memory_steps, args.device)
        peak = {"plain": mem_plain}
        for b in backends:
            peak[b] = peak_memory(name, f"{b}:full_health", args.memory_steps, args.device)[0]
            peak[f"{b}_ratio"] = peak[b] / mem_plain
        results["models"][name] = {"step_ms": {c: v * 1e3 for c, v in t.items()},
                                   "ratio": ratio,
                                   "ratio_range": {c: [min(v), max(v)] for c, v in rounds.items()},
                                   "peak_mib": peak}

    from rich.console import Console
    from rich.table import Table

    what = "CPU time" if args.clock == "cpu" else "step time"
    table = Table(title=f"recorder overhead: {what} / plain {what} in the same round (median "
                        f"\\[range] of {args.rounds} interleaved rounds x {args.steps} steps, {args.threads} threads, "
                        f"{args.device})")
    table.add_column("config")
    for name in models:
        table.add_column(f"{name}\n({results['models'][name]['step_ms']['plain']:.1f} ms plain)", justify="right")
    for c in configs:
        cells = []
        for m in models:
            lo, hi = results["models"][m]["ratio_range"][c]
            cells.append(f"{results['models'][m]['ratio'][c]:.2f}x [{lo:.2f}-{hi:.2f}]")
        table.add_row(c, *cells)
    table.add_row(f"{memory} plain", *[f"{results['models'][m]['peak_mib']['plain']:.0f} MiB" for m in models])
    for b in backends:
        table.add_row(f"{memory} {b}:full_health", *[
            f"{results['models'][m]['peak_mib'][b]:.0f} MiB ({results['models'][m]['peak_mib'][b + '_ratio']:.2f}x)"
            for m in models])
    Console().print(table)
    Console().print(f"Every peak-RSS process loads the native core first; loading it adds "
                    f"{results['kernel_rss_mib']:.1f} MiB once per process.")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return results


if __name__ == "__main__":
    main()
