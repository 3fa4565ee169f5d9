"""Benchmarks: numbers for reports, never asserted in tests."""
