"""Benchmarks of neuron-serve against peer servers, measured side by side in one run."""
