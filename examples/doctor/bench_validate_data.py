"""How fast validate_data is on a million samples (the numbers quoted in docs/doctor.md).

    python examples/doctor/bench_validate_data.py [--samples 1000000] [--features 32]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from trainguard.doctor import validate_data
from trainguard.doctor._dedup import cross_duplicates, duplicate_groups, row_hashes


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=1_000_000)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.samples, args.features), dtype=np.float32)
    y = rng.integers(0, 10, args.samples)
    xt = rng.standard_normal((args.samples // 10, args.features), dtype=np.float32)
    yt = rng.integers(0, 10, args.samples // 10)
    x[-1] = x[0]
    xt[0] = x[1]

    def best(fn) -> float:
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    print(f"{args.samples:,} train + {args.samples // 10:,} test samples, {args.features} float32 features")
    print(f"  hash train rows                  {best(lambda: row_hashes(x)):.2f} s")
    h = row_hashes(x)
    print(f"  duplicates within train          {best(lambda: duplicate_groups(x, h)):.2f} s")
    print(f"  test rows also in train          {best(lambda: cross_duplicates(x, xt, h)):.2f} s")
    print(f"  validate_data, exact checks only {best(lambda: validate_data((x, y), (xt, yt), near_duplicates=False, leak_check=False)):.2f} s")
    print(f"  validate_data, everything        {best(lambda: validate_data((x, y), (xt, yt))):.2f} s")


if __name__ == "__main__":
    main()
