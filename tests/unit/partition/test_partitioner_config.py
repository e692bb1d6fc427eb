import pytest

from neuron_serve import ConfigError, PartitionerConfig


def test_defaults_match_torch_neuronx():
    config = PartitionerConfig()
    assert config.model_support_percentage_threshold == 0.5
    assert (config.min_subgraph_size, config.max_subgraph_count) == (-1, -1)
    assert config.ops_to_partition == frozenset()


def test_alias_of_threshold():
    assert PartitionerConfig(min_operator_percentage_threshold=0.8).model_support_percentage_threshold == 0.8


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"model_support_percentage_threshold": 1.5}, "model_support_percentage_threshold"),
        ({"min_operator_percentage_threshold": -0.1}, "model_support_percentage_threshold"),
        ({"min_subgraph_size": 0}, "min_subgraph_size"),
        ({"max_subgraph_count": -2}, "max_subgraph_count"),
        ({"max_subgraph_count": 2.5}, "max_subgraph_count"),
        ({"ops_to_partition": "aten::sort"}, "ops_to_partition"),
        ({"ops_to_partition": {"sort"}}, "ops_to_partition"),
        ({"trace_kwargs": "x"}, "trace_kwargs"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as info:
        PartitionerConfig(**kwargs)
    assert isinstance(info.value, ConfigError)
    assert f"PartitionerConfig.{field}" in str(info.value)


def test_namespace_hint():
    with pytest.raises(ConfigError, match="write it as 'aten::sort'"):
        PartitionerConfig(ops_to_partition={"sort"})
