"""Parts of trainguard the UI shows when they are installed, looked up at call time.

The analysis (origin, diagnose) and the checkpoint lister are built alongside the UI; until one
is importable, the UI says what is missing instead of failing.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.store import to_plain_json

log = logging.getLogger("trainguard.ui")


def lookup(module: str, name: str) -> Callable[..., Any] | None:
    """``module.name`` if it can be imported, else None (never raises)."""
    try:
        mod = importlib.import_module(module)
    except Exception:
        return None
    fn = getattr(mod, name, None)
    return fn if callable(fn) else None


def jsonable(obj: Any, _depth: int = 0) -> Any:
    """A JSON-safe copy of whatever an analysis function returns (dataclasses, objects, tuples)."""
    if _depth > 20:
        return repr(obj)
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return to_plain_json(obj) if not math.isfinite(obj) else obj
    if isinstance(obj, dict):
        return {str(k): jsonable(v, _depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v, _depth + 1) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        try:
            return jsonable(to_dict(), _depth + 1)
        except Exception:
            pass
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name), _depth + 1) for f in dataclasses.fields(obj)}
    item = getattr(obj, "item", None)
    if callable(item) and getattr(obj, "ndim", 1) == 0:
        try:
            return jsonable(item(), _depth + 1)
        except Exception:
            pass
    if hasattr(obj, "__dict__"):
        return {k: jsonable(v, _depth + 1) for k, v in vars(obj).items() if not k.startswith("_")}
    return repr(obj)


def call(module: str, name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Call an optional function: {"available": True, "result": ...} or why it is unavailable."""
    fn = lookup(module, name)
    if fn is None:
        return {"available": False, "reason": f"{module}.{name} is not part of this installation yet"}
    try:
        return {"available": True, "result": jsonable(fn(*args, **kwargs))}
    except Exception as exc:  # a failing analysis must not take the page down
        log.warning("%s.%s failed: %s", module, name, exc)
        return {"available": False, "reason": f"{module}.{name} failed: {type(exc).__name__}: {exc}"}
