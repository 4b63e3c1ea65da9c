"""Pure functions over a reader: alerts, non-finite origin, loss health, layer diagnosis."""

from trainguard.analysis._rules import RULES, register_rule
from trainguard.store import SEVERITIES, Finding, sort_findings

__all__ = ["RULES", "SEVERITIES", "Finding", "register_rule", "sort_findings"]
