"""Peer servers of the benchmark: each serves the same eager models over the same OIP v2 requests."""
