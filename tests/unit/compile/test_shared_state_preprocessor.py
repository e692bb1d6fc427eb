"""shared_state_buffer_preprocessor: bucket models see views of one shared state, updated on the core."""

from typing import List

import pytest
import torch
import torch_xla.debug.metrics as metrics

import neuron_serve
from example_models import kv_decoder as kd
from neuron_serve.compile.subgraph import CompiledSubgraph
from neuron_serve.errors import ConfigError

TOLERANCE = 1e-4
BUCKETS = len(kd.CONTEXT_BUCKETS)


def _config(preprocessor):
    shared = [torch.zeros_like(c) for c in kd.build().caches()]
    return neuron_serve.BucketModelConfig(lambda: kd.context_bucket_kernel, shared_state_buffer=shared,
                                          shared_state_buffer_preprocessor=lambda: preprocessor,
                                          func_kwargs=[{"bucket": i} for i in range(BUCKETS)])


@pytest.fixture(scope="module")
def decoder():
    """Buckets (8 tokens, 16 positions), (1, 16), (1, 32) over one 48-position cache, sliced per bucket."""
    config = _config(kd.sliced_cache_preprocessor)
    return neuron_serve.bucket_model_trace(kd.sliced_bucket_model, kd.context_example_inputs(), config)


def test_every_bucket_executable_takes_and_aliases_the_whole_shared_cache(decoder):
    assert len({id(b.state) for b in decoder.buckets}) == 1
    assert [tuple(t.shape) for t in decoder.states] == [(1, kd.HEADS, kd.MAX_LEN, kd.DIM // kd.HEADS)] * 4
    for bucket in decoder.buckets:
        (part,) = bucket.partitions  # the slicing and the write-back run on the core with the model
        compiled = bucket.graph_module.get_submodule(part.name)
        assert isinstance(compiled, CompiledSubgraph) and part.device == "neuron"
        assert compiled.aliased_buffers == 2 * kd.LAYERS
    # The aliased outputs are the shared state tensors themselves, whole.
    _, k_0, *_ = decoder(torch.tensor([[1]]), torch.tensor([20]))
    assert k_0 is decoder.states[0]


@pytest.mark.parametrize("prompt", [[3, 17, 5], [3, 17, 5, 9, 22, 1, 30]])
def test_greedy_generation_across_buckets_equals_eager(decoder, prompt):
    """The prompt fills a 16-position view; generation runs past 16 into the 32-position bucket."""
    kd.reset_caches(decoder)
    eager = kd.build()
    prompt = torch.tensor([prompt])
    tokens, scores = kd.generate(kd.traced_step(decoder), prompt, 20)
    expected, expected_scores = kd.generate(lambda t, s: kd.eager_step(eager, t, s), prompt, 20)
    assert prompt.shape[1] + 20 > 16 + 1
    assert tokens == expected
    for got, want in zip(scores, expected_scores):
        torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=TOLERANCE)
    for got, want in zip(decoder.states, eager.caches()):
        torch.testing.assert_close(got.cpu(), want, atol=TOLERANCE, rtol=TOLERANCE)


def _transferred() -> float:
    """Bytes moved between host and device, both ways, so far."""
    return sum((metrics.metric_data(name) or (0, 0.0))[1] for name in ("InboundData", "OutboundData"))


def _live_xla_tensors() -> int:
    return metrics.counter_value("CreateXlaTensor") - metrics.counter_value("DestroyXlaTensor")


def test_the_shared_cache_stays_on_the_core_across_buckets(decoder):
    """Decode steps alternating between the 16- and 32-position buckets move no cache to or from the host."""
    kd.reset_caches(decoder)
    eager = kd.build()
    step = kd.traced_step(decoder)
    for position in (0, 20):  # warm-up both decode buckets
        step(torch.tensor([[1]]), position)
        kd.eager_step(eager, torch.tensor([[1]]), position)
    cache_bytes = sum(t.numel() * t.element_size() for t in eager.caches())
    calls = 60
    live, moved = _live_xla_tensors(), _transferred()
    for i in range(calls):
        token, position = torch.tensor([[i % kd.VOCAB]]), (i * 7) % 32
        logits = step(token, position)
        expected = kd.eager_step(eager, token, position)
        torch.testing.assert_close(logits, expected, atol=TOLERANCE, rtol=TOLERANCE)
    # A per-call copy of the cache (or of a bucket's slice of it) to or from the host
    # would move at least a third of cache_bytes per call; a leak would leave tensors behind.
    assert (_transferred() - moved) / calls < cache_bytes / 8
    assert _live_xla_tensors() - live <= 2
    for got, want in zip(decoder.states, eager.caches()):
        torch.testing.assert_close(got.cpu(), want, atol=TOLERANCE, rtol=TOLERANCE)


@torch.jit.script
def _too_few(shapes: List[List[int]], state: List[torch.Tensor], bucket: torch.Tensor) -> List[torch.Tensor]:
    return [cache[:, :, :16] for cache in state[:2]]


@torch.jit.script
def _too_short(shapes: List[List[int]], state: List[torch.Tensor], bucket: torch.Tensor) -> List[torch.Tensor]:
    return [cache[:, :, :8] for cache in state]


@torch.jit.script
def _copies(shapes: List[List[int]], state: List[torch.Tensor], bucket: torch.Tensor) -> List[torch.Tensor]:
    return [cache[:, :, :16].clone() for cache in state]


@pytest.mark.parametrize("preprocessor, message", [
    (_too_few, r"for bucket 0 the preprocessor returned 2 tensor\(s\), but shared_state_buffer has 4"),
    (_too_short, r"for bucket 0 the preprocessor made shared_state_buffer\[0\] shape \(1, 2, 8, 8\) and dtype "
                 r"torch.float32, but the bucket model's state 'k_0' has shape \(1, 2, 16, 8\)"),
    (_copies, r"for bucket 0 tensor 0 the preprocessor returned is not a view of shared_state_buffer\[0\]"),
    (lambda shapes, state, bucket: None, "for bucket 0 the preprocessor returned NoneType; it must return a list"),
])
def test_a_malformed_preprocessor_is_refused_naming_it(preprocessor, message):
    with pytest.raises(ConfigError, match=r"BucketModelConfig\(shared_state_buffer_preprocessor=\.\.\.\): " + message):
        neuron_serve.bucket_model_trace(kd.sliced_bucket_model, kd.context_example_inputs(), _config(preprocessor))
