"""Benchmarks and the demo; run from the repository root."""
