"""Recording and monitoring compiled models: step time beside plain compiled and eager.

Per model, one process holds four copies with the same weights: eager, compiled by plain
Inductor, compiled with ``trainguard.compile_backend()`` (the summaries inside the compiled
code), and compiled by plain Inductor for the monitor (whose taps are traced into it).
Configurations are interleaved round by round in a rotated order so that machine noise hits
them alike; a cell is the median over rounds of the configuration's median step time over its
baseline's in the same round (eager rows over eager plain, compiled rows over compiled plain;
the monitor's rows: mean over whole periods, over the baseline's mean, see ``round_ratio``);
"cpu" is the same ratio of the process's CPU time per step (median over rounds), which other
processes' load disturbs less than wall time. Compilation happens before the rounds (Inductor's FX graph cache makes later runs faster).

    python benchmarks/bench_compile.py                          # mlp and transformer
    python benchmarks/bench_compile.py --models mlp --rounds 3 --steps 5
    python benchmarks/bench_compile.py --compile-step   # the optimizer step compiled too
    python benchmarks/bench_compile.py --fresh-cache    # cold compile times (empty Inductor cache)

``--compile-step`` also compiles each compiled copy's optimizer step with the copy's backend
(``torch.compile`` of a function calling ``opt.step()``, as PyTorch's "compiling the optimizer"
recipe does); without it the step runs eagerly and a recording records it op by op.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_recorder  # noqa: E402  (the same models as the eager benchmark)


def _batch(x, y=None):
    """The loss of the benchmark models, as a function of the module that runs the step."""
    if y is None:
        return lambda run: run(x).pow(2).mean()
    return lambda run: nn.functional.cross_entropy(run(x), y)


def _data(shape, classes=None):
    g = torch.Generator().manual_seed(1)  # drawn on the CPU, then moved (--device)
    dev = torch.get_default_device()
    x = torch.randn(*shape, generator=g, device="cpu").to(dev)
    y = None if classes is None else torch.randint(0, classes, (shape[0],), generator=g, device="cpu").to(dev)
    return _batch(x, y)


# name -> (model and optimizer, as the eager benchmark makes them; the batch's loss)
MODELS = {
    "mlp": (bench_recorder.make_mlp, lambda: _data((256, 784), 10)),
    "transformer": (bench_recorder.make_transformer, lambda: _data((16, 128, 256))),
    "cnn": (bench_recorder.make_cnn, lambda: _data((32, 3, 32, 32), 10)),
}


# The monitor's period in this benchmark. A monitor is opened afresh each round; its first steps
# pay for opening it (once per run in a real program), so each round first runs one whole period
# and then times whole periods, one recording step in every ``MONITOR_EVERY``.
MONITOR_EVERY = 10
# The monitor's leak watch hashes the training rows of its first forwards until its sketch buffer
# is full (32,768 rows: 128 steps of the MLP's 256-row batches), then costs nothing: a run pays it
# once. The "steady" row first runs this many steps under its monitor, past that fill for the MLP
# (not for the transformer block's 16-row batches, which fill it after 2,048 steps).
STEADY_WARMUP_STEPS = 14 * MONITOR_EVERY

# (config, which copy of the model runs, baseline config)
CONFIGS = [
    ("eager plain", "eager", "eager plain"),
    ("eager full_health", "eager", "eager plain"),
    ("compiled plain", "compiled", "compiled plain"),
    ("compiled, summaries only", "recorded", "compiled plain"),  # the same graphs, no recording
    ("compiled full_health", "recorded", "compiled plain"),
    (f"compiled monitor every={MONITOR_EVERY}", "monitored", "compiled plain"),
    (f"compiled monitor every={MONITOR_EVERY}, steady", "monitored", "compiled plain"),
]
WARMUP_STEPS = 3


class _CompiledStep:
    """An optimizer whose ``step`` runs compiled by ``backend`` (what ``run_steps`` calls)."""

    def __init__(self, opt, backend):
        self.zero_grad = opt.zero_grad
        self.step = torch.compile(lambda: opt.step(), backend=backend)


# Graphs the plain copies' backend was given with symbolic sizes (Dynamo's automatic dynamic
# shapes), counted per model: a benchmark of static shapes must have none.
_dynamic_graphs = [0]


def _inductor(gm, example_inputs):
    """Inductor, as ``backend="inductor"``, counting the graphs it gets with symbolic sizes."""
    from torch._inductor.compile_fx import compile_fx

    def symbolic(x) -> bool:
        return isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor)
                                               and any(isinstance(d, torch.SymInt) for d in x.shape))

    if any(symbolic(x) for x in example_inputs):
        _dynamic_graphs[0] += 1
    return compile_fx(gm, example_inputs)


def _copies(name: str, compile_step: bool = False) -> dict:
    """The four copies of one model (same initial weights), each with its own optimizer."""
    import trainguard as tg

    torch.manual_seed(0)
    make, batch = MODELS[name]
    model, opt, _ = make()
    loss = batch()
    out = {}
    for kind, backend in (("eager", None), ("compiled", _inductor), ("recorded", tg.compile_backend()),
                          ("monitored", _inductor)):
        # One deepcopy of both: the optimizer's copy holds the model copy's parameters (its
        # defaults cannot always be passed back to its constructor: AdamW's).
        m, o = copy.deepcopy((model, opt))
        run = m if backend is None else torch.compile(m, backend=backend)
        if compile_step and backend is not None:
            o = _CompiledStep(o, backend)
        out[kind] = (m, o, lambda run=run: loss(run))
    return out


def context(config: str, model, tmp: str):
    import trainguard as tg

    if config.endswith("full_health"):
        return tg.record(os.path.join(tmp, f"r-{time.monotonic_ns()}"), mode="full_health", buffer=1000)
    if "monitor" in config:
        return tg.Monitor(model, os.path.join(tmp, f"m-{time.monotonic_ns()}"), every=MONITOR_EVERY, diagnose=False)
    return contextlib.nullcontext()


def round_ratio(config: str, times: list[float], base_times: list[float]) -> float:
    """A configuration's step time over its baseline's in one round, both by the same statistic:
    the mean for the monitor's rows (whole periods, so that its one recording step in
    ``MONITOR_EVERY`` counts), the median otherwise. (A mean over a median measured the skew of a
    noisy machine's step times, not the monitor: an identical configuration came out 1.2x.)"""
    stat = statistics.fmean if "monitor" in config else statistics.median
    return stat(times) / stat(base_times)


def time_model(name: str, rounds: int, steps: int, compile_step: bool = False) -> tuple[dict, dict, dict, dict]:
    copies = _copies(name, compile_step)
    first: dict[str, float] = {}  # copy -> seconds of its first warm-up steps (its compiles)
    with tempfile.TemporaryDirectory() as tmp:
        for config, kind, _ in CONFIGS:  # compile (under each config's own context) and warm up
            m, opt, loss_fn = copies[kind]
            with context(config, m, tmp):
                t0 = time.perf_counter()
                bench_recorder.run_steps(opt, loss_fn, WARMUP_STEPS)
                first.setdefault(kind, time.perf_counter() - t0)
        per: dict[str, list[float]] = {c: [] for c, _, _ in CONFIGS}
        ratios: dict[str, list[float]] = {c: [] for c, _, _ in CONFIGS}
        cpu_ratios: dict[str, list[float]] = {c: [] for c, _, _ in CONFIGS}
        for r in range(rounds):
            order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
            this, cpu = {}, {}
            for config, kind, _ in order:
                m, opt, loss_fn = copies[kind]
                monitor = "monitor" in config
                n = -(-steps // MONITOR_EVERY) * MONITOR_EVERY if monitor else steps
                warm = (STEADY_WARMUP_STEPS if config.endswith("steady") else MONITOR_EVERY) if monitor else 2
                with context(config, m, tmp):
                    bench_recorder.run_steps(opt, loss_fn, warm)
                    c0 = time.process_time()
                    times = bench_recorder.run_steps(opt, loss_fn, n)
                    # The process's CPU time (every thread, the writer's too): on a shared machine
                    # other processes' load disturbs it less than wall time.
                    cpu[config] = (time.process_time() - c0) / n
                per[config].extend(times)
                this[config] = times
            for config, _, base in CONFIGS:
                ratios[config].append(round_ratio(config, this[config], this[base]))
                cpu_ratios[config].append(cpu[config] / cpu[base])
    return {c: statistics.median(v) for c, v in per.items()}, ratios, cpu_ratios, first


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,transformer")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration per round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile-step", action="store_true",
                   help="compile the optimizer step too (with each compiled copy's backend)")
    p.add_argument("--fresh-cache", action="store_true",
                   help="compile into an empty Inductor cache (the first-steps column is then a cold compile)")
    p.add_argument("--device", default="cpu", help="where the models train (cuda: steps end with a synchronize)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    bench_recorder.use_device(args.device)
    if args.fresh_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-compile-cache-")
    torch.set_num_threads(args.threads)
    # Four copies of one model share their code objects: each copy's graphs are another entry in
    # the same cache (a different backend, other parameters), which must not hit the limit.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    # Inductor's one-time costs (its imports, the CPU's vector ISA probe: ~20 s cold) go to a
    # throwaway compile, not to the first model copy's first steps.
    torch.compile(lambda x: x * 2 + 1)(torch.ones(4))
    load = os.getloadavg()[0]
    results: dict = {"threads": args.threads, "compile_step": args.compile_step, "load_before": load,
                     "device": args.device, "models": {}}
    for name in [m for m in args.models.split(",") if m]:
        # Each model as if alone: its copies share frames with the models before it (nn.Sequential's
        # forward, Module._call_impl), whose other input shapes would make Dynamo compile this
        # model with dynamic shapes (the transformer after the MLP: 1.45x summaries, 1.20x alone).
        torch._dynamo.reset()
        counters.clear()
        _dynamic_graphs[0] = 0
        t, rounds, cpu_rounds, first = time_model(name, args.rounds, args.steps, args.compile_step)
        results["models"][name] = {"step_ms": {c: v * 1e3 for c, v in t.items()},
                                   # each copy's first steps: its compiles (cold with --fresh-cache)
                                   "first_steps_s": first,
                                   # Dynamo's graph breaks in this model's copies by reason's first
                                   # line (trainguard's hooks must add none: compiled stays compiled).
                                   "graph_breaks": {k.splitlines()[0]: v for k, v in counters["graph_break"].items()},
                                   "dynamic_graphs": _dynamic_graphs[0],
                                   "ratio": {c: statistics.median(v) for c, v in rounds.items()},
                                   "ratio_range": {c: [min(v), max(v)] for c, v in rounds.items()},
                                   "cpu_ratio": {c: statistics.median(v) for c, v in cpu_rounds.items()}}
    results["load_after"] = os.getloadavg()[0]

    from rich.console import Console
    from rich.table import Table

    models = list(results["models"])
    table = Table(title=f"compiled models: step time / baseline step time in the same round (median \\[range] of "
                        f"{args.rounds} rounds x {args.steps} steps, {args.threads} threads, "
                        f"optimizer step {'compiled' if args.compile_step else 'eager'}, load "
                        f"{results['load_before']:.1f} -> {results['load_after']:.1f})")
    table.add_column("config")
    table.add_column("baseline")
    for name in models:
        table.add_column(f"{name}\n({results['models'][name]['step_ms']['compiled plain']:.1f} ms compiled, "
                         f"{results['models'][name]['step_ms']['eager plain']:.1f} ms eager)", justify="right")
    for config, _, base in CONFIGS:
        cells = []
        for m in models:
            lo, hi = results["models"][m]["ratio_range"][config]
            cells.append(f"{results['models'][m]['ratio'][config]:.2f}x [{lo:.2f}-{hi:.2f}]"
                         f" cpu {results['models'][m]['cpu_ratio'][config]:.2f}x")
        table.add_row(config, base, *cells)
    console = Console()
    console.print(table)
    first = Table(title="first steps of each copy, its compiles included (seconds; "
                        f"{'empty' if args.fresh_cache else 'warm'} Inductor cache)")
    first.add_column("copy")
    for name in models:
        first.add_column(name, justify="right")
    plain = {m: results["models"][m]["first_steps_s"]["compiled"] for m in models}
    # The monitored copy compiles the plain copy's graphs (its taps aside): served from the cache.
    for kind in [k for k in dict.fromkeys(k for _, k, _ in CONFIGS) if k != "monitored"]:
        first.add_row(kind, *(f"{results['models'][m]['first_steps_s'][kind]:.1f} s"
                              + (f" ({results['models'][m]['first_steps_s'][kind] / plain[m]:.2f}x)"
                                 if kind != "eager" else "") for m in models))
    console.print(first)
    for m in models:
        if results["models"][m]["dynamic_graphs"]:
            console.print(f"{m}: {results['models'][m]['dynamic_graphs']} graphs compiled with dynamic shapes "
                          "(the figures are not those of static shapes)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return results


if __name__ == "__main__":
    logging.getLogger("trainguard").setLevel(logging.ERROR)  # here, not in main(): tests call main()
    main()
