"""Placement per model: trace(placement=...) and model.yaml's placement, stages compiled like any
accelerator partition, and the refusals that name the field and the fix."""

import pytest
import torch

import neuron_serve
from neuron_serve.compile.subgraph import CompiledSubgraph
from neuron_serve.config.schema import parse_config
from neuron_serve.errors import ConfigError, PartitionError
from neuron_serve.partition.pipeline import CORE_MEMORY_ENV
from test_pipeline_placement import BUDGET, FourLayers

PIPELINE = {"mode": "pipeline", "cores_per_pipeline": 2}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return FourLayers().eval()


@pytest.fixture(scope="module")
def traced(model):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CORE_MEMORY_ENV, str(BUDGET))
        return neuron_serve.trace(model, torch.randn(4, 64), placement=neuron_serve.ModelPlacement(**PIPELINE))


def test_over_budget_model_is_traced_as_two_compiled_stages(traced, model):
    assert [(p.name, p.core, p.device) for p in traced.partitions] == [("accel_0", 0, "neuron"), ("accel_1", 1, "neuron")]
    assert all(isinstance(traced.first.graph_module.get_submodule(p.name), CompiledSubgraph) for p in traced.partitions)
    assert [p.op_counts for p in traced.partitions] == [{"aten::linear": 2, "aten::relu": 2}] * 2
    # As torch counts a stage: 2 x 16640 weight bytes, four 1024-byte outputs and the 1024-byte input.
    assert [p.memory_bytes for p in traced.partitions] == [38400, 38400]
    assert traced.partitions[1].bytes_in == 4 * 64 * 4
    assert traced.pipeline_span == 2
    assert traced.report["pipeline"]["core_memory_bytes"] == BUDGET
    x = torch.randn(4, 64)
    with torch.no_grad():
        torch.testing.assert_close(traced(x), model(x), rtol=1e-5, atol=1e-5)


def test_replicate_is_the_default_and_fits_one_core(model):
    traced = neuron_serve.trace(model, torch.randn(4, 64))
    assert [p.core for p in traced.partitions] == [0] and traced.pipeline_span == 1
    assert "core" not in traced.partitions[0].describe()


def test_pipeline_refuses_operators_that_would_run_on_cpu(model, monkeypatch):
    monkeypatch.setenv(CORE_MEMORY_ENV, str(BUDGET))
    config = neuron_serve.PartitionerConfig(ops_to_partition={"aten::relu"})
    with pytest.raises(PartitionError) as e:
        neuron_serve.trace(model, torch.randn(4, 64), partitioner_config=config, placement=PIPELINE)
    assert str(e.value) == ("placement mode pipeline runs every operator on the accelerator, but 4 would run on "
                            "CPU, e.g. aten::relu (relu, listed in ops_to_partition); use placement mode replicate "
                            "for a model with CPU partitions")


def test_a_model_that_fits_no_pipeline_is_refused_at_trace(model, monkeypatch):
    monkeypatch.setenv(CORE_MEMORY_ENV, "20000")
    with pytest.raises(PartitionError, match=r"^Devices have no enough memory for the module \(75776 bytes over 2 "):
        neuron_serve.trace(model, torch.randn(4, 64), placement=PIPELINE)


@pytest.mark.parametrize(("placement", "message"), [
    ({"mode": "pipelined"}, "placement.mode: 'pipelined' is not one of replicate, pipeline"),
    ({"mode": "pipeline"}, "placement.cores_per_pipeline: pipeline mode needs a whole number of cores >= 1 to "
                           "split the model over, got None"),
    ({"mode": "pipeline", "cores_per_pipeline": 2, "balance": "fastest"},
     "placement.balance: 'fastest' is not one of size_based, cost_aware, kl_based, latency"),
    ({"balance": "kl_based"}, "placement.balance applies to mode: pipeline; remove it or set placement.mode to pipeline"),
    ({"mode": "pipeline", "cores": 2}, "placement.cores: unknown field; the fields are mode, cores_per_pipeline, "
                                       "balance, saturate_host"),
    ("pipeline", "trace(placement=...) must be a neuron_serve.ModelPlacement or a dict of its fields (mode, "
                 "cores_per_pipeline, balance, saturate_host)"),
])
def test_bad_placement_is_refused_naming_the_field(model, placement, message):
    with pytest.raises(ConfigError) as e:
        neuron_serve.trace(model, torch.randn(4, 64), placement=placement)
    assert str(e.value) == message


BASE = {"name": "four", "model": {"factory": "four_layers:build"}, "inputs": [{"name": "x", "shape": [4, 64]}]}


def test_model_yaml_placement_defaults_to_the_replicas_cores():
    config = parse_config({**BASE, "cores_per_replica": 4, "placement": {"mode": "pipeline", "balance": "kl_based"}})
    placed = config.model_placement()
    assert (placed.mode, placed.cores_per_pipeline, placed.balance_mode, placed.saturates_host) == \
        ("pipeline", 4, "kl_based", True)
    assert parse_config(BASE).model_placement().pipelined is False


@pytest.mark.parametrize(("placement", "line"), [
    ({"mode": "pipeline", "cores_per_pipeline": 4},
     "  (top level): Value error, placement.cores_per_pipeline is 4 but the replica has 2 core(s); set "
     "cores_per_replica to at least 4 or lower placement.cores_per_pipeline"),
    ({"mode": "replicate", "saturate_host": False},
     "  (top level): Value error, placement.saturate_host applies to mode: pipeline; remove it or set "
     "placement.mode to pipeline"),
    ({"mode": "pipeline", "balance": "fast"},
     "  placement.balance: Input should be 'size_based', 'cost_aware', 'kl_based' or 'latency' (use one of the values listed)"),
])
def test_model_yaml_placement_errors_name_the_field(placement, line):
    with pytest.raises(ConfigError) as e:
        parse_config({**BASE, "cores_per_replica": 2, "placement": placement})
    assert str(e.value).splitlines()[1:] == [line]


def test_a_saved_pipelined_model_loads_with_its_stages_on_their_cores(traced, model, tmp_path):
    neuron_serve.save(traced, tmp_path / "four")
    loaded = neuron_serve.load(tmp_path / "four")
    assert [p.describe() for p in loaded.partitions] == [p.describe() for p in traced.partitions]
    assert loaded.pipelined and loaded.pipeline_span == 2
    x = torch.randn(4, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-5)


def test_every_shape_bucket_is_pipelined_and_answers_as_eager(model, monkeypatch):
    # 50000 bytes per core: at sequence length 2 and 4 the four layers need two cores.
    monkeypatch.setenv(CORE_MEMORY_ENV, "50000")
    spec = neuron_serve.BucketSpec.build(sizes=[2, 4], inputs={"x": 1}, outputs={0: 1}, input_names=["x"])
    traced = neuron_serve.dynamic_batch(neuron_serve.trace_buckets(model, torch.randn(2, 4, 64), spec,
                                                                   placement=PIPELINE))
    assert [[(p.name, p.core) for p in bucket] for bucket in traced.partitions] == \
        [[("accel_0", 0), ("accel_1", 1)]] * 2
    for rows, length in ((2, 1), (3, 3), (1, 4)):
        x = torch.randn(rows, length, 64)
        with torch.no_grad():
            torch.testing.assert_close(traced(x), model(x), rtol=1e-5, atol=1e-5)


def test_an_artifact_built_pipelined_is_refused_by_a_model_yaml_asking_to_replicate(traced, tmp_path):
    from neuron_serve.assembly.from_config import build  # noqa: PLC0415
    from neuron_serve.errors import ArtifactError  # noqa: PLC0415

    neuron_serve.save(traced, tmp_path / "four")
    config = parse_config({**BASE, "model": {"artifact": str(tmp_path / "four")}, "dynamic_batch": False})
    with pytest.raises(ArtifactError) as e:
        build(config)
    assert str(e.value) == (f"placement: {tmp_path / 'four'} was built pipelined over 2 core(s), but this model.yaml "
                            f"asks for placement mode replicate; rebuild the artifact from this model.yaml.")


def test_state_on_the_core_and_a_pipeline_are_refused_together(model):
    with pytest.raises(ConfigError) as e:
        neuron_serve.trace(model, torch.randn(4, 64), input_output_aliases={model.layers[0].weight: 0},
                           placement=PIPELINE)
    assert str(e.value) == ("trace(input_output_aliases=...) cannot be combined with placement mode pipeline: the "
                            "state lives on one core. Use placement mode replicate.")
