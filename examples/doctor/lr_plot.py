"""The LR range test from Python: sweep, suggestion, CSV and plot (the picture in docs/doctor.md).

    python examples/doctor/lr_plot.py [--out docs/images/lr_range_test.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
from blobs_mlp import setup  # noqa: E402

from trainguard import doctor  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="lr_range_test.png", help="where to write the PNG")
    p.add_argument("--csv", default=None, help="also write the sweep as CSV here")
    args = p.parse_args(argv)
    s = setup()
    console = Console()
    result = doctor.lr_range_test(s["model"], s["data"], s["loss_fn"], s["optimizer_factory"], console=console)
    console.print(result)
    result.plot(args.out)
    if args.csv:
        result.to_csv(args.csv)
    console.print(f"plot written to {args.out}")


if __name__ == "__main__":
    main()
