"""Which source files are the user's: the stacks, the UI's source view and the origin's line
show the user's frames, not trainguard's, torch's or the standard library's."""

from __future__ import annotations

import os
import re
import sysconfig
import tempfile

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


# PyTorch Geometric renders MessagePassing.propagate / edge_updater and nn.Sequential.forward from
# jinja templates into the temp dir and imports them (torch_geometric/template.py:
# NamedTemporaryFile(prefix=f"{module}_{cls}_propagate_", suffix=".py"), 8 random characters
# between): library code, also for a MessagePassing the user wrote; their message() stays theirs.
_PYG_GENERATED = re.compile(r"_(?:propagate|edge_updater)_[a-z0-9_]{8}\.py$"
                            r"|^torch_geometric\.nn\.sequential_Sequential_[0-9a-f]{6}_[a-z0-9_]{8}\.py$")


def _generated_by_pyg(path: str) -> bool:
    return os.path.dirname(path) == os.path.abspath(tempfile.gettempdir()) and bool(
        _PYG_GENERATED.search(os.path.basename(path)))


def is_user_file(filename: str) -> bool:
    """A frame belongs to the user unless it is in trainguard, torch, the stdlib or site-packages.

    trainguard's shipped examples count as user code: they stand for a user's script. The modules
    PyTorch Geometric generates in the temp dir are the library's.
    """
    if not filename or filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    if path.startswith(_EXAMPLES_DIR):
        return True
    if "site-packages" in filename or "dist-packages" in filename:
        return False
    return not path.startswith(_NOT_USER_PREFIXES) and not _generated_by_pyg(path)
