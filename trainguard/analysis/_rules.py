"""The registry of diagnosis rules: small functions registered under a unique name."""

from __future__ import annotations

from collections.abc import Callable

from trainguard.store import Finding

Rule = Callable[..., "list[Finding]"]
RULES: dict[str, Rule] = {}


def register_rule(name: str) -> Callable[[Rule], Rule]:
    """Register a diagnosis rule under ``name``; registering a name twice is an error."""

    def deco(fn: Rule) -> Rule:
        if name in RULES:
            raise ValueError(f"diagnosis rule {name!r} is already registered")
        RULES[name] = fn
        return fn

    return deco
