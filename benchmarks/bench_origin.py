"""What intended infinities and NaN storms cost a recording (issue 11's targets, side by side).

Two pairs, each recorded with ``full_health`` and the default ``buffer=1000``, interleaved round
by round in one process (in a rotated order each round):

* ``mask``: a causal transformer LM (nanoGPT's attention with its hand-written mask) whose
  mask is filled with ``-inf`` against the same model filled with ``torch.finfo(dtype).min``.
  Target: the ``-inf`` run records as fast and as small as the finite one (within 10%): its
  intended infinities are counted, never pinned one by one.
* ``storm``: a model whose parameters turn NaN at the first timed step, so that every op after
  it makes NaN, against the same model healthy. Target: at most 1.2x the healthy recording's
  step time, run directory within 2x (the first harmful chain is kept, the first harmful
  execution per op type and step, counts for the rest).

Each cell is the median over rounds of the paired ratio (this round's median step time, or the
run directory's size, over its partner's in the same round), with the range over rounds. Step
time is measured twice: wall time, and the CPU time of this process (all its threads: training
and writer), which a shared machine's load disturbs much less.

    python benchmarks/bench_origin.py
    python benchmarks/bench_origin.py --rounds 3 --steps 6 --pairs storm-mlp
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class _Attention(nn.Module):
    """nanoGPT's CausalSelfAttention (karpathy/nanoGPT, model.py, the non-flash path)."""

    def __init__(self, embd: int, heads: int, block: int, fill: float):
        super().__init__()
        self.c_attn = nn.Linear(embd, 3 * embd)
        self.c_proj = nn.Linear(embd, embd)
        self.heads, self.fill = heads, fill
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        fill = self.fill if self.fill is not None else torch.finfo(att.dtype).min
        att = F.softmax(att.masked_fill(self.bias[:, :, :T, :T] == 0, fill), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class _LM(nn.Module):
    def __init__(self, fill: float | None, vocab=64, block=64, embd=64, heads=4, layers=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, embd), nn.Embedding(block, embd)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict({"ln1": nn.LayerNorm(embd), "attn": _Attention(embd, heads, block, fill),
                                              "ln2": nn.LayerNorm(embd), "mlp": nn.Sequential(
                                                  nn.Linear(embd, 4 * embd), nn.GELU(), nn.Linear(4 * embd, embd))}))
        self.head = nn.Linear(embd, vocab)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for b in self.blocks:
            x = x + b["attn"](b["ln1"](x))
            x = x + b["mlp"](b["ln2"](x))
        return self.head(x)


def make_lm(fill):
    torch.manual_seed(0)
    model = _LM(fill)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 64, (8, 64), generator=g)
    return model, opt, lambda: F.cross_entropy(model(idx).view(-1, 64), torch.roll(idx, -1, 1).view(-1))


def make_mlp():
    from bench_recorder import make_mlp as mlp

    torch.manual_seed(0)
    return mlp()


def _poison(model) -> None:
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))


# pair -> (config a, config b): (name, builder, poisoned). The ratio is a / b.
PAIRS = {
    "mask": (("-inf", lambda: make_lm(float("-inf")), False), ("finfo.min", lambda: make_lm(None), False)),
    "storm-mlp": (("nan storm", make_mlp, True), ("healthy", make_mlp, False)),
    "storm-lm": (("nan storm", lambda: make_lm(float("-inf")), True), ("healthy", lambda: make_lm(float("-inf")), False)),
}


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def run_config(builder, poisoned: bool, tmp: str, warm: int, steps: int) -> tuple[float, int, int, float]:
    """(median step time, run directory bytes, stored executions, median step CPU time) of one
    fresh recording."""
    import trainguard as tg

    model, opt, loss_fn = builder()
    for _ in range(2):  # allocator and kernels, unrecorded
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    d = os.path.join(tmp, f"r-{time.monotonic_ns()}")
    times, cpu = [], []
    with tg.record(d, mode="full_health", buffer=1000):
        for i in range(warm + steps):
            if i == warm and poisoned:
                _poison(model)
            t, c = time.perf_counter(), time.process_time()
            opt.zero_grad()
            loss_fn().backward()
            opt.step()
            if i >= warm:
                times.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
    with tg.open(d) as run:
        stored = run.count()
        if not hasattr(run, "first_harm"):  # a trainguard before format 3 (for a "before" figure)
            pass
        elif poisoned:
            assert run.alerts()["total"] > 0, "the storm made no harmful value"
        else:
            assert run.alerts()["total"] == 0, "the healthy run has an alert"
    return statistics.median(times), _size(d), stored, statistics.median(cpu)


def time_pair(pair: str, rounds: int, warm: int, steps: int) -> dict:
    a, b = PAIRS[pair]
    t_ratio, c_ratio, s_ratio, seen = [], [], [], {a[0]: [], b[0]: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            this = {}
            for name, builder, poisoned in ((a, b) if r % 2 == 0 else (b, a)):
                this[name] = run_config(builder, poisoned, tmp, warm, steps)
                seen[name].append(this[name])
            t_ratio.append(this[a[0]][0] / this[b[0]][0])
            c_ratio.append(this[a[0]][3] / this[b[0]][3])
            s_ratio.append(this[a[0]][1] / this[b[0]][1])
    return {
        "a": a[0], "b": b[0],
        "time_ratio": statistics.median(t_ratio), "time_range": [min(t_ratio), max(t_ratio)],
        "cpu_ratio": statistics.median(c_ratio), "cpu_range": [min(c_ratio), max(c_ratio)],
        "size_ratio": statistics.median(s_ratio), "size_range": [min(s_ratio), max(s_ratio)],
        "step_ms": {k: 1e3 * statistics.median(x[0] for x in v) for k, v in seen.items()},
        "size_kib": {k: statistics.median(x[1] for x in v) / 1024 for k, v in seen.items()},
        "stored": {k: statistics.median(x[2] for x in v) for k, v in seen.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", default=",".join(PAIRS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warm", type=int, default=3, help="recorded steps before the timed ones (and the NaN)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per recording")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = {"threads": args.threads, "load": os.getloadavg()[0], "pairs": {}}
    print(f"{'pair':10} {'a / b':24} {'wall a/b [range]':20} {'cpu a/b [range]':20} {'run dir a/b [range]':20} "
          f"{'wall ms a, b':16} {'stored a, b'}")
    for pair in [x for x in args.pairs.split(",") if x]:
        r = out["pairs"][pair] = time_pair(pair, args.rounds, args.warm, args.steps)
        ms = r["step_ms"]
        cells = [f"{r[k + '_ratio']:.2f}x [{r[k + '_range'][0]:.2f}-{r[k + '_range'][1]:.2f}]"
                 for k in ("time", "cpu", "size")]
        print(f"{pair:10} {r['a'] + ' / ' + r['b']:24} {cells[0]:20} {cells[1]:20} {cells[2]:20} "
              f"{ms[r['a']] :.1f}, {ms[r['b']]:.1f}{'':6} {r['stored'][r['a']]:.0f}, {r['stored'][r['b']]:.0f}")
    print(f"(load average {out['load']:.2f} before the run; {args.rounds} rounds x {args.steps} timed steps)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return out


if __name__ == "__main__":
    main()
