"""Benchmarks: `serve.py` (online, over HTTP), `throughput.py` (offline), `workloads.py` (shared workloads)."""
