"""Pure functions over a reader: alerts, non-finite origin, loss health, layer diagnosis."""

from trainguard.analysis._diagnose import MONITOR_RULES, diagnose
from trainguard.analysis._origin import Link, Origin, describe_summary, origin
from trainguard.analysis._ranks import ranks_report
from trainguard.analysis._report import build_report, source_excerpt
from trainguard.analysis._rules import RULES, register_rule
from trainguard.analysis._thresholds import Thresholds
from trainguard.store import SEVERITIES, Finding, sort_findings

__all__ = [
    "MONITOR_RULES",
    "RULES",
    "SEVERITIES",
    "Finding",
    "Link",
    "Origin",
    "Thresholds",
    "build_report",
    "describe_summary",
    "diagnose",
    "origin",
    "ranks_report",
    "register_rule",
    "sort_findings",
    "source_excerpt",
]
