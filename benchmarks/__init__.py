"""Benchmark harness: load generator, baseline servers, scenarios and reports (`python -m benchmarks`)."""
