"""Assembling a compiled model and keeping it: from_config.py (a model.yaml to a compiled
model), artifact.py (save and load), weights.py (weight-separated models) and progress.py
(a build's progress lines).

Each is imported by its own name; this package re-exports nothing.
"""
