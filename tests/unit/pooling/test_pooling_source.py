"""A pooling model's directory read with sentence-transformers' loaders: the spec it gives, and the refusals."""

import pytest

from neuron_serve.config.schema import parse_config
from neuron_serve.errors import ConfigError
from neuron_serve.pooling import source


def load(pooling_dirs, name, task="embed", **pooling):
    config = {"name": name, "task": task, "model": {"pretrained": str(pooling_dirs[name])}}
    return source.load(parse_config({**config, "pooling": pooling} if pooling else config))


def test_an_embedder_s_settings_come_from_its_sentence_transformers_files(pooling_dirs):
    _, spec, _ = load(pooling_dirs, "embedder")
    assert (spec.pooling_type, spec.normalize, spec.max_model_len, spec.length_buckets) == ("MEAN", True, 64, (32, 64))
    assert spec.input_names == ("input_ids", "attention_mask", "token_type_ids")
    assert (spec.output_name, spec.is_matryoshka, spec.vocab_size) == ("embedding", False, 1000)


def test_a_cross_encoder_scores_with_its_activation_and_a_classifier_with_softmax(pooling_dirs):
    _, scored, _ = load(pooling_dirs, "reranker", "score")
    assert (scored.output_name, scored.activation, scored.labels) == ("score", "Sigmoid", ("label_0",))
    _, classes, _ = load(pooling_dirs, "classifier", "classify")
    assert (classes.output_name, classes.activation, classes.labels) == ("probs", "Softmax",
                                                                        ("label_0", "label_1", "label_2"))
    _, raw, _ = load(pooling_dirs, "reranker", "score", use_activation=False)
    assert (raw.output_name, raw.activation) == ("logits", None)


def test_a_decoder_pools_its_last_token(pooling_dirs):
    _, spec, _ = load(pooling_dirs, "qwen3", max_model_len=48)
    assert (spec.pooling_type, spec.normalize, spec.length_buckets) == ("LAST", True, (32, 48))


@pytest.mark.parametrize("name, task, pooling, message", [
    ("classifier", "score", {},
     "task: score needs a cross-encoder with one label (num_labels 1, a relevance score); {dir} has 3: serve it "
     "with task: classify."),
    ("xlmr", "embed", {"max_model_len": 100},
     "pooling.max_model_len: 100 tokens is more than the model's 64 positions; give at most 64."),
    ("embedder", "embed", {"length_buckets": [16, 600]},
     "pooling.length_buckets: 600 tokens is more than the model's 512 positions; give at most 512."),
])
def test_what_the_model_cannot_do_is_refused_naming_the_field(pooling_dirs, name, task, pooling, message):
    with pytest.raises(ConfigError) as refused:
        load(pooling_dirs, name, task, **pooling)
    assert str(refused.value) == message.format(dir=pooling_dirs[name])


def test_a_directory_that_is_no_model_is_refused(tmp_path):
    config = parse_config({"name": "m", "task": "embed", "model": {"pretrained": str(tmp_path)}})
    with pytest.raises(ConfigError, match=f"model.pretrained: cannot load {tmp_path} as a sentence-transformers or "
                                          f"transformers model"):
        source.load(config)
    missing = parse_config({"name": "m", "task": "embed", "model": {"pretrained": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match="is not a directory; give a directory written by SentenceTransformer.save"):
        source.load(missing)


def recorded(cache, name, lengths: dict[int, int], replica="r0"):
    """Lengths as a replica of ``name`` keeps them in the compile cache (buckets/usage.Usage.save)."""
    import json  # noqa: PLC0415

    folder = cache.root / "traffic" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{replica}.json").write_text(json.dumps({"model": name, "replica": replica, "sizes": {
        "length": {str(n): times for n, times in lengths.items()}}}))


def test_auto_length_buckets_are_learned_from_the_lengths_recorded_once_there_are_enough(pooling_dirs, fresh_cache,
                                                                                         caplog):
    """The embedder's defaults are [32, 64]: 1100 recorded inputs of 10 and 20 tokens pad least on [20, 64]
    (22000 tokens computed for 16000, where the defaults compute 35200)."""
    recorded(fresh_cache, "embedder", {10: 300, 20: 250})
    recorded(fresh_cache, "embedder", {10: 300, 20: 250}, replica="r1")  # every replica's count
    with caplog.at_level("INFO", logger="neuron_serve"):
        _, spec, _ = load(pooling_dirs, "embedder", length_buckets="auto")
    assert (spec.length_buckets, spec.buckets_from) == ((20, 64), "traffic (1100 inputs)")
    assert spec.describe()["length_buckets_from"] == "traffic (1100 inputs)"
    assert ("model embedder: length buckets [20, 64], learned from 1100 recorded inputs: padded work 1.38x the "
            "real, against 2.20x with the defaults [32, 64]") in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="neuron_serve"):
        _, spec, _ = load(pooling_dirs, "embedder", length_buckets="auto", learn_buckets_after=2000)
    assert (spec.length_buckets, spec.buckets_from) == ((32, 64), "defaults")
    assert ("model embedder: length buckets [32, 64], the defaults (auto: 1100 recorded of the 2000 "
            "it waits for)") in caplog.text


def test_learn_buckets_after_without_auto_is_refused_naming_both_fields():
    # A replica reads model.yaml as the deployment dumps it, every field given: a list of buckets stays valid.
    for pooling in ({"length_buckets": [32]}, {"length_buckets": "auto", "learn_buckets_after": 10}):
        config = parse_config({"name": "m", "task": "embed", "model": {"pretrained": "x"}, "pooling": pooling})
        assert parse_config(config.model_dump()).pooling == config.pooling
    with pytest.raises(ValueError, match="pooling.learn_buckets_after: applies to length_buckets: auto only; set "
                                         "length_buckets: auto or remove learn_buckets_after"):
        parse_config({"name": "m", "task": "embed", "model": {"pretrained": "x"},
                      "pooling": {"length_buckets": [32], "learn_buckets_after": 10}})
