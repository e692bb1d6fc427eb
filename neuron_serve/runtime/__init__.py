"""Serving runtime: request batching, core workers and the CPU executor."""
