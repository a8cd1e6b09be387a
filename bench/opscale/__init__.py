"""Helpers of bench/operator_scale.py: per-process CPU and memory, metrics scrapes, per-object stage times."""
