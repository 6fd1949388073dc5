"""The benches: scripts run as ``python bench/x.py``; ``bench.common`` is their harness."""
