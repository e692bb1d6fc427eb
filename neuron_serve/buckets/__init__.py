"""Compiled shapes: which shapes a model is compiled at, and which of them a call runs at.

- generation.py: a generate model's prefill and decode buckets and their defaults.
"""
