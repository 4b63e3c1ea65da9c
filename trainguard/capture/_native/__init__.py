"""trainguard's native recorder core: C++ on ``at::RecordFunction``, built on first use.

The sources beside this file are compiled against the installed torch's headers with
``torch.utils.cpp_extension`` (ninja and a C++ compiler; ``-O3 -DNDEBUG``: without NDEBUG,
``RecordFunction``'s layout differs from the release wheel's). The result is cached per torch
version, Python version, platform and source digest under ``$TRAINGUARD_NATIVE_CACHE``, else
``$XDG_CACHE_HOME/trainguard/native``, else ``~/.cache/trainguard/native``; a cached build is
imported directly, without ``cpp_extension``. ``TRAINGUARD_NO_NATIVE=1`` turns the core off
(the Python dispatch mode and the NumPy summaries are used instead).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import sys
import sysconfig
import threading
from pathlib import Path

log = logging.getLogger("trainguard.capture")

_DIR = Path(__file__).resolve().parent
SOURCES = ("summary.cpp", "stacks.cpp", "ops.cpp", "tables.cpp", "recorder.cpp", "module.cpp")
HEADERS = ("native.h", "core.h", "flat.h")
# -fopenmp: the summary kernel splits a large output across torch's intra-op threads with
# at::parallel_for, whose OpenMP body is compiled into the extension (without it, it runs on one
# thread). The extension's libgomp.so.1 is the runtime torch loaded already (the same soname).
CFLAGS = ("-O3", "-DNDEBUG", "-fvisibility=hidden", "-fopenmp")
# The frame chain the stack capture reads (see stacks.cpp).
PYTHONS = ((3, 11), (3, 12))

_lock = threading.Lock()
_module = None
_error: str | None = None
_tried = False


def cache_root() -> Path:
    env = os.environ.get("TRAINGUARD_NATIVE_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "trainguard" / "native"


def build_key(src: Path | None = None) -> str:
    """Torch version, Python, platform and a digest of the sources (in ``src``, by default this
    package's) and flags."""
    import torch

    src = _DIR if src is None else Path(src)
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((src / name).read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(str(getattr(torch.version, "git_version", "")).encode())
    py = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    return f"torch{torch.__version__.replace('+', '_')}-{py}-{platform.machine()}-{sys.platform}-{h.hexdigest()[:12]}"


def build_dir() -> Path:
    return cache_root() / build_key()


def _module_name(key: str) -> str:
    return "trainguard_native_" + key.rsplit("-", 1)[-1]


def _import_built(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path, loader=importlib.machinery.ExtensionFileLoader(name, str(path)))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _find_ninja() -> None:
    """cpp_extension runs ``ninja`` from PATH: add the pip package's binary when it is installed."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # the `ninja` package on PyPI ships the binary

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        bindir = os.path.dirname(sys.executable)
        if os.path.exists(os.path.join(bindir, "ninja")):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def build(verbose: bool = False):
    """Build (or load the cached build of) the extension and return the module; raises on failure."""
    import torch  # noqa: F401 - the extension links against the loaded torch

    if sys.version_info[:2] not in PYTHONS:
        raise RuntimeError(f"the native core reads CPython 3.11/3.12 frames; this is Python {platform.python_version()}")
    key = build_key()
    name = _module_name(key)
    out = cache_root() / key
    so = out / f"{name}.so"
    done = out / "built"
    if done.exists() and so.exists():
        return _import_built(so, name)
    out.mkdir(parents=True, exist_ok=True)
    with _build_lock(out):
        if done.exists() and so.exists():  # built by the process that held the lock
            return _import_built(so, name)
        log.warning("trainguard: building the native recorder core in %s (once per torch version and "
                    "trainguard release; about 1.5 min of CPU, several minutes on a busy machine; "
                    "`python -m trainguard.capture._native` builds it ahead of a run)", out)
        return _compile(out, key, name, verbose)


@contextlib.contextmanager
def _build_lock(out: Path):
    """One builder per build folder, held through the kernel (``flock``), so that it ends with
    its process. torch's own hold on the folder, a file ``lock`` that its builder removes, stays
    behind when that builder is killed (SIGKILL, the OOM killer, a preempted job), and torch then
    waits for it with no end: under this lock no other build runs, so such a file is stale."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's hold alone
        yield
        return
    with open(out / "build.flock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("trainguard: waiting for another process building the native recorder core in %s", out)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (out / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(out: Path, key: str, name: str, verbose: bool):
    from torch.utils import cpp_extension

    _find_ninja()
    # A cached build is trusted for ever, so it must be made of exactly the bytes its key names:
    # the compiler reads a snapshot taken here, checked against the key. Compiled in place, a
    # source edited while ninja ran (a patch applied or reverted) once made a build whose objects
    # saw two versions of core.h, i.e. two layouts of the core's tables (issue 16).
    src = out / "src"
    src.mkdir(exist_ok=True)
    for s in SOURCES + HEADERS:
        shutil.copyfile(_DIR / s, src / s)
    if build_key(src) != key:
        raise RuntimeError("the native core's sources changed while its build started; import again")
    include = sysconfig.get_paths()["include"]
    mod = cpp_extension.load(
        name, [str(src / s) for s in SOURCES], extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(src), include], build_directory=str(out), verbose=verbose, with_cuda=False,
    )
    (out / "built").write_text(key + "\n")
    return mod


def load():
    """The extension module, or None when it cannot be built here (see :func:`error`)."""
    global _module, _error, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        if os.environ.get("TRAINGUARD_NO_NATIVE"):
            _error = "TRAINGUARD_NO_NATIVE is set"
        else:
            try:
                _module = build()
                _configure(_module)
            except Exception as exc:  # no compiler, no ninja, no headers: the Python fallback
                _module = None
                _error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}"
                log.debug("trainguard: native core unavailable", exc_info=True)
        _tried = True
        return _module


def error() -> str | None:
    """Why the native core is not available (None when it is, or was not tried yet)."""
    return _error


def _configure(mod) -> None:
    import torch

    from trainguard.capture._summary import ALLOCATION_OPS, WORKSPACE_OUTPUTS
    from trainguard.capture._taint import STATS_WRITES
    from trainguard.store import ALIAS_OPS

    names = [(v, str(v).replace("torch.", "")) for v in vars(torch).values() if isinstance(v, torch.dtype)]
    mod.configure(names, sorted(ALLOCATION_OPS), sorted(ALIAS_OPS), {k: v[0] for k, v in STATS_WRITES.items()},
                  WORKSPACE_OUTPUTS)
