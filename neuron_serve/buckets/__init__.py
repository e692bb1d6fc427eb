"""Compiled shapes: which shapes a model is compiled at, and which of them a call runs at.

- shape.py: shape buckets (BucketSpec, BucketModelConfig) and choosing one for a call.
- dynamic_batch.py: any batch run as padded chunks of a compiled batch size, along dim 0.
- batch_sizes.py: which batch sizes are compiled, and the cheapest mix of them covering n rows.
- generation.py: a generate model's prefill and decode buckets and their defaults.
- auto.py: what every ``auto`` bucket list shares, whatever the model's kind (AUTO_LEARN_AFTER).
- traffic.py: the sizes a model was asked for, the padding a bucket list costs them, the list that costs least.

Above the arithmetic, what is recorded of a model's traffic, and what is learned and proposed from it:

- usage.py: a replica's sizes and padding, counted and kept in the compile cache; auto buckets learned from them.
- learn.py: a serving replica's re-bucketing (when it looks, what it switches to), the base each kind's variant
  builds on, and ``attach``, which puts them on a replica of any kind.
- proposal.py: ``neuron-serve buckets``: the lists that would pad the recorded sizes least.
"""
