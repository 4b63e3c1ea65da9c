"""Findings: what a diagnosis says, with evidence and a fix.

The record type lives in the store layer because the monitor (capture), the doctor and the
analysis all produce findings and the run stores them; the rule registry is in ``analysis``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Ordered from least to most severe; "warning" and above are problems, "info" is not.
SEVERITIES = ("info", "warning", "error", "critical")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}


@dataclass(kw_only=True)
class Finding:
    """One diagnosis.

    ``steps`` is the (first, last) step the finding covers, ``layers`` the layers it names,
    ``evidence`` the numbers it rests on (JSON-able; NaN/Inf allowed), ``suggestion`` a concrete
    fix that names a value where one can be read off the data.
    """

    kind: str
    severity: str
    title: str
    evidence: dict[str, Any] = field(default_factory=dict)
    suggestion: str = ""
    steps: tuple[int, int] | None = None
    layers: list[str] = field(default_factory=list)
    source: str = "analysis"

    def __post_init__(self) -> None:
        if self.severity not in _RANK:
            raise ValueError(f"severity must be one of {list(SEVERITIES)}, got {self.severity!r}")
        if self.steps is not None:
            self.steps = (int(self.steps[0]), int(self.steps[1]))

    @property
    def rank(self) -> int:
        return _RANK[self.severity]

    @property
    def is_problem(self) -> bool:
        return self.rank >= _RANK["warning"]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["steps"] = list(self.steps) if self.steps is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        known = {k: d[k] for k in ("kind", "severity", "title", "evidence", "suggestion", "steps", "layers", "source") if k in d}
        return cls(**known)


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Most severe first, then by first step."""
    return sorted(findings, key=lambda f: (-f.rank, f.steps[0] if f.steps else -1, f.kind))
