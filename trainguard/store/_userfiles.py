"""Which source files are the user's: the stacks, the UI's source view and the origin's line
show the user's frames, not trainguard's, torch's or the standard library's."""

from __future__ import annotations

import os
import sysconfig

_NOT_USER_PREFIXES = tuple(
    p
    for p in {
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # trainguard itself
        sysconfig.get_paths().get("stdlib", ""),
        sysconfig.get_paths().get("platstdlib", ""),
        sysconfig.get_paths().get("purelib", ""),
        sysconfig.get_paths().get("platlib", ""),
        # console scripts (trainguard, torchrun, accelerate) launch the user's script
        os.path.join(sysconfig.get_paths().get("scripts", ""), ""),
    }
    if p
)


_EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples") + os.sep


def is_user_file(filename: str) -> bool:
    """A frame belongs to the user unless it is in trainguard, torch, the stdlib or site-packages.

    trainguard's shipped examples count as user code: they stand for a user's script.
    """
    if not filename or filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    if path.startswith(_EXAMPLES_DIR):
        return True
    if "site-packages" in filename or "dist-packages" in filename:
        return False
    return not path.startswith(_NOT_USER_PREFIXES)
