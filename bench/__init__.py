"""Benchmarks: scripts that measure and write JSON + markdown; never asserted in unit tests."""
