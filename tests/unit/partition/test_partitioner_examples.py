"""The three worked examples of the torch-neuronx graph partitioner app note."""

import pytest
import torch

import neuron_serve
from reference_models import MLP, SandwichMLP, line_of

TOLERANCE = 1e-5


def test_default_config_puts_only_sort_on_cpu():
    model = MLP().eval()
    inputs = torch.rand(32, 784)
    traced = neuron_serve.trace(model, inputs, partitioner_config=neuron_serve.PartitionerConfig())

    cpu = [p for p in traced.partitions if p.device == "cpu"]
    assert [p.op_counts for p in cpu] == [{"aten::sort": 1}]
    assert [p.device for p in traced.partitions] == ["neuron", "cpu"]
    assert traced.partitions[0].op_counts == {"aten::linear": 3, "aten::relu": 2, "aten::log_softmax": 1}
    torch.testing.assert_close(traced(inputs), model(inputs), atol=TOLERANCE, rtol=TOLERANCE)


def test_sort_between_layers_exceeds_max_subgraph_count():
    model = SandwichMLP().eval()
    config = neuron_serve.PartitionerConfig(max_subgraph_count=2)
    with pytest.raises(ValueError) as info:
        neuron_serve.trace(model, torch.rand(32, 784), partitioner_config=config)
    assert str(info.value) == (
        "The partitioner has found 3 subgraphs which exceeds the specified max subgraph count of 2."
    )


def test_ops_to_partition_moves_log_softmax_to_cpu(neuron_logs):
    model = MLP().eval()
    inputs = torch.rand(32, 784)
    config = neuron_serve.PartitionerConfig(
        min_operator_percentage_threshold=0.8, ops_to_partition=set(["aten::log_softmax"])
    )
    traced = neuron_serve.trace(model, inputs, partitioner_config=config)

    logs = neuron_logs()
    assert "85.71% of arithmetic operations (6 of 7) are supported" in logs
    assert "Num Partitions: 2" in logs
    # log_softmax is still reported supported; it is only placed on CPU.
    supported = logs[logs.index("The following operations are currently supported:") + 1 :][:3]
    assert set(supported) == {"aten::linear", "aten::relu", "aten::log_softmax"}
    assert logs[logs.index("The following operations are currently not supported:") + 1] == (
        f"aten::sort, reference_models.py({line_of('sort_out, _ = torch.sort(out)')}): sort_out, _ = torch.sort(out)"
    )
    first = logs.index("Creating Partition #1 for device: Device.NEURON")
    assert logs[first + 1 : first + 4] == [
        "The following operators will be included in this partition:",
        "aten::linear:3",
        "aten::relu:2",
    ]
    second = logs.index("Creating Partition #2 for device: Device.CPU")
    assert set(logs[second + 2 : second + 4]) == {"aten::sort:1", "aten::log_softmax:1"}

    assert [(p.device, p.op_counts) for p in traced.partitions] == [
        ("neuron", {"aten::linear": 3, "aten::relu": 2}),
        ("cpu", {"aten::log_softmax": 1, "aten::sort": 1}),
    ]
    torch.testing.assert_close(traced(inputs), model(inputs), atol=TOLERANCE, rtol=TOLERANCE)


def test_sandwiched_sort_runs_in_three_partitions_without_a_limit():
    model = SandwichMLP(layers=[64, 32]).eval()
    inputs = torch.rand(8, 784)
    traced = neuron_serve.trace(model, inputs, partitioner_config=neuron_serve.PartitionerConfig())
    assert [p.device for p in traced.partitions] == ["neuron", "cpu", "neuron"]
    torch.testing.assert_close(traced(inputs), model(inputs), atol=TOLERANCE, rtol=TOLERANCE)


def test_min_subgraph_size_violation():
    model = MLP(layers=[64, 32]).eval()
    config = neuron_serve.PartitionerConfig(min_subgraph_size=2)
    with pytest.raises(ValueError) as info:
        neuron_serve.trace(model, torch.rand(4, 784), partitioner_config=config)
    assert str(info.value) == (
        "The partitioner has found a subgraph of size 1 (Partition #2 for device: Device.CPU) "
        "which is below the specified min subgraph size of 2."
    )


def test_support_threshold_violation():
    model = MLP(layers=[64, 32]).eval()
    config = neuron_serve.PartitionerConfig(model_support_percentage_threshold=0.9)
    with pytest.raises(ValueError) as info:
        neuron_serve.trace(model, torch.rand(4, 784), partitioner_config=config)
    assert str(info.value) == (
        "The partitioner has found 85.71% of arithmetic operations (6 of 7) supported which is below "
        "the specified model support percentage threshold of 90.00%."
    )


def test_without_partitioner_config_unsupported_ops_are_listed_with_call_sites():
    model = MLP(layers=[64, 32]).eval()
    with pytest.raises(neuron_serve.UnsupportedModelError) as info:
        neuron_serve.trace(model, torch.rand(4, 784))
    line = line_of("sort_out, _ = torch.sort(out)")
    assert str(info.value) == (
        "The model has 1 operator(s) that target 'neuron' cannot run:\n"
        f"  aten::sort at reference_models.py({line}): sort_out, _ = torch.sort(out): "
        "neuronx-cc does not support sort\n"
        "Pass partitioner_config=neuron_serve.PartitionerConfig() to run them on CPU."
    )


def test_every_broken_rule_is_found_and_trace_raises_the_first():
    from neuron_serve.analysis.capture import capture
    from neuron_serve.analysis.placement import analyze_graph
    from neuron_serve.api import placement
    from neuron_serve.partition.plan import plan_partitions, rule_violations
    from neuron_serve.targets import get_target

    model, x = MLP(layers=[64, 32]).eval(), torch.rand(8, 784)
    config = neuron_serve.PartitionerConfig(model_support_percentage_threshold=0.9, max_subgraph_count=1,
                                            min_subgraph_size=2)
    captured = capture(model, x)
    placed = placement(analyze_graph(captured, get_target("neuron")))
    plan = plan_partitions(captured.gm, placed, neuron_serve.PartitionerConfig(model_support_percentage_threshold=0))
    found = rule_violations(placed, plan.partitions, config)
    assert [(v.rule, v.subgraphs) for v in found] == [
        ("model_support_percentage_threshold", []), ("max_subgraph_count", [1, 2]), ("min_subgraph_size", [2])]
    assert found[1].message == "The partitioner has found 2 subgraphs which exceeds the specified max subgraph count of 1."
    with pytest.raises(ValueError) as info:
        neuron_serve.trace(model, x, partitioner_config=config)
    assert str(info.value) == found[0].message == (
        "The partitioner has found 85.71% of arithmetic operations (6 of 7) supported which is below the specified "
        "model support percentage threshold of 90.00%.")
