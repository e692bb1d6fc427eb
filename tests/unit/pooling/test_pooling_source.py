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
