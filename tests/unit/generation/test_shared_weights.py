"""One copy of a generate model's weights on its core, whatever the number of compiled models.

Every compiled model (prefills, greedy and sampled decodes, mixed calls of chunked prefill, with LoRA) takes the
weights as inputs: the same device tensors, placed once. Checked by identity and by the runtime's own account of
what it holds on the core, and the answers stay transformers' (greedy) and the compiled sampler's (seeded)."""

from __future__ import annotations

import pytest
import torch

import generation_models as gm
from generation_models import ATTENTION

from neuron_serve.compile import core_weights
from neuron_serve.compile.subgraph import CompiledSubgraph
from neuron_serve.config.schema import parse_config
from neuron_serve.generation import SamplingParams
from neuron_serve.generation.compiling.build import build_engine

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny Llama from a model.yaml with two prefill lengths, two decode row counts, sampling on the core,
    chunked prefill (mixed calls) and a LoRA adapter; every model compiled before it serves."""
    root = tmp_path_factory.mktemp("shared-weights")
    lm, peft = gm.base_and_adapters(root, {"attention": {"r": 4, "lora_alpha": 8, "target_modules": ATTENTION}})
    config = parse_config({
        "name": "shared", "task": "generate", "model": {"pretrained": "llama"},
        "generation": {"max_num_seqs": 4, "max_model_len": 32, "prefill_buckets": [16, 32],
                       "decode_batch_buckets": [1, 4], "decode_context_buckets": [32],
                       "enable_chunked_prefill": True, "max_num_batched_tokens": 16,
                       "lora": {"max_loras": 1, "max_lora_rank": 8, "lora_modules": {"attention": "attention"}}}})
    front = build_engine(config, root)
    yield front, lm, peft["attention"]
    front.close()


def subgraphs(model):
    for shape in model.shapes:
        for module in model.bucket(shape).graph_module.children():
            if isinstance(module, CompiledSubgraph):
                yield shape, module


def test_every_compiled_model_takes_the_same_device_tensors(served):
    front, _, _ = served
    model = front.engines.engines[0].model
    lm = model.build.lm  # the model the replica loaded from its directory
    kinds = {shape.kind for shape in model.shapes}
    assert {"prefill", "decode", "mixed"} <= kinds and any(s.sampled for s in model.shapes) and model.lora is not None
    assert len(model.shapes) >= 8
    first: dict[str, torch.Tensor] = {}
    for shape, sub in subgraphs(model):
        assert not sub.inline_weights
        assert len(sub.held_weights) == len(sub.weights) > 0
        for (name, weight), tensor in zip(sub.held_weights.items(), sub._weights_on_device):
            assert tensor is weight.tensor  # what the executable is handed is the held tensor
            assert first.setdefault(name, tensor) is tensor, f"{shape.label} holds its own copy of {name}"
    # The runtime's own account: the weights held on this core that come from the model's tensors are one set: every
    # parameter once (the tied embedding and head once), and the buffers the graphs read.
    device = str(model.state.device)
    storages = {t.untyped_storage().data_ptr() for t in [*lm.parameters(), *lm.buffers()]}
    held = [w for w in core_weights.held() if w.device == device and w.key[0] in storages]
    assert {id(w.tensor) for w in held} == {id(t) for t in first.values()}
    assert {w.key[0] for w in held} >= {p.untyped_storage().data_ptr() for p in lm.parameters()}
    parameters = sum(p.numel() * p.element_size() for p in lm.parameters())  # tied ones once
    assert parameters <= sum(w.nbytes for w in held) == model.memory_per_core()["weights"] < parameters * 1.01


def test_answers_are_unchanged_by_sharing(served):
    front, lm, peft = served
    prompts = [[5, 9, 2, 7, 1, 3], [11, 4, 8] * 7, [3, 1, 4, 1, 5, 9, 2, 6]]  # a 21-token prompt runs in chunks
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    sampled = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, top_k=20, seed=7)
    done = front.generate_batch([prompts[0], prompts[1], prompts[2], prompts[0]], [greedy, greedy, sampled, greedy],
                                adapters=[None, None, None, "attention"])
    assert done[0].tokens == gm.eager_greedy(lm, prompts[0], NEW_TOKENS)
    assert done[1].tokens == gm.eager_greedy(lm, prompts[1], NEW_TOKENS)
    assert done[2].tokens == gm.eager_sampled(lm, prompts[2], NEW_TOKENS, sampled)
    assert done[3].tokens == gm.eager_greedy(peft, prompts[0], NEW_TOKENS)


def test_the_engines_say_what_they_hold_of_host_memory(served):
    """The host memory report (the model metadata's parameters.host_memory, the neuron_serve_host_memory_bytes
    metric): one copy of the weights on the core beside their host copy, the cache, and each compiled model's own
    bytes, measured as it compiled."""
    front, _, _ = served
    model = front.engines.engines[0].model
    report = front.engines.host_memory
    per_core = model.memory_per_core()
    assert report["weights_on_cores_bytes"] == report["weights_bytes"] == per_core["weights"]
    assert report["kv_cache_bytes"] == per_core["kv_cache"] + per_core["lora"]
    assert set(report["compiled_models_bytes"]) == {s.label for s in model.shapes}
    assert report["compiled_models_total_bytes"] == sum(report["compiled_models_bytes"].values())
    assert report["cores_in_host_memory"] is True  # emulated: the cores' memory is this process's
    assert report["resident_bytes"] > report["weights_bytes"] + report["kv_cache_bytes"]
