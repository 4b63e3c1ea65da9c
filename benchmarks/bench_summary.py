"""The native summary kernel's bandwidth: one summary of a tensor beside torch.sum and a copy.

How far the full_health pass is from memory bandwidth, per dtype and per vector pass the CPU has
(``baseline``: SSE2 on x86-64, the compiler's own on other CPUs; ``avx2``), on data just written
by an op (``hot``, as a recording sees an op's output) and on data evicted by a larger write
(``cold``). Each round times every row on the same tensor, interleaved; a cell is the median over
rounds of the row's thread CPU time over ``torch.sum``'s in the same round, with the range, and
the row's median GB/s. torch runs on one thread (so does the kernel).

    python benchmarks/bench_summary.py
    python benchmarks/bench_summary.py --mib 2,8 --dtypes float32,float16 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainguard.capture import _native

PASSES = ["baseline", "avx2"]
MODES = {"curt_health": 1, "full_health": 3, "stats": 6}


def measure(mod, x: torch.Tensor, passes: list[str], modes: list[str], state: str, evict: torch.Tensor,
            rounds: int, reps: int) -> dict:
    """{row: (median ratio to torch.sum, min, max, GB/s)} for one tensor in one cache state."""
    y, z = x + 1, torch.zeros_like(x)  # written: fresh memory is the zero page, or garbage (NaN: the exact pass)
    # (vector pass to select first or None, the call timed); copy reads y and writes z
    rows = {"torch.sum": (None, lambda: y.sum()), "copy": (None, lambda: z.copy_(y))}
    for level, pname in enumerate(passes):
        for mode in modes:
            rows[f"{pname}:{mode}"] = (level, lambda c=MODES[mode]: mod.summarize(y, c, False))
    times: dict[str, list[float]] = {r: [] for r in rows}
    for r in range(rounds):
        names = list(rows)
        for row in names[r % len(names):] + names[: r % len(names)]:
            level, call = rows[row]
            if level is not None:
                mod._simd(level)
            ts = []
            for _ in range(reps):
                if state == "hot":
                    torch.add(x, 1, out=y)  # y just written, as an op's output is
                else:
                    evict.fill_(1.0)
                t0 = time.thread_time_ns()
                call()
                ts.append(time.thread_time_ns() - t0)
            times[row].append(statistics.median(ts))
    out = {}
    for row, ts in times.items():
        ratios = [t / s for t, s in zip(ts, times["torch.sum"])]
        out[row] = (statistics.median(ratios), min(ratios), max(ratios), x.numel() * x.element_size() / statistics.median(ts))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", default="2,16", help="tensor sizes in MiB")
    p.add_argument("--dtypes", default="float32,float16,bfloat16,float64")
    p.add_argument("--modes", default="full_health")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=9, help="timed calls per row per round (median)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    mod = _native.build()
    old, best = mod._simd()
    passes = PASSES[: best + 1]
    evict = torch.empty(64 << 18)  # 64 MiB: more than this CPU kind's L3
    results: dict = {}
    try:
        for mib in [float(m) for m in args.mib.split(",")]:
            for name in args.dtypes.split(","):
                dtype = getattr(torch, name)
                n = int(mib * (1 << 20)) // torch.empty((), dtype=dtype).element_size()
                x = torch.randn(n).to(dtype)
                for state in ("hot", "cold"):
                    results[f"{name} {mib:g} MiB {state}"] = measure(mod, x, passes, args.modes.split(","), state,
                                                                    evict, args.rounds, args.reps)
    finally:
        mod._simd(old)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"summary kernel: thread CPU time / torch.sum's in the same round (median \\[range] of "
                        f"{args.rounds} rounds x {args.reps} calls), and GB/s of the tensor's bytes")
    table.add_column("tensor")
    row_names = list(next(iter(results.values())))
    for row in row_names:
        table.add_column(row, justify="right")
    for key, cells in results.items():
        table.add_row(key, *[f"{cells[r][0]:.2f}x [{cells[r][1]:.2f}-{cells[r][2]:.2f}] {cells[r][3]:.1f}"
                             if r in cells else "" for r in row_names])
    Console().print(table)
    return results


if __name__ == "__main__":
    main()
