"""``trainguard doctor module:function``: the pre-flight checklist on a user's setup.

The target function takes no arguments and returns the model, the data and the loss function
(and optionally an optimizer factory, a test split and the number of classes), as a dict or a
tuple. The doctor runs its checks, prints a verdict table with the evidence, and writes the
results (findings, JSON report, LR range test plot and CSV) to a run directory.

Exit codes: 0 when every check passed (warnings allowed), 1 when a check failed, 2 for a bad
target (cannot import, no such function, wrong return value).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from trainguard.cli._render import console


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="pre-flight checks: overfit one batch, LR range test, gradient check, data validation",
        description="Run the doctor's checklist on the setup that TARGET returns and write the results "
        "to a run directory. TARGET is module:function or path/to/file.py:function; the function "
        "takes no arguments and returns {'model', 'data', 'loss_fn'[, 'optimizer_factory', 'test', "
        "'num_classes']} or (model, data, loss_fn[, optimizer_factory[, test]]).",
    )
    p.add_argument("target", metavar="TARGET", help="module:function or path/to/file.py:function")
    p.add_argument("--logdir", default=None,
                   help="run directory for the results (default: runs/doctor-<date>-<time>)")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --logdir")
    p.add_argument("--checks", default=None,
                   help="comma-separated checks to run, from: data, init, overfit, gradcheck, lr (default: all)")
    p.add_argument("--skip", default=None, help="comma-separated checks to skip")
    p.add_argument("--overfit-steps", type=int, default=200, help="steps of the overfit-one-batch test")
    p.add_argument("--lr-steps", type=int, default=100, help="steps of the LR range test")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    p.add_argument("--no-save", action="store_true", help="do not write a run directory")
    p.set_defaults(func=_cmd)


def _names(text: str | None) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()] if text else []


def load_target(target: str) -> Any:
    """Import ``module:function`` (or ``file.py:function``) and return the function."""
    from trainguard.doctor import DoctorInputError

    module_part, sep, func_name = target.rpartition(":")
    if not sep or not module_part or not func_name:
        raise DoctorInputError(f"target must look like module:function or path/to/file.py:function, got {target!r}")
    if not func_name.isidentifier():
        raise DoctorInputError(f"{func_name!r} in {target!r} is not a function name")
    is_path = module_part.endswith(".py") or "/" in module_part or os.sep in module_part
    try:
        if is_path:
            path = Path(module_part)
            if not path.is_file():
                raise DoctorInputError(f"cannot import {module_part!r}: no such file")
            name = f"_trainguard_doctor_target_{abs(hash(str(path.resolve())))}"
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise DoctorInputError(f"cannot import {module_part!r}: not a Python file")
            module = importlib.util.module_from_spec(spec)
            sys.path.insert(0, str(path.resolve().parent))  # so the file can import its neighbours
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name, None)
                raise
            finally:
                sys.path.remove(str(path.resolve().parent))
        else:
            added = os.getcwd() not in sys.path and "" not in sys.path
            if added:
                sys.path.insert(0, os.getcwd())  # `trainguard doctor mymodule:setup` from the project folder
            try:
                module = importlib.import_module(module_part)
            finally:
                if added:
                    sys.path.remove(os.getcwd())
    except DoctorInputError:
        raise
    except ModuleNotFoundError as exc:
        if exc.name and module_part.split(".")[0] == exc.name.split(".")[0] and not is_path:
            raise DoctorInputError(f"cannot import module {module_part!r}: {exc}") from None
        raise DoctorInputError(f"importing {module_part!r} failed: {type(exc).__name__}: {exc}") from None
    except BaseException as exc:  # the user's module ran and raised; show one line, not a traceback
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise DoctorInputError(f"importing {module_part!r} failed: {type(exc).__name__}: {exc}") from None
    func = getattr(module, func_name, None)
    if func is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        hint = f"; it has: {', '.join(public[:10])}" if public else ""
        raise DoctorInputError(f"module {module_part!r} has no function {func_name!r}{hint}")
    if not callable(func):
        raise DoctorInputError(f"{target!r} is not callable (it is a {type(func).__name__})")
    return func


def _setup(target: str) -> Any:
    from trainguard.doctor import DoctorInputError, DoctorSetup

    func = load_target(target)
    try:
        value = func()
    except (DoctorInputError, KeyboardInterrupt):
        raise
    except Exception as exc:
        raise DoctorInputError(f"{target!r} raised {type(exc).__name__}: {exc}") from None
    return DoctorSetup.from_value(value, repr(target))


def _cmd(args: argparse.Namespace) -> int:
    from trainguard.doctor import CHECKS, DoctorInputError, run_checklist

    checks = _names(args.checks) or list(CHECKS)
    skip = _names(args.skip)
    unknown = sorted((set(checks) | set(skip)) - set(CHECKS))
    if unknown:
        raise DoctorInputError(f"unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    if args.overfit_steps < 4 or args.lr_steps < 5:
        raise DoctorInputError("--overfit-steps must be >= 4 and --lr-steps >= 5")
    checks = [c for c in checks if c not in skip]
    setup = _setup(args.target)
    report = run_checklist(
        setup.model, setup.data, setup.loss_fn, optimizer_factory=setup.optimizer_factory, test=setup.test,
        num_classes=setup.num_classes, checks=checks, overfit_steps=args.overfit_steps, lr_steps=args.lr_steps,
        console=None if args.json else console,
    )
    if not args.no_save:
        from trainguard.store import default_name

        logdir = args.logdir or os.path.join("runs", default_name("doctor"))
        report.save(logdir, overwrite=args.overwrite)
    if args.json:
        from trainguard.store import to_plain_json

        print(json.dumps(to_plain_json(report.to_dict()), indent=2))
    else:
        console.print(report)
        if report.logdir:
            console.print(f"results written to [bold]{report.logdir}[/] (see them with: trainguard ui {report.logdir})",
                          highlight=False)
    return 0 if report.passed else 1
