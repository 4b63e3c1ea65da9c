"""Imports point down the layer list of DESIGN.md only (checked on the source, statically)."""

from __future__ import annotations

import ast
from pathlib import Path

import trainguard

ROOT = Path(trainguard.__file__).parent
# Highest first; a layer may import the ones after it (and the shared _errors module).
LAYERS = ["cli", "ui", "integrations", "guard", "analysis", "doctor", "capture", "resilience", "store"]
ALLOWED = {
    "cli": set(LAYERS) | {"_wiring", "examples"},
    "ui": {"guard", "analysis", "doctor", "capture", "resilience", "store"},
    "integrations": {"guard", "analysis", "doctor", "capture", "resilience", "store"},
    "guard": {"analysis", "doctor", "capture", "resilience", "store"},
    "analysis": {"store"},
    "doctor": {"capture", "resilience", "store"},
    "capture": {"resilience", "store"},
    "resilience": {"store"},
    "store": set(),
}


def imported_packages(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "trainguard" and len(parts) > 1:
                out.add(parts[1])
    return out


def test_imports_point_down():
    bad = []
    for layer, allowed in ALLOWED.items():
        for path in sorted((ROOT / layer).rglob("*.py")):
            for pkg in imported_packages(path) - {layer, "_errors"} - allowed:
                bad.append(f"{path.relative_to(ROOT)} imports trainguard.{pkg}")
    assert not bad, "\n".join(bad)
