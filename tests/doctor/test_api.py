"""The doctor's public face and its place in the layers."""

from __future__ import annotations

import ast
from pathlib import Path

import trainguard
from trainguard import doctor

PACKAGE = Path(doctor.__file__).parent


def test_public_names_are_pinned():
    assert doctor.__all__ == [
        "CHECKS", "CheckError", "CheckResult", "DataReport", "DoctorInputError", "DoctorReport", "DoctorSetup",
        "GradCheckResult", "InitReport", "LRRangeResult", "OverfitResult", "ParamCheck", "gradient_check",
        "init_checks", "lr_range_test", "overfit_one_batch", "preserved", "run_checklist", "validate_data",
    ]
    for name in doctor.__all__:
        assert getattr(doctor, name) is not None


def test_reachable_from_the_top_level():
    assert "doctor" in trainguard.__all__
    assert trainguard.doctor.overfit_one_batch is doctor.overfit_one_batch


def test_input_errors_are_value_errors_and_trainguard_errors():
    assert issubclass(doctor.DoctorInputError, ValueError)
    assert issubclass(doctor.DoctorInputError, trainguard.TrainguardError)
    assert doctor.DoctorInputError.exit_code == 2


def test_imports_point_down_only():
    """doctor may use store (and capture); never analysis, ui or cli."""
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith(("trainguard.analysis", "trainguard.ui", "trainguard.cli")), (
                    f"{path.name} imports {name}")


def test_library_never_prints():
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print"]
        assert not calls, f"{path.name} calls print"
