"""analyze(): torch-neuronx's report format, real torch-xla evidence, the cache."""

import json

import torch

import neuron_serve
from neuron_serve.analysis.placement import oracle_for
from neuron_serve.targets import get_target
from reference_models import MLP, UnsupportedModel, line_of

TOLERANCE = 1e-5


def test_report_format_for_the_app_note_mlp():
    report = neuron_serve.analyze(MLP(layers=[64, 32]).eval(), torch.rand(4, 784))
    json.dumps(report)  # serialisable as is
    assert report["support_percentage"] == "85.71%"
    assert report["supported_operators"] == {"aten": {"aten::linear": 3, "aten::relu": 2, "aten::log_softmax": 1}}
    assert report["unsupported_operators"]["aten"] == [
        {
            "kind": "aten::sort",
            "failureAt": "neuronx-cc",
            "call": f"reference_models.py {line_of('sort_out, _ = torch.sort(out)')}",
            "reason": "neuronx-cc does not support sort",
        }
    ]
    assert report["torch_version"] == torch.__version__
    assert report["torch_xla_version"] == "2.9.0"
    assert report["neuron_serve_version"] == neuron_serve.__version__
    assert report["target"] == "neuron" and report["emulated"] is True


def test_tutorial_unsupported_model_lists_fft_and_complex_mul_with_call_sites():
    report = neuron_serve.analyze(UnsupportedModel(), torch.rand(4))
    unsupported = {(e["kind"], e["call"]) for e in report["unsupported_operators"]["aten"]}
    assert unsupported == {
        ("aten::fft_fft", f"reference_models.py {line_of('y = torch.fft.fft(x)')}"),
        ("aten::mul", f"reference_models.py {line_of('return x * y')}"),
    }
    mul = next(e for e in report["unsupported_operators"]["aten"] if e["kind"] == "aten::mul")
    assert "complex" in mul["reason"] and "C64" in mul["reason"]
    assert report["supported_operators"] == {"aten": {"aten::add": 1}}
    assert report["support_percentage"] == "33.33%"


def test_tutorial_unsupported_model_traces_with_a_partitioner_config():
    model = UnsupportedModel()
    x = torch.rand(4)
    config = neuron_serve.PartitionerConfig(model_support_percentage_threshold=0.3)
    traced = neuron_serve.trace(model, x, partitioner_config=config)
    placed = {op: p.device for p in traced.partitions for op in p.op_counts}
    assert placed == {"aten::fft_fft": "cpu", "aten::mul": "cpu", "aten::add": "neuron"}
    torch.testing.assert_close(traced(x), model(x), atol=TOLERANCE, rtol=TOLERANCE)


def test_xla_target_uses_only_torch_xla_evidence():
    # torch-xla lowers sort, so only the Neuron profile keeps it off the accelerator;
    # fft has no torch-xla lowering at all, so both targets refuse it.
    assert neuron_serve.analyze(MLP(layers=[8, 8]).eval(), torch.rand(2, 784), target="xla")[
        "unsupported_operators"
    ] == {"aten": []}
    report = neuron_serve.analyze(UnsupportedModel(), torch.rand(4), target="xla")
    kinds = {e["kind"]: e["failureAt"] for e in report["unsupported_operators"]["aten"]}
    assert kinds == {"aten::fft_fft": "torch-xla lowering"}
    assert "aten::_fft_r2c" in report["unsupported_operators"]["aten"][0]["reason"]


def test_data_dependent_shapes_are_unsupported():
    class Nonzero(torch.nn.Module):
        def forward(self, x):
            return torch.nonzero(x > 0.5)

    report = neuron_serve.analyze(Nonzero(), torch.rand(4, 4))
    assert [e["kind"] for e in report["unsupported_operators"]["aten"]] == ["aten::nonzero"]


def test_identical_layers_compile_each_one_op_graph_once(fresh_cache):
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()) for _ in range(6)])
    report = neuron_serve.analyze(layers, torch.rand(2, 16), target="xla")
    assert report["supported_operators"]["aten"] == {"aten::linear": 6, "aten::relu": 6}
    assert oracle_for(get_target("xla")).stats.compiles == 2  # one linear and one relu signature, each compiled once
