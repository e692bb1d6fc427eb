"""One compile serves any checkpoint of the architecture: a fine-tune swaps in without compiling.

The compiled models take the weights as inputs, so an artifact built from one checkpoint serves another
(model.yaml's ``weights`` beside ``model.artifact``), and a running engine takes a fine-tune in place; torch-xla
compiles no executable for it (its compilation cache holds no new graph) and the answers are the fine-tune's."""

from __future__ import annotations

import logging

import pytest

import generation_models as gm

from neuron_serve.compile.subgraph import compile_count
from neuron_serve.config.schema import parse_config
from neuron_serve.errors import ConfigError
from neuron_serve.generation import SamplingParams, engine_for
from neuron_serve.generation.compiling.artifact import save_generation
from neuron_serve.generation.compiling.build import build_engine
from neuron_serve.targets.pjrt import xla

PROMPTS = [[5, 9, 2, 7, 1, 3], [11, 4, 8, 2]]
NEW_TOKENS = 6
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
SHAPE = {"max_num_seqs": 2, "max_model_len": 32, "prefill_buckets": [32], "decode_batch_buckets": [2],
         "decode_context_buckets": [32]}


def executables() -> int:
    """Graphs torch-xla has compiled in this process (its compilation cache)."""
    return xla()._XLAC._xla_get_num_cached_compilation_graph()


def answers(front) -> list[list[int]]:
    return [d.tokens for d in front.generate_batch(PROMPTS, GREEDY, timeout=300)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """An artifact of the tiny Llama (seed 0) and a fine-tune of it (seed 1: other random weights) saved with
    save_pretrained, in one folder."""
    root = tmp_path_factory.mktemp("weight-swap")
    base, tuned = gm.build("llama", seed=0), gm.build("llama", seed=1)
    tuned.save_pretrained(root / "finetune")
    front = engine_for(base, **SHAPE)
    try:
        save_generation(front.engines.model, root / "built", eos_token_ids=[])
    finally:
        front.close()
    return root, base, tuned


def test_an_artifact_serves_a_fine_tune_without_compiling(built, caplog):
    root, base, tuned = built
    own = build_engine(parse_config({"name": "own", "task": "generate", "model": {"artifact": "built"}}), root)
    try:
        assert answers(own) == [gm.eager_greedy(base, p, NEW_TOKENS) for p in PROMPTS]
    finally:
        own.close()
    before = executables()
    caplog.set_level(logging.INFO, logger="neuron_serve")
    config = parse_config({"name": "tuned", "task": "generate", "model": {"artifact": "built"}, "weights": "finetune"})
    swapped = build_engine(config, root)
    try:
        assert answers(swapped) == [gm.eager_greedy(tuned, p, NEW_TOKENS) for p in PROMPTS]
    finally:
        swapped.close()
    assert executables() == before  # the same graphs, handed other weights: nothing new compiled for them
    assert any(r.getMessage().startswith(f"model tuned: weights from {root / 'finetune'} (") and
               r.getMessage().endswith("tensors) swapped in; 0 subgraph(s) compiled for them") for r in caplog.records)


def test_a_running_engine_takes_a_fine_tune_in_place(built):
    _, base, tuned = built
    front = engine_for(gm.build("llama", seed=0), **SHAPE)
    try:
        assert answers(front) == [gm.eager_greedy(base, p, NEW_TOKENS) for p in PROMPTS]
        compiled, cached = compile_count(), executables()
        assert front.engines.replace_weights(tuned) > 0
        assert answers(front) == [gm.eager_greedy(tuned, p, NEW_TOKENS) for p in PROMPTS]
        assert (compile_count(), executables()) == (compiled, cached)
    finally:
        front.close()


def test_a_checkpoint_of_another_architecture_is_refused_naming_the_weight(built):
    root, _, _ = built
    gm.build("llama", seed=2, intermediate_size=96).save_pretrained(root / "other")
    config = parse_config({"name": "other", "task": "generate", "model": {"artifact": "built"}, "weights": "other"})
    with pytest.raises(ConfigError) as refused:
        build_engine(config, root)
    assert str(refused.value) == (
        f"weights: {root / 'other'}: weight 'lm.model.layers.0.mlp.gate_proj.weight' has shape (96, 64); the traced "
        f"model has (128, 64). Give a checkpoint of the artifact's architecture, or remove weights to serve the "
        f"artifact's own.")


def test_weights_without_an_artifact_is_refused():
    with pytest.raises(ConfigError, match="weights: a generate model swaps in another checkpoint of its architecture "
                                          "from an artifact"):
        parse_config({"name": "m", "task": "generate", "model": {"pretrained": "llm"}, "weights": "finetune"})
