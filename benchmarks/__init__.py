"""Benchmark harness: load generator, baseline servers, scenarios and reports (`serve-app bench`)."""
