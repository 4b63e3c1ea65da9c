"""``python -m trainguard.capture._native``: build the native core now (cached) and say where."""

from __future__ import annotations

import sys


def main() -> int:
    from trainguard.capture import _native

    try:
        mod = _native.build(verbose="-v" in sys.argv)
    except Exception as exc:
        sys.stderr.write(f"trainguard: the native recorder core could not be built: {exc}\n")
        return 1
    sys.stdout.write(f"trainguard native core: {mod.__file__}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
