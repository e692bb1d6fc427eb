"""model.yaml's pooling tasks and section: what is accepted, and each refusal naming the field and the fix."""

import pytest

from neuron_serve.config.pooling import PoolingSettings
from neuron_serve.config.schema import parse_config
from neuron_serve.errors import ConfigError

EMBED = {"name": "embedder", "task": "embed", "model": {"pretrained": "embedder"}}


def test_a_pooling_model_needs_only_its_directory():
    config = parse_config(EMBED)
    assert (config.task, config.pooling, config.dynamic_batch) == ("embed", None, True)
    scored = parse_config({**EMBED, "task": "score", "tokenizer": "tok", "batch_sizes": [1, 8],
                           "pooling": {"use_activation": False, "max_model_len": 256}})
    assert scored.pooling.use_activation is False and scored.tokenizer == "tok"


@pytest.mark.parametrize("length, buckets", [(512, [32, 64, 128, 256, 512]), (100, [32, 64, 100]), (16, [16])])
def test_default_length_buckets_double_from_32_up_to_max_model_len(length, buckets):
    assert PoolingSettings().default_buckets(length) == buckets
    assert PoolingSettings(length_buckets=[8, 40]).default_buckets(length) == [8, 40]


@pytest.mark.parametrize("changes, message", [
    ({"task": "infer", "inputs": [{"name": "x", "shape": [1, 4]}], "model": {"factory": "m:f"},
      "pooling": {"normalize": True}},
     "pooling: applies to task: embed, score or classify, not infer; set one of them or remove pooling"),
    ({"model": {"factory": "m:f"}},
     "model.pretrained: Field required for task: embed (a sentence-transformers or transformers model directory, "
     "relative to the model.yaml)"),
    ({"inputs": [{"name": "x", "shape": [1, 4]}]},
     "inputs: applies to task: infer; a pooling model takes text (or token ids) and derives its inputs and outputs "
     "from the model; remove inputs"),
    ({"buckets": {"sizes": [8], "inputs": {"x": 1}}},
     "buckets: applies to task: infer; a pooling model's length buckets are pooling.length_buckets; remove buckets"),
    ({"generation": {"max_num_seqs": 2}},
     "generation: applies to task: generate; a pooling model generates no tokens; remove generation"),
    ({"dynamic_batch": False},
     "dynamic_batch: a pooling model runs the texts of many requests together, at any count; remove "
     "dynamic_batch: false"),
    ({"placement": {"mode": "pipeline"}, "cores_per_replica": 2},
     "placement.mode: pipeline applies to task: infer; a pooling model runs whole on each core; remove placement "
     "or use mode: replicate"),
    ({"task": "score", "pooling": {"pooling_type": "CLS"}},
     "pooling.pooling_type: applies to task: embed; a score model's output is its logits (see use_activation); "
     "remove pooling_type"),
    ({"pooling": {"use_activation": True}},
     "pooling.use_activation: applies to task: score and classify; an embedding has no activation (see "
     "normalize); remove use_activation"),
    ({"pooling": {"pooling_type": "MAX"}},
     "pooling.pooling_type: Input should be 'CLS', 'MEAN' or 'LAST' (use one of the values listed)"),
    ({"pooling": {"length_buckets": [64, 32]}},
     "pooling.length_buckets: [64, 32] must be increasing, each length once; give them smallest first"),
    ({"pooling": {"length_buckets": [32, 64], "max_model_len": 128}},
     "pooling.length_buckets: the largest bucket, 64, must equal max_model_len (128); end the list with it or "
     "remove max_model_len"),
    ({"pooling": {"matryoshka_dimensions": [64, 128], "dimensions": 32}},
     "pooling.dimensions: 32 is not one of matryoshka_dimensions [64, 128]; give one of them"),
    ({"pooling": {"dimensions": 32, "is_matryoshka": False}},
     "pooling.dimensions: fewer dimensions than the model's need a Matryoshka model; remove dimensions or set "
     "is_matryoshka: true"),
    ({"tokenizer": "tok", "task": "infer", "inputs": [{"name": "x", "shape": [1, 4]}], "model": {"factory": "m:f"}},
     "tokenizer: applies to task: generate, embed, score or classify; set one of them or remove tokenizer"),
])
def test_a_setting_a_pooling_model_cannot_honour_is_refused_naming_it(changes, message):
    with pytest.raises(ConfigError) as refused:
        parse_config({**EMBED, **changes}, "embedder.yaml")
    assert str(refused.value).splitlines()[1:] == [f"  {message}"]
