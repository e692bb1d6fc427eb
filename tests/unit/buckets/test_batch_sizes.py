"""Compiled batch sizes: the chooser, the model.yaml field, trace(batch_sizes=...), artifacts and progress."""

import pytest
import torch

import neuron_serve
from neuron_serve.config.schema import parse_config
from neuron_serve.errors import ConfigError, InvalidInput
from neuron_serve.buckets.batch_sizes import default_batch_sizes, monotone, plan
from neuron_serve.assembly.progress import BuildProgress, reporting
from reference_models import MLP

TOLERANCE = 1e-5
BASE = {"name": "m", "model": {"factory": "a:b"}, "inputs": [{"name": "x", "shape": [4, 8]}]}


# -- the chooser ----------------------------------------------------------------------


def test_19_rows_run_as_16_plus_4_when_that_is_cheaper():
    assert plan(19, {1: 1.0, 4: 2.0, 16: 5.0, 32: 10.0}) == [16, 4]  # 7.0 against 10.0 for 32


def test_19_rows_run_as_32_when_that_is_cheaper():
    assert plan(19, {1: 1.0, 4: 2.0, 16: 5.0, 32: 6.0}) == [32]  # 6.0 against 7.0 for 16 + 4


def test_costs_proportional_to_rows_give_the_least_padding_then_the_fewest_calls():
    costs = {n: float(n) for n in (1, 4, 16, 32)}
    assert plan(19, costs) == [16, 1, 1, 1]  # 19 rows, no padding
    assert plan(32, costs) == [32]
    assert plan(1, costs) == [1]


def test_a_fixed_cost_per_call_prefers_one_padded_call():
    costs = {1: 3.0, 4: 3.1, 16: 3.5, 32: 4.0}  # launch-bound: rows are nearly free
    assert plan(5, costs) == [16]
    assert plan(40, costs) == [32, 16]


def test_a_measured_inversion_never_pads_one_row_to_a_larger_size():
    # As timed at load on the MLP example: size 4 came out cheaper than size 1 (cold caches).
    measured = {1: 2.34, 4: 2.04, 16: 2.72, 32: 6.24, 64: 9.26}
    assert plan(1, measured) == [4]  # taken at face value, a lone row pays for four
    assert monotone(measured) == {1: 2.34, 4: 2.34, 16: 2.72, 32: 6.24, 64: 9.26}
    assert plan(1, monotone(measured)) == [1]  # a tie goes to fewer padded rows


def test_plan_refuses_no_rows_and_no_sizes():
    with pytest.raises(ValueError, match="at least one row, got 0"):
        plan(0, {1: 1.0})
    with pytest.raises(ValueError, match="no compiled sizes"):
        plan(3, {})


# -- model.yaml -----------------------------------------------------------------------


@pytest.mark.parametrize("limit, sizes", [(32, [1, 4, 16, 32]), (1, [1]), (8, [1, 4, 8]), (100, [1, 4, 16, 64, 100])])
def test_the_default_is_powers_of_4_up_to_max_batch_size_and_it(limit, sizes):
    assert default_batch_sizes(limit) == sizes
    config = parse_config({**BASE, "batching": {"max_batch_size": limit}})
    assert config.batch_sizes is None and config.compiled_batch_sizes() == sizes


def test_batch_sizes_are_sorted_and_deduplicated():
    assert parse_config({**BASE, "batch_sizes": [32, 1, 4, 4]}).compiled_batch_sizes() == [1, 4, 32]


@pytest.mark.parametrize("extra, message", [
    ({"batch_sizes": [0, 3]}, "batch_sizes: Value error, batch_sizes: batch sizes must be positive integers, got [0]"),
    ({"batch_sizes": [4, 64]}, "batch_sizes: 64 is larger than batching.max_batch_size (32)"),
    ({"batch_sizes": [2], "batching": {"max_batch_size": 1}}, "batch_sizes: 2 is larger than batching.max_batch_size (1)"),
    ({"batch_sizes": []}, "batch_sizes: Value error, batch_sizes: give at least one batch size"),
    ({"batch_sizes": [2], "dynamic_batch": False}, "batch_sizes needs dynamic_batch: true"),
])
def test_bad_batch_sizes_are_refused_naming_the_field(extra, message):
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, **extra})
    assert message in str(info.value)


def test_without_dynamic_batch_only_the_trace_batch_is_compiled():
    assert parse_config({**BASE, "dynamic_batch": False}).compiled_batch_sizes() is None


# -- trace(batch_sizes=...) -----------------------------------------------------------


def _trace_mlp():
    model = MLP(layers=[32, 16]).eval()
    traced = neuron_serve.trace(model, torch.rand(4, 784), partitioner_config=neuron_serve.PartitionerConfig(),
                                batch_sizes=[8, 1, 2])
    return model, traced


@pytest.fixture(scope="module")
def mlp():
    return _trace_mlp()


@pytest.fixture(scope="module")
def mlp_dynamic():
    model, traced = _trace_mlp()
    return model, neuron_serve.dynamic_batch(traced)


def test_each_size_is_compiled_from_the_example_resized_along_dim_0(mlp):
    _, traced = mlp
    assert traced.batch_sizes == [1, 2, 8]
    for bucket, rows in zip(traced.grid(0), (1, 2, 8)):
        assert bucket.input_shapes[0][0] == (rows, 784)
        assert [p.device for p in bucket.partitions] == ["neuron", "cpu"]
        accel = bucket.graph_module.get_submodule("accel_0")
        assert type(accel).__name__ == "CompiledSubgraph"  # an XLA executable, not the eager graph
    assert traced.signature().inputs[0].shape == (-1, 784)


def test_without_dynamic_batch_a_call_takes_exactly_one_compiled_size(mlp):
    model, traced = mlp
    x = torch.rand(2, 784)
    torch.testing.assert_close(traced(x), model(x), atol=TOLERANCE, rtol=TOLERANCE)
    with pytest.raises(InvalidInput, match=r"the call has 3 rows; the model is compiled for batch sizes \[1, 2, 8\]. "
                                           r"Enable dynamic_batch"):
        traced(torch.rand(3, 784))


@pytest.mark.parametrize("rows", [1, 3, 11, 20])
def test_dynamic_batch_runs_any_rows_over_the_compiled_sizes_equal_to_eager(mlp_dynamic, rows):
    model, traced = mlp_dynamic
    x = torch.rand(rows, 784)
    torch.testing.assert_close(traced(x), model(x), atol=TOLERANCE, rtol=TOLERANCE)


def test_dynamic_batch_still_works_on_a_module_compiled_for_one_size():
    model = torch.nn.Linear(5, 2).eval()
    traced = neuron_serve.dynamic_batch(neuron_serve.trace(model, torch.rand(2, 5)))
    assert traced.batch_sizes == [2]
    x = torch.rand(7, 5)
    torch.testing.assert_close(traced(x), model(x), atol=TOLERANCE, rtol=TOLERANCE)


def test_trace_refuses_bad_batch_sizes():
    with pytest.raises(ConfigError, match=r"trace\(batch_sizes=...\): batch sizes must be positive integers, got \[-1\]"):
        neuron_serve.trace(torch.nn.Linear(5, 2), torch.rand(2, 5), batch_sizes=[-1, 2])


def test_the_artifact_keeps_every_size(mlp_dynamic, tmp_path):
    model, traced = mlp_dynamic
    loaded = neuron_serve.load(neuron_serve.save(traced, tmp_path / "mlp"))
    assert loaded.batch_sizes == [1, 2, 8] and loaded.dynamic_batch_enabled
    assert sorted(p.name for p in (tmp_path / "mlp").iterdir() if p.is_dir()) == [
        "bucket_0", "bucket_0_batch_1", "bucket_0_batch_2"]
    x = torch.rand(11, 784)
    torch.testing.assert_close(loaded(x), model(x), atol=TOLERANCE, rtol=TOLERANCE)


def test_progress_names_the_batch_size_being_compiled(fresh_cache, neuron_logs):
    with reporting(BuildProgress("lin", 1, batch_sizes=2, tty=False)) as progress:
        neuron_serve.trace(torch.nn.Linear(5, 2), torch.rand(2, 5), batch_sizes=[1, 2])
    lines = [line.split(" in ")[0] for line in neuron_logs() if line.startswith("compiled lin")]
    assert lines == ["compiled lin batch 1 (1 of 2)", "compiled lin batch 2 (2 of 2)"]
    assert progress.bucket == progress.buckets == 2
