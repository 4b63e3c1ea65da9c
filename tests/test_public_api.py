"""trainguard's public face: the names are pinned, each resolves, and importing stays light."""

from __future__ import annotations

import subprocess
import sys

import trainguard

PUBLIC = [
    "CheckpointError", "CheckpointFallbackWarning", "CheckpointInfo", "CheckpointManager", "CheckpointPolicy",
    "CorruptRun", "Diverged", "Guard", "Monitor", "NonFiniteError", "Preempted", "ResumableLoader", "ResumeLoop", "RunNotFound",
    "SchemaTooNew", "TrainState", "TrainguardError", "__version__", "check_numerics", "compile_backend", "disable",
    "doctor",
    "enable", "fix", "list_checkpoints", "open", "record", "step",
]


def test_all_is_pinned_and_every_name_resolves():
    assert sorted(trainguard.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(trainguard, name) is not None, name
    assert callable(trainguard.record) and callable(trainguard.open)
    assert issubclass(trainguard.NonFiniteError, trainguard.TrainguardError)
    assert issubclass(trainguard.CorruptRun, trainguard.TrainguardError)


def test_unknown_name_is_an_attribute_error():
    try:
        trainguard.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_import_and_reader_do_not_import_torch():
    code = "import sys, trainguard, trainguard.store, trainguard.analysis; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_import_never_imports_a_framework():
    # The integrations package, the monitor and the CLI's modules load no framework until a
    # script uses one (the callbacks' own modules import theirs).
    code = (
        "import sys, trainguard, trainguard.integrations, trainguard.cli, trainguard.cli._run, "
        "trainguard.cli._monitor; trainguard.Monitor; "
        "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
