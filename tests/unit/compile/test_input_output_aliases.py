"""input_output_aliases: state tensors that live on the core and are updated in place, as in torch-neuronx."""

import pytest
import torch
import torch_xla.debug.metrics as metrics

import neuron_serve
from example_models import kv_decoder as kd
from neuron_serve.compile.subgraph import CompiledSubgraph
from neuron_serve.errors import ConfigError

TOLERANCE = 1e-4


class Accumulator(torch.nn.Module):
    """Returns (y, new total): the running total is state, output 1 its new value."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        y = self.lin(x) + self.total
        return y, self.total + y.sum(0)


def _accumulator():
    torch.manual_seed(3)
    return Accumulator().eval()


@pytest.fixture(scope="module")
def traced_accumulator():
    model = _accumulator()
    return model, neuron_serve.trace(model, torch.rand(2, 4), input_output_aliases={model.total: 1})


@pytest.fixture(scope="module")
def decoder():
    """The KV-cache decoder bucketed by sequence length (1, 4, 8), its caches one shared state."""
    shared = [torch.zeros_like(c) for c in kd.build().caches()]
    config = neuron_serve.BucketModelConfig(lambda: kd.sequence_bucket_kernel, shared_state_buffer=shared)
    return neuron_serve.bucket_model_trace(kd.bucket_model, kd.example_inputs(), config)


def test_state_is_updated_after_every_call_and_returned_as_torch_neuronx_does(traced_accumulator):
    model, traced = traced_accumulator
    reference = _accumulator()
    for _ in range(4):
        x = torch.rand(2, 4)
        y, total = traced(x)
        expected_y, expected_total = reference(x)
        reference.total.copy_(expected_total)
        torch.testing.assert_close(y, expected_y, atol=TOLERANCE, rtol=TOLERANCE)
        # Every output comes back; the aliased one is the state itself, on the core.
        assert total is traced.states[0] and total.device.type == "xla" and y.device.type == "cpu"
        torch.testing.assert_close(total.cpu(), expected_total, atol=TOLERANCE, rtol=TOLERANCE)
    assert torch.count_nonzero(model.total) == 0  # the module's own buffer is only the initial value


def test_the_executable_aliases_the_state_buffer_and_keeps_it_off_the_host(traced_accumulator):
    _, traced = traced_accumulator
    (part,) = traced.partitions
    compiled = traced.first.graph_module.get_submodule(part.name)
    assert isinstance(compiled, CompiledSubgraph) and part.device == "neuron"
    assert compiled.aliased_buffers == 1 and compiled.keep_on_device == {1}


def test_load_states_overwrites_the_state(traced_accumulator):
    _, traced = traced_accumulator
    traced.load_states([torch.full((4,), 2.0)])
    torch.testing.assert_close(traced.states[0].cpu(), torch.full((4,), 2.0))
    with pytest.raises(ValueError, match="the model has 1 state tensors; got 2"):
        traced.load_states([torch.zeros(4), torch.zeros(4)])


def test_aliases_given_positionally_are_inferred_with_a_warning():
    model = _accumulator()
    with pytest.warns(DeprecationWarning, match="inferred input_output_aliases="):
        traced = neuron_serve.trace(model, torch.rand(2, 4), {model.total: 1})
    traced(torch.ones(2, 4))
    _, expected = model(torch.ones(2, 4))
    torch.testing.assert_close(traced.states[0].cpu(), expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_state_with_weights_apart_from_the_executable():
    model = _accumulator()
    traced = neuron_serve.trace(model, torch.rand(2, 4), input_output_aliases={model.total: 1},
                                inline_weights_to_neff=False)
    other = Accumulator().eval()  # another checkpoint; the state is not a weight
    neuron_serve.replace_weights(traced, {k: v for k, v in other.state_dict().items() if k != "total"})
    for _ in range(3):
        x = torch.rand(2, 4)
        y, total = traced(x)
        expected_y, expected_total = other(x)
        other.total.copy_(expected_total)
        torch.testing.assert_close(y, expected_y, atol=TOLERANCE, rtol=TOLERANCE)
        torch.testing.assert_close(total.cpu(), expected_total, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("aliases, message", [
    (lambda m: {m.total.clone(): 1}, r"a key \(shape \(4,\), torch.float32\) is not a parameter or buffer of "
                                     r"Accumulator; use the module's own tensor"),
    (lambda m: {"total": 1}, "key 'total' is a str, not a tensor of the module"),
    (lambda m: {m.total: 2}, "state 'total' maps to output 2, but the model has 2 output"),
    (lambda m: {m.total: True}, "state 'total' maps to True; give the index of the output"),
    (lambda m: {m.lin.weight: 1}, r"state 'lin.weight' has shape \(4, 4\) and dtype torch.float32, but output 1 "
                                  r"has shape \(4,\) and dtype torch.float32"),
    (lambda m: {m.total: 1, m.lin.bias: 1}, "states 'total' and 'lin.bias' both map to output 1"),
    (lambda m: [m.total], "must be a dict {state tensor: output index}, got list"),
])
def test_malformed_aliases_are_refused_naming_them(aliases, message):
    model = _accumulator()
    with pytest.raises(ConfigError, match=message):
        neuron_serve.trace(model, torch.rand(2, 4), input_output_aliases=aliases(model))


def test_an_output_of_another_dtype_is_refused():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(4, dtype=torch.int64))

        def forward(self, x):
            return x * 2, self.count + x

    model = Counter()
    with pytest.raises(ConfigError, match="state 'count' has shape \\(4,\\) and dtype torch.int64, but output 1 has "
                                          "shape \\(4,\\) and dtype torch.float32"):
        neuron_serve.trace(model, torch.rand(4), input_output_aliases={model.count: 1})


def test_a_plain_function_cannot_have_state():
    with pytest.raises(ConfigError, match="the traced function is a function, not a torch.nn.Module"):
        neuron_serve.trace(lambda x: (x, x), torch.rand(4), input_output_aliases={torch.zeros(4): 1})


def test_a_state_read_on_cpu_is_refused():
    model = _accumulator()
    config = neuron_serve.PartitionerConfig(ops_to_partition={"aten::add"})
    with pytest.raises(ConfigError, match="state 'total' is read by cpu_.*, which runs on CPU"):
        neuron_serve.trace(model, torch.rand(2, 4), input_output_aliases={model.total: 1},
                           partitioner_config=config)


def test_a_stateful_model_is_saved_with_its_state_and_keeps_it_on_the_core(tmp_path):
    model = _accumulator()
    traced = neuron_serve.trace(model, torch.rand(2, 4), input_output_aliases={model.total: 1})
    x = torch.rand(2, 4)
    traced(x)
    traced(x)  # the state has moved on from its initial value
    neuron_serve.save(traced, tmp_path / "artifact")
    loaded = neuron_serve.load(tmp_path / "artifact")
    torch.testing.assert_close(loaded.states[0].cpu(), traced.states[0].cpu(), rtol=0, atol=0)
    for _ in range(3):
        want, got = traced(x), loaded(x)
        torch.testing.assert_close(got[0], want[0], rtol=TOLERANCE, atol=TOLERANCE)
        assert got[1].device.type == "xla"  # the new state, on the core
        torch.testing.assert_close(got[1].cpu(), want[1].cpu(), rtol=TOLERANCE, atol=TOLERANCE)


def test_what_cannot_hold_state_is_refused(traced_accumulator):
    model, traced = traced_accumulator
    with pytest.raises(ConfigError, match="cannot be combined with batch_sizes"):
        neuron_serve.trace(model, torch.rand(2, 4), input_output_aliases={model.total: 1}, batch_sizes=[1, 2])
    with pytest.raises(ConfigError, match="dynamic_batch\\(\\) cannot chunk a model with input_output_aliases"):
        neuron_serve.dynamic_batch(traced)
    from neuron_serve.runtime.runner import ModelRunner

    with pytest.raises(ConfigError, match="cannot be served yet; call the traced model in process"):
        ModelRunner(traced, cores=1, name="acc")


def _kernel():
    return lambda inputs: (inputs, torch.tensor(0))


def test_shared_state_buffer_must_match_the_bucket_models_aliases():
    state = [torch.zeros(4)]
    plain = neuron_serve.BucketModelConfig(_kernel, shared_state_buffer=state)
    with pytest.raises(ConfigError, match="bucket 0's model aliases 0 state tensor\\(s\\) .* but shared_state_buffer "
                                          "has 1"):
        neuron_serve.bucket_model_trace(lambda: (_accumulator(), {}), [torch.rand(2, 4)], plain)
    wrong = neuron_serve.BucketModelConfig(_kernel, shared_state_buffer=[torch.zeros(5)])

    def func():
        model = _accumulator()
        return model, {model.total: 1}

    with pytest.raises(ConfigError, match="bucket 0's state 'total' has shape \\(4,\\) and dtype torch.float32, but "
                                          "its shared_state_buffer entry has shape \\(5,\\)"):
        neuron_serve.bucket_model_trace(func, [torch.rand(2, 4)], wrong)


def test_every_bucket_reads_and_updates_one_shared_state_on_the_core(decoder):
    states = {id(b.state) for b in decoder.buckets}
    assert len(states) == 1 and len(decoder.states) == 2 * kd.LAYERS
    assert all(t.device.type == "xla" for t in decoder.states)
    for bucket in decoder.buckets:
        # One accelerator subgraph per bucket, compiled, its executable aliasing every cache.
        (part,) = bucket.partitions
        compiled = bucket.graph_module.get_submodule(part.name)
        assert isinstance(compiled, CompiledSubgraph) and part.device == "neuron"
        assert compiled.aliased_buffers == 2 * kd.LAYERS


@pytest.mark.parametrize("prompt", [[3, 17, 5], [3, 17, 5, 9, 22, 1, 30]])
def test_greedy_generation_equals_eager(decoder, prompt):
    kd.reset_caches(decoder)
    eager = kd.build()
    prompt = torch.tensor([prompt])
    tokens, scores = kd.generate(kd.traced_step(decoder), prompt, 16)
    expected, expected_scores = kd.generate(lambda t, s: kd.eager_step(eager, t, s), prompt, 16)
    assert tokens == expected
    for got, want in zip(scores, expected_scores):
        torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=TOLERANCE)
    for got, want in zip(decoder.states, eager.caches()):
        torch.testing.assert_close(got.cpu(), want, atol=TOLERANCE, rtol=TOLERANCE)


def _live_xla_tensors() -> int:
    return metrics.counter_value("CreateXlaTensor") - metrics.counter_value("DestroyXlaTensor")


def _transferred() -> float:
    """Bytes moved between host and device, both ways, so far."""
    return sum((metrics.metric_data(name) or (0, 0.0))[1] for name in ("InboundData", "OutboundData"))


def test_the_state_survives_many_calls_without_leaking(decoder):
    """300 decode steps: the state stays right, no tensor is left behind, and the cache never crosses to the host."""
    kd.reset_caches(decoder)
    eager = kd.build()
    step = kd.traced_step(decoder)
    calls = 300
    cache_bytes = sum(t.numel() * t.element_size() for t in eager.caches())
    step(torch.tensor([[1]]), 0)  # warm-up
    kd.eager_step(eager, torch.tensor([[1]]), 0)
    live, moved = _live_xla_tensors(), _transferred()
    for i in range(1, calls + 1):
        token, position = torch.tensor([[i % kd.VOCAB]]), i % kd.MAX_LEN
        logits = step(token, position)
        expected = kd.eager_step(eager, token, position)
    # A leaked copy of the cache per call would leave 300 x 4 live tensors; a per-call copy
    # of the cache to or from the host would move 300 x cache_bytes.
    assert _live_xla_tensors() - live <= 2
    assert (_transferred() - moved) / calls < cache_bytes / 4
    torch.testing.assert_close(logits, expected, atol=TOLERANCE, rtol=TOLERANCE)
    for got, want in zip(decoder.states, eager.caches()):
        torch.testing.assert_close(got.cpu(), want, atol=TOLERANCE, rtol=TOLERANCE)
