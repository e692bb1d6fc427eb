"""How close neuron-serve runs to what its cores can compute, read from its own /metrics.

Around a timed load point: the chunks each compiled batch size ran
(``neuron_serve_batch_size_chunks_total``) times that size's per-call cost timed at load
(``neuron_serve_batch_size_cost_seconds``) is the core time the chosen sizes need back
to back; over (cores x wall seconds) it is the fraction of the cores' capacity the
served rows used. 1.0 means requests reached the cores as fast as the cores ran them
at those sizes; the rest is the serving path (HTTP, queueing, batching, gaps).
"""

from __future__ import annotations

import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int, model: str) -> dict:
    """Chunks per (core, batch size) and cost per batch size of ``model`` now."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    chunks, costs, cores = defaultdict(float), {}, set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if labels.get("model") != model:
                continue
            if sample.name == "neuron_serve_batch_size_chunks_total":
                chunks[int(labels["batch_size"])] += sample.value
            elif sample.name == "neuron_serve_batch_size_cost_seconds" and labels.get("bucket") == "0":
                costs[int(labels["batch_size"])] = sample.value
            elif sample.name == "neuron_serve_core_chunks_total":
                cores.add(labels["core"])
    return {"chunks": dict(chunks), "costs": costs, "cores": len(cores)}


def efficiency(before: dict, after: dict, seconds: float) -> dict:
    """Core time the chunks run between two scrapes needed, over cores x ``seconds``."""
    chunks = {size: n - before["chunks"].get(size, 0) for size, n in after["chunks"].items()}
    busy = sum(n * after["costs"][size] for size, n in chunks.items() if n)
    cores = max(1, after["cores"])
    return {"chunks_per_size": {s: int(n) for s, n in sorted(chunks.items()) if n}, "core_seconds": busy,
            "cores": cores, "efficiency": busy / (cores * seconds)}
