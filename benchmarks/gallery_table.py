"""The gallery's detection table: every script of ``examples/broken`` under ``trainguard monitor``
over several seeds; per script, how often its expected finding was found (with the symptoms it
explains folded under it) and how many other warning-level findings came with it. A healthy
script's count of warning-level findings is its false alarms.

    python benchmarks/gallery_table.py                 # seeds 0-4, every script
    python benchmarks/gallery_table.py --seeds 3 --only overfitting,leakage

Not a timing benchmark (``make bench`` runs ``bench_*.py`` only); one intra-op thread, as the
gallery test runs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
from pathlib import Path

GALLERY = Path(__file__).resolve().parents[1] / "examples" / "broken"


def expected(text: str) -> tuple[str, list[str]]:
    m = re.search(r"Expected finding: ``(\w+)``(?:, explaining ((?:``\w+``(?:,| and| )*)+))?", text)
    if not m:
        return "healthy", []
    return m.group(1), re.findall(r"``(\w+)``", m.group(2) or "")


def run(script: Path, seed: int, tmp: str) -> dict:
    from trainguard.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        main(["monitor", "--logdir", f"{tmp}/{script.stem}-{seed}", "--every", "5", "--json", str(script),
              "--quiet", "--seed", str(seed)])
    return json.loads(out.getvalue())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--only", default="", help="comma-separated script names (without .py)")
    p.add_argument("--json", help="also write the table to this file")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    scripts = sorted(s for s in GALLERY.glob("*.py") if not s.name.startswith("_"))
    if args.only:
        keep = set(args.only.split(","))
        scripts = [s for s in scripts if s.stem in keep]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for script in scripts:
            want, explains = expected(script.read_text())
            found = folded = others = 0
            for seed in range(args.seeds):
                out = run(script, seed, tmp)
                problems = [f for f in out["findings"] if f["severity"] != "info"]
                kinds = [f["kind"] for f in problems]
                if want == "healthy":
                    others += len(problems)
                    found += not problems
                    continue
                if want in kinds:
                    found += 1
                    cause = next(f for f in problems if f["kind"] == want)
                    symptoms = {s["kind"] for s in cause.get("symptoms", [])}
                    folded += all(k in symptoms and k not in kinds for k in explains)
                others += len([k for k in kinds if k != want])
            rows[script.stem] = {"expected": want, "explains": explains, "found": found, "folded": folded,
                                 "other_warnings": others}
            print(f"{script.stem:32s} {want:32s} found {found}/{args.seeds}"
                  + (f"  symptoms folded {folded}/{args.seeds}" if explains else "")
                  + f"  other warnings {others}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
