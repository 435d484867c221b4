"""Benchmarks and device checks: what `bench.py` and `tools/device_check.sh` measure."""
