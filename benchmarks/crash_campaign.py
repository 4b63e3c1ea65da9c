"""Crash campaign: SIGKILL training at random moments, resume, and check nothing was lost or changed.

Four ways of checkpointing, each killed again and again until it has taken its share of kills:

* ``sync-step-keep1``: the step form, a synchronous save every step, ``keep=1`` (every save prunes);
* ``async-step-keep2``: the step form, background saves every step, ``keep=2``, a loader with two workers;
* ``sync-epoch-keep1``: the epoch form with ``loop.step()``, an interval that ends every epoch, ``keep=1``;
* ``async-epoch-keep2``: the epoch form, background saves every 4 steps, ``keep=2``.

A kill lands at a random moment after the process has started training (sometimes while it is
still starting or restoring). Checked for every resume and every run:

1. the resume starts from a committed checkpoint, at or after the newest one any earlier process
   committed (nothing committed is ever lost; an empty directory after a kill would show here);
2. no committed checkpoint is ever skipped as damaged (only a dead save's temporary directory);
3. every step's loss, re-run or not, is bitwise the loss of an uninterrupted run, and every step ran;
4. the final parameters, optimizer and scheduler state are bitwise those of the uninterrupted run;
5. what is left verifies, and no more than ``keep`` checkpoints are kept.

    python benchmarks/crash_campaign.py                # 40 kills, 10 per way
    python benchmarks/crash_campaign.py --kills 8      # a quick look
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

WORKER = Path(__file__).with_name("_crash_worker.py")
CONFIGS: dict[str, list[str]] = {
    "sync-step-keep1": ["--form", "step", "--total", "36", "--every", "1", "--keep", "1"],
    "async-step-keep2": ["--form", "step", "--total", "36", "--every", "1", "--keep", "2", "--async-save",
                         "--workers", "2"],
    "sync-epoch-keep1": ["--form", "epoch", "--total", "6", "--every", "6", "--keep", "1"],
    "async-epoch-keep2": ["--form", "epoch", "--total", "6", "--every", "4", "--keep", "2", "--async-save"],
}


@dataclass
class Tally:
    kills: int = 0
    resumes: int = 0
    episodes: int = 0
    failures: list[str] = field(default_factory=list)


def _lines(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [line.split() for line in path.read_text().splitlines() if line.strip()]


def _losses(out: Path) -> list[tuple[int, int, str]]:
    return [(int(p[0]), int(p[1]), p[2]) for p in _lines(out / "losses.txt") if len(p) == 3]


def _worker(ckpt: Path, out: Path, args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.Popen([sys.executable, str(WORKER), "--ckpt", str(ckpt), "--out", str(out), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)


def reference(root: Path, form: str, args: list[str]) -> tuple[dict[int, str], dict]:
    import torch

    out = root / f"reference-{form}"
    proc = _worker(root / f"reference-{form}-ckpt", out, [*args, "--keep", "1"])
    _, err = proc.communicate(timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"the uninterrupted {form} run failed:\n{err.decode()[-2000:]}")
    return {s: loss for _, s, loss in _losses(out)}, torch.load(out / "final.pt", weights_only=True)


def _same_final(a: dict, b: dict) -> str | None:
    import torch

    for key in a["model"]:
        if not torch.equal(a["model"][key], b["model"][key]):
            return f"parameter {key} differs"
    if a["optimizer"]["param_groups"] != b["optimizer"]["param_groups"]:
        return "optimizer param_groups differ"
    for pid, entry in a["optimizer"]["state"].items():
        for key, value in entry.items():
            if not torch.equal(value, b["optimizer"]["state"][pid][key]):
                return f"optimizer state {pid}/{key} differs"
    if a["scheduler"] != b["scheduler"] or a["step"] != b["step"]:
        return "scheduler state or step counter differs"
    return None


def _wait_for_training(proc: subprocess.Popen, out: Path, timeout: float = 180) -> bool:
    """True once this process has logged a step; False if it ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if any(pid == proc.pid for pid, _, _ in _losses(out)):
            return True
        time.sleep(0.02)  # the kill's moment is drawn after this: polling need not be tight
    raise RuntimeError("a training process never reached its first step")


def _check_episode(name: str, ckpt: Path, out: Path, args: list[str], ref: tuple[dict[int, str], dict],
                   tally: Tally) -> None:
    import torch

    from trainguard.resilience import list_checkpoints

    ref_losses, ref_final = ref
    fail = tally.failures.append
    commits = [(int(p[0]), int(p[1])) for p in _lines(out / "commits.txt") if len(p) == 2]
    starts = [(int(p[0]), None if p[1] == "-" else int(p[1])) for p in _lines(out / "starts.txt") if len(p) == 2]
    seen_pids: set[int] = set()
    for pid, restored in starts:
        committed = [s for p, s in commits if p in seen_pids]
        if committed and (restored is None or restored < max(committed)):
            fail(f"{name}: pid {pid} resumed from {restored}, but step {max(committed)} had been committed")
        if seen_pids:
            tally.resumes += 1
        seen_pids.add(pid)
    for line in _lines(out / "warnings.txt"):
        text = " ".join(line[1:])
        if "skipping checkpoint step-" in text:
            fail(f"{name}: a committed checkpoint was skipped: {text}")
    rows = _losses(out)
    for pid, step, loss in rows:
        if ref_losses.get(step) != loss:
            fail(f"{name}: step {step} (pid {pid}) gave loss {loss}, the uninterrupted run {ref_losses.get(step)}")
    if {s for _, s, _ in rows} != set(ref_losses):
        fail(f"{name}: steps {sorted(set(ref_losses) - {s for _, s, _ in rows})} never ran")
    why = _same_final(ref_final, torch.load(out / "final.pt", weights_only=True))
    if why:
        fail(f"{name}: the final state is not the uninterrupted one: {why}")
    infos = [i for i in list_checkpoints(ckpt, verify=True) if i.complete]
    keep = int(args[args.index("--keep") + 1])
    if not all(i.valid for i in infos) or len(infos) > keep:
        fail(f"{name}: left {[(i.name, i.valid, i.reason) for i in infos]} (keep={keep})")


def run_config(name: str, args: list[str], kills: int, root: Path, rng: random.Random, ref, tally: Tally,
               log) -> None:
    while tally.kills < kills:
        tally.episodes += 1
        ckpt, out = root / f"{name}-{tally.episodes}" / "ckpt", root / f"{name}-{tally.episodes}" / "out"
        while tally.kills < kills:
            proc = _worker(ckpt, out, args)
            if rng.random() < 0.15:
                time.sleep(rng.uniform(0.0, 2.5))  # while starting, importing or restoring
                alive = proc.poll() is None
            else:
                alive = _wait_for_training(proc, out)
                time.sleep(rng.uniform(0.0, 0.25))  # anywhere: mid-step, mid-save, mid-prune, between
            if alive and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=120)
            if proc.returncode == -signal.SIGKILL:
                tally.kills += 1
            elif proc.returncode == 0:
                break  # it finished first: check this run, start a new one
            else:
                tally.failures.append(f"{name}: a process failed ({proc.returncode}): "
                                      f"{proc.stderr.read().decode()[-1500:]}")
                return
        if not (out / "final.pt").exists():
            proc = _worker(ckpt, out, args)
            _, err = proc.communicate(timeout=300)
            if proc.returncode != 0:
                tally.failures.append(f"{name}: the final resume failed: {err.decode()[-1500:]}")
                return
        _check_episode(name, ckpt, out, args, ref, tally)
        log(f"  {name}: episode {tally.episodes}, {tally.kills} kills so far, {len(tally.failures)} failures")


def main(argv: list[str] | None = None) -> dict[str, Tally]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=40, help="SIGKILLs in all, shared among the ways")
    p.add_argument("--ways", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    p.add_argument("--seed", type=int, default=20250611)
    p.add_argument("--keep-files", action="store_true", help="leave the run directories for a look")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    ways = {name: CONFIGS[name] for name in args.ways.split(",")}
    log = (lambda *_: None) if args.quiet else (lambda msg: print(msg, flush=True))
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="tg-crash-"))
    started = time.monotonic()
    try:
        forms = {cfg[1]: cfg[:4] for cfg in ways.values()}  # the uninterrupted run of each form used
        refs = {form: reference(root, form, cfg) for form, cfg in forms.items()}
        per = [args.kills // len(ways) + (i < args.kills % len(ways)) for i in range(len(ways))]
        tallies: dict[str, Tally] = {}
        for (name, cfg), kills in zip(ways.items(), per):
            tallies[name] = tally = Tally()
            run_config(name, cfg, kills, root, rng, refs[cfg[1]], tally, log)
    finally:
        if not args.keep_files:
            shutil.rmtree(root, ignore_errors=True)
    total = sum(t.kills for t in tallies.values())
    failures = [f for t in tallies.values() for f in t.failures]
    log(f"\n{'way':<20} {'kills':>6} {'resumes':>8} {'runs':>5} {'failures':>9}")
    for name, t in tallies.items():
        log(f"{name:<20} {t.kills:>6} {t.resumes:>8} {t.episodes:>5} {len(t.failures):>9}")
    log(f"{'all':<20} {total:>6} {sum(t.resumes for t in tallies.values()):>8} "
        f"{sum(t.episodes for t in tallies.values()):>5} {len(failures):>9}")
    log(f"\n{total} SIGKILLs, {total - len(failures) if not failures else 'NOT all'} survived "
        f"({time.monotonic() - started:.0f} s; load {os.getloadavg()[0]:.2f})")
    for f in failures:
        log("FAIL " + f)
    return tallies


if __name__ == "__main__":
    result = main()
    sys.exit(1 if any(t.failures for t in result.values()) else 0)
