"""compiler_args: neuronx-cc's options parsed, --auto-cast reproduced, the rest recorded."""

import json

import pytest
import torch

import neuron_serve
from neuron_serve.analysis import placement
from neuron_serve.config.compiler_args import NO_EFFECT, parse_compiler_args
from neuron_serve.config.schema import parse_config
from neuron_serve.errors import ConfigError

AUTO_CAST = "--auto-cast matmult --auto-cast-type bf16"


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 64)
        self.fc2 = torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    return Mlp().eval(), torch.rand(8, 64) * 4


@pytest.fixture(scope="module")
def auto_cast_traced(mlp):
    model, x = mlp
    return neuron_serve.trace(model, x, compiler_args=AUTO_CAST + " --optlevel 3")


def test_bf16_auto_cast_shows_bf16_precision(mlp, auto_cast_traced):
    model, x = mlp
    eager = model(x)
    eager_bf16 = model.to(torch.bfloat16)(x.to(torch.bfloat16)).float()
    model.float()
    out = auto_cast_traced(x)
    # Off fp32 eager by a bf16-sized amount (bf16 keeps 8 bits: ~0.4% relative) ...
    error = ((out - eager).abs().max() / eager.abs().max()).item()
    assert 1e-4 < error < 1e-2
    # ... and equal to eager in bf16 up to one bf16 rounding of the result.
    assert torch.allclose(out, eager_bf16, rtol=8e-3, atol=1e-3)


def test_without_auto_cast_the_trace_equals_fp32_eager(mlp):
    model, x = mlp
    traced = neuron_serve.trace(model, x, compiler_args=["--auto-cast", "none", "--model-type", "transformer"])
    assert torch.allclose(traced(x), model(x), atol=1e-5)


def test_auto_cast_all_casts_every_fp32_operator():
    conv = torch.nn.Conv2d(3, 4, 3).eval()
    x = torch.rand(1, 3, 8, 8)

    def model(t):
        return conv(t).exp()  # a convolution (matmult) and exp (cast under 'all' only)

    matmult = neuron_serve.trace(model, x, compiler_args="--auto-cast matmult --auto-cast-type fp16")(x)
    every = neuron_serve.trace(model, x, compiler_args="--auto-cast=all --auto-cast-type=fp16")(x)
    assert torch.allclose(matmult, model(x), rtol=5e-3) and not torch.equal(matmult, model(x))
    # Only under 'all' is exp's result rounded to fp16 as well: then every value is an fp16 value.
    assert torch.equal(every, every.half().float())
    assert not torch.equal(matmult, matmult.half().float())


def test_options_are_recorded_with_no_effect_in_emulation(auto_cast_traced, tmp_path):
    recorded = auto_cast_traced.first.report["compiler_args"]
    assert recorded["argv"] == ["--auto-cast", "matmult", "--auto-cast-type", "bf16", "--optlevel", "3"]
    assert recorded["options"]["--optlevel"] == "no effect in emulation"
    assert recorded["options"]["--auto-cast"].startswith("emulated")
    neuron_serve.save(auto_cast_traced, tmp_path / "art")
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    module = manifest["buckets"][0]["modules"]["accel_0"]
    assert module["compiler_args"]["options"]["--optlevel"] == NO_EFFECT
    loaded = neuron_serve.load(tmp_path / "art")
    x = torch.rand(8, 64) * 4
    assert torch.equal(loaded(x), auto_cast_traced(x))  # the casts travel with the graph


@pytest.mark.parametrize(("args", "message"), [
    ("--autocast matmult", "unknown neuronx-cc option '--autocast'; did you mean '--auto-cast'?"),
    ("--auto-cast matmul", "invalid value 'matmul' for --auto-cast; did you mean 'matmult'?"),
    ("--auto-cast-type bf61", "invalid value 'bf61' for --auto-cast-type; did you mean 'bf16'?"),
    ("-O4", "invalid value '4' for --optlevel."),
    ("--target", "--target needs a value (one of inf2, trn1, trn1n, trn2)"),
    ("--enable-saturate-infinity=yes", "--enable-saturate-infinity is a flag and takes no value"),
    ("--fast-math none", "'--fast-math' is an option of neuron-cc (Inf1), not of neuronx-cc; use '--auto-cast'"),
    ("--auto-cast 'all", "cannot split"),
    (5, "must be a string or a list of strings"),
])
def test_bad_flags_are_refused_naming_the_closest(args, message):
    with pytest.raises(ConfigError) as info:
        parse_compiler_args(args)
    assert message in str(info.value)


def test_trace_refuses_a_bad_flag_before_compiling(mlp):
    model, x = mlp
    with pytest.raises(ConfigError, match=r"trace\(compiler_args=...\): unknown neuronx-cc option '--optlvl'; "
                                          r"did you mean '--optlevel'\?"):
        neuron_serve.trace(model, x, compiler_args=["--optlvl", "2"])


def test_spellings_parse_alike():
    a = parse_compiler_args(["--optlevel=2", "--auto-cast all", "-lnc", "2", "--verbose", "info"])
    b = parse_compiler_args("-O2 --auto-cast=all --logical-nc-config 2 --verbose=info")
    assert a.cache_key() == b.cache_key()
    assert a.values["--optlevel"] == "2" and a.values["--logical-nc-config"] == "2"


def test_what_emulation_does_with_each_auto_cast_option():
    alone = parse_compiler_args("--auto-cast-type fp16")  # neuronx-cc's default mode, matmult
    assert (alone.auto_cast, alone.cast_dtype) == ("matmult", "float16")
    assert parse_compiler_args("--auto-cast none --auto-cast-type bf16").emulation() == {
        "--auto-cast": "emulated: operators keep the model's dtypes", "--auto-cast-type": NO_EFFECT}
    assert parse_compiler_args("--auto-cast all --auto-cast-type tf32").cast_dtype is None  # XLA:CPU is full fp32
    assert parse_compiler_args(None).cast_dtype is None


def test_compiler_args_key_the_support_cache(fresh_cache):
    model = torch.nn.Linear(4, 4).eval()
    x = torch.rand(2, 4)
    neuron_serve.trace(model, x)
    misses = fresh_cache.stats["support"].misses
    placement._ORACLES.clear()
    neuron_serve.trace(model, x, compiler_args="--optlevel 1")
    assert fresh_cache.stats["support"].misses > misses  # other flags: decided again
    placement._ORACLES.clear()
    before = fresh_cache.stats["support"].hits
    neuron_serve.trace(model, x, compiler_args="-O1")
    assert fresh_cache.stats["support"].hits > before  # the same flags, spelt otherwise: reused


def test_bucket_apis_and_trace_kwargs_take_compiler_args():
    x = torch.rand(2, 4) * 4

    def model_fn():
        torch.manual_seed(3)
        return torch.nn.Linear(4, 4).eval(), {}

    config = neuron_serve.BucketModelConfig(lambda: (lambda inputs: (inputs, torch.tensor(0))))
    bucketed = neuron_serve.bucket_model_trace(model_fn, [x], config, None, AUTO_CAST)
    eager = model_fn()[0]
    expected = torch.nn.functional.linear(x.bfloat16().float(), eager.weight.bfloat16().float(),
                                          eager.bias.bfloat16().float()).bfloat16().float()
    assert torch.allclose(bucketed(x), expected, atol=1e-6)
    partitioned = neuron_serve.trace(eager, x, partitioner_config=neuron_serve.PartitionerConfig(
        trace_kwargs={"compiler_args": AUTO_CAST}))
    assert torch.allclose(partitioned(x), expected, atol=1e-6)
    spec = neuron_serve.BucketSpec.build(sizes=[4], inputs={"x": 1}, input_names=["x"])
    declared = neuron_serve.trace_buckets(eager, x, spec, compiler_args=AUTO_CAST)
    assert torch.allclose(declared(x), expected, atol=1e-6)


def test_model_yaml_takes_compiler_args():
    base = {"name": "m", "model": {"factory": "a:b"}, "inputs": [{"name": "x", "shape": [1, 4]}]}
    assert parse_config({**base, "compiler_args": AUTO_CAST}).compiler_args == AUTO_CAST
    with pytest.raises(ConfigError, match="compiler_args.*did you mean '--auto-cast-type'"):
        parse_config({**base, "compiler_args": ["--auto-cast-typ", "bf16"]})


def test_model_yaml_compiler_args_reach_the_build_and_the_partition_report():
    from neuron_serve.analysis.capture import capture  # noqa: PLC0415
    from neuron_serve.analysis.placement import analyze_graph  # noqa: PLC0415
    from neuron_serve.assembly.from_config import build  # noqa: PLC0415
    from neuron_serve.config.factory import build_model  # noqa: PLC0415
    from neuron_serve.report import partition_report  # noqa: PLC0415
    from neuron_serve.report.html import render  # noqa: PLC0415
    from neuron_serve.targets import get_target  # noqa: PLC0415

    config = parse_config({
        "name": "mlp", "model": {"factory": "example_models.mlp:build",
                                 "kwargs": {"input_size": 16, "output_size": 4, "layers": [8, 8]}},
        "inputs": [{"name": "x", "shape": [2, 16]}], "partitioner": {}, "dynamic_batch": False,
        "compiler_args": "--auto-cast matmult -O1",
    })
    built = build(config)
    assert built.first.report["compiler_args"]["argv"] == ["--auto-cast", "matmult", "--optlevel", "1"]
    model = build_model(config)
    x = config.example_inputs()
    assert not torch.equal(built(*x), model(*x)) and torch.allclose(built(*x), model(*x), atol=2e-2)
    captured = capture(model, x)
    data = partition_report.build(config, model, captured, analyze_graph(captured, get_target("neuron")))
    assert data["compiler_args"]["options"]["--optlevel"] == NO_EFFECT
    assert "<code>--optlevel</code> no effect in emulation" in render(data)
