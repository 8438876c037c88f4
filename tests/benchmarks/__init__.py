"""Tests of the benchmarks/ scripts (dry runs, result schemas)."""
