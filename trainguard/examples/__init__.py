"""Runnable examples shipped with trainguard (the reference NaN scenario and its data)."""
