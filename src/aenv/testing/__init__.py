"""Helpers for tests and benchmarks that drive a real server."""
