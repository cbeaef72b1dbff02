"""snapcore's benchmarks: scripts run as ``python benchmarks/NAME.py``, and the harness
that runs them as named scenarios (``python -m benchmarks``, benchmarks/harness.py)."""
