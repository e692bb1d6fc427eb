"""What a pooling model's length buckets pad on the texts it gets: each input's tokens and its share of its row's
padding counted per bucket (Prometheus and the model's metadata), its lengths kept in the compile cache, and `neuron-serve buckets`
proposing length buckets from them (the padding worked out here from the tokenizer's own counts)."""

from __future__ import annotations

import asyncio
import json

import pytest
import yaml
from prometheus_client import REGISTRY

from neuron_serve import cli, logs
from neuron_serve.compile import cache as compile_cache
from neuron_serve.pooling.tokens import Tokens
from neuron_serve.serve.infer.plane import ModelDataPlane
from neuron_serve.serve.pooling.plane import PoolingPlane
from neuron_serve.serve.protocols.pooling import PoolingRequest

NAME = "embedder-usage"  # a model name of its own: the counters are the process's
TEXTS = ["a", "serve the model", "gRPC over HTTP/1 behind HAProxy", "dynamic batching",
         "Ready means every port answers for every model and deploy prints its ready line only then"]


@pytest.fixture(autouse=True)
def logging_as_it_was():
    """cli.main in process sets neuron-serve's logging as a command prints it: put back for the next tests."""
    level, lists = logs._serve.level, logs._partitioner_level
    yield
    logs._serve.setLevel(level)
    logs._partitioner_level = lists


def work(kind: str) -> float:
    return REGISTRY.get_sample_value("neuron_serve_bucket_work_total", {
        "model": NAME, "replica": "test", "family": "length", "bucket": "64", "kind": kind}) or 0.0


@pytest.fixture(scope="module")
def served(pooled, pooling_dirs, tmp_path_factory):
    """TEXTS embedded twice (one request, then each text alone) by the one-bucket embedder (64 tokens), on a plane
    whose compile cache is new; its metadata after, and its model.yaml."""
    raw = pooling_dirs.config("embedder-one", "embedder")
    config, model, spec, tokenizer = pooled("embedder-one", "embedder")
    config = config.model_copy(update={"name": NAME})
    tmp = tmp_path_factory.mktemp("pooling-usage")
    (path := tmp / "model.yaml").write_text(yaml.safe_dump({**raw, "name": NAME}))
    lengths = [len(row.ids) for row in Tokens(tokenizer, spec).texts(TEXTS)]
    store = compile_cache.configure(tmp / "cache")

    async def main():
        plane = PoolingPlane(config, ModelDataPlane(config, model, "test", spec.describe()), Tokens(tokenizer, spec),
                             spec)
        plane.start()
        try:
            for texts in (TEXTS, *([t] for t in TEXTS)):
                with plane.data.begin() as call:
                    await plane.pool(PoolingRequest("embed", texts=texts), call)
            await asyncio.sleep(0.1)  # the metrics are applied once each answer is out
            return plane.metadata()
        finally:
            await plane.stop()

    try:
        metadata = asyncio.run(main())
    finally:
        compile_cache.configure()
    return lengths, metadata, store.root, path


def test_each_input_counts_its_tokens_and_padding_on_its_length_bucket(served):
    """The request of five texts (43 tokens) runs packed in one row of 64: 21 tokens of padding for all five; each
    text alone pads its own row."""
    lengths, metadata, _, _ = served
    assert sum(lengths) <= 64
    real = 2 * sum(lengths)
    padded = (64 - sum(lengths)) + sum(64 - n for n in lengths)
    assert (work("real"), work("padded")) == (real, padded)
    assert metadata["parameters"]["padding"] == {"length": {
        "padded_fraction": round(padded / (real + padded), 4),
        "buckets": {"64": {"calls": 2 * len(TEXTS), "real": real, "padded": padded}}}}


def test_the_lengths_are_kept_and_the_cli_proposes_length_buckets_from_them(served, capsys):
    lengths, _, cache, path = served
    kept = json.loads((cache / "traffic" / NAME / "test.json").read_text())
    counts = {}
    for n in lengths:
        counts[str(n)] = counts.get(str(n), 0) + 2
    assert kept == {"model": NAME, "replica": "test", "sizes": {"length": dict(sorted(counts.items(),
                                                                                    key=lambda kv: int(kv[0])))}}
    compile_cache.configure(cache)  # the cache the replica kept its lengths in, as `--cache-dir` opens it
    try:
        assert cli.main(["buckets", str(path), "--max-models", "2", "--min-calls", "1", "--json"]) == 0
        length = json.loads(capsys.readouterr().out)["length"]
        assert cli.main(["buckets", str(path), "--max-models", "2", "--min-calls", "1"]) == 0
        text = capsys.readouterr().out
    finally:
        compile_cache.configure()
    # Two buckets, 64 kept: the other is the length that saves most, checked against every choice.
    def cost(buckets):
        return sum(min(b for b in buckets if b >= n) for n in lengths)
    best = min((sorted({b, 64}) for b in range(1, 65)), key=lambda bs: (cost(bs), len(bs)))
    assert (length["field"], length["today"], length["proposed"]) == ("pooling.length_buckets", [64], best)
    assert length["padding_today"] == pytest.approx(64 * len(lengths) / sum(lengths))
    assert length["padding_proposed"] == pytest.approx(cost(best) / sum(lengths))
    assert text.endswith(f"model.yaml:\npooling:\n  length_buckets: {best}\n")
