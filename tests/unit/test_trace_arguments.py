"""The rest of torch-neuronx's tracing arguments: analyze_parameters, trace_kwargs,
compiler_workdir with buckets, keyword arguments passed positionally, the Neuron logger."""

import json
import logging

import pytest
import torch

import neuron_serve
from neuron_serve.errors import ConfigError


class SortMlp(torch.nn.Module):
    """The app note's model, small: aten::sort is unsupported and runs on CPU."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 8)
        self.fc2 = torch.nn.Linear(8, 4)

    def forward(self, x):
        out = torch.log_softmax(self.fc2(torch.relu(self.fc1(x))), dim=1)
        return torch.sort(out)[0]


@pytest.fixture(scope="module")
def sort_mlp():
    torch.manual_seed(0)
    return SortMlp().eval(), torch.rand(4, 16)


# --- analyze_parameters ---------------------------------------------------------------------


def test_additional_ignored_ops_leave_the_support_count(sort_mlp):
    model, x = sort_mlp
    plain = neuron_serve.analyze(model, x)
    ignored = neuron_serve.analyze(model, x, additional_ignored_ops={"aten::relu"})
    assert plain["support_percentage"] == "80.00%"  # 4 of 5: sort is not supported
    assert ignored["support_percentage"] == "75.00%"  # 3 of 4: relu not counted
    assert "aten::relu" not in ignored["supported_operators"]["aten"]


def test_ignored_unsupported_ops_pass_the_threshold_and_still_run_on_cpu(sort_mlp):
    model, x = sort_mlp
    strict = neuron_serve.PartitionerConfig(model_support_percentage_threshold=1.0)
    with pytest.raises(ValueError, match=r"found 80.00% of arithmetic operations \(4 of 5\) supported"):
        neuron_serve.trace(model, x, partitioner_config=strict)
    config = neuron_serve.PartitionerConfig(model_support_percentage_threshold=1.0,
                                            analyze_parameters={"additional_ignored_ops": {"aten::sort"}})
    traced = neuron_serve.trace(model, x, partitioner_config=config)
    assert [p.device for p in traced.partitions] == ["neuron", "cpu"]
    assert torch.allclose(traced(x), model(x), atol=1e-5)


def test_max_workers_checks_support_in_parallel_with_the_same_answer(sort_mlp, fresh_cache):
    model, x = sort_mlp
    serial = neuron_serve.analyze(model, x)
    from neuron_serve.analysis import placement  # noqa: PLC0415

    placement._ORACLES.clear()
    parallel = neuron_serve.analyze(model, x, max_workers=4)
    assert parallel == serial
    config = neuron_serve.PartitionerConfig(analyze_parameters={"max_workers": 2})
    assert torch.allclose(neuron_serve.trace(model, x, partitioner_config=config)(x), model(x), atol=1e-5)


def test_analyze_compiler_workdir_gets_the_report(sort_mlp, tmp_path):
    model, x = sort_mlp
    config = neuron_serve.PartitionerConfig(analyze_parameters={"compiler_workdir": str(tmp_path / "analyze")})
    neuron_serve.trace(model, x, partitioner_config=config)
    report = json.loads((tmp_path / "analyze" / "analyze.json").read_text())
    assert report["support_percentage"] == "80.00%"
    assert report["unsupported_operators"]["aten"][0]["kind"] == "aten::sort"
    neuron_serve.analyze(model, x, compiler_workdir=str(tmp_path / "direct"))
    assert json.loads((tmp_path / "direct" / "analyze.json").read_text()) == report


@pytest.mark.parametrize(("params", "message"), [
    ({"max_worker": 2}, "unknown key 'max_worker' (did you mean 'max_workers'?)"),
    ({"cleanup": True}, "the partitioner takes compiler_workdir, additional_ignored_ops, max_workers"),
    ({"max_workers": 0}, "['max_workers'] must be an integer >= 1"),
    ({"additional_ignored_ops": "aten::to"}, "must be a set of operator names, e.g. {'aten::to'}"),
    ({"additional_ignored_ops": {"relu"}}, "entry 'relu' has no namespace; write it as 'aten::relu'"),
    ({"compiler_workdir": 3}, "['compiler_workdir'] must be a directory path"),
])
def test_bad_analyze_parameters_are_refused(params, message):
    with pytest.raises(ConfigError) as info:
        neuron_serve.PartitionerConfig(analyze_parameters=params)
    assert message in str(info.value)


# --- trace_kwargs ---------------------------------------------------------------------------


def test_trace_kwargs_compiler_workdir_reaches_each_subgraph(sort_mlp, tmp_path):
    model, x = sort_mlp
    config = neuron_serve.PartitionerConfig(trace_kwargs={"compiler_workdir": str(tmp_path),
                                                          "compiler_args": "--optlevel 1"})
    traced = neuron_serve.trace(model, x, partitioner_config=config)
    assert "HloModule" in (tmp_path / "accel_0.hlo.txt").read_text()
    assert traced.first.report["compiler_args"]["options"] == {"--optlevel": "no effect in emulation"}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"compiler_workdr": "/tmp"}, "unknown key 'compiler_workdr' (did you mean 'compiler_workdir'?)"),
    ({"compiler_args": "--optlevl 1"}, "unknown neuronx-cc option '--optlevl'; did you mean '--optlevel'?"),
    ({"input_output_aliases": {}}, "'input_output_aliases' cannot be given per subgraph"),
    ({"partitioner_config": None}, "'partitioner_config' cannot be given per subgraph"),
])
def test_bad_trace_kwargs_are_refused(kwargs, message):
    with pytest.raises(ConfigError) as info:
        neuron_serve.PartitionerConfig(trace_kwargs=kwargs)
    assert message in str(info.value)


def test_compiler_args_given_twice_are_refused(sort_mlp):
    model, x = sort_mlp
    config = neuron_serve.PartitionerConfig(trace_kwargs={"compiler_args": "-O1"})
    with pytest.raises(ConfigError, match="given both to trace\\(\\) and in PartitionerConfig.trace_kwargs"):
        neuron_serve.trace(model, x, partitioner_config=config, compiler_args="-O2")


# --- compiler_workdir with buckets -------------------------------------------------------


def test_each_bucket_and_batch_size_writes_its_own_folder(tmp_path):
    model = torch.nn.Linear(4, 4).eval()
    spec = neuron_serve.BucketSpec.build(sizes=[2, 4], inputs={"x": 1}, input_names=["x"])
    x = torch.rand(2, 3, 4)
    neuron_serve.trace_buckets(model, x, spec, compiler_workdir=str(tmp_path / "buckets"), batch_sizes=[1, 2])
    written = sorted(str(p.relative_to(tmp_path / "buckets")) for p in (tmp_path / "buckets").rglob("*.hlo.txt"))
    assert written == ["bucket_0/batch_1/accel_0.hlo.txt", "bucket_0/batch_2/accel_0.hlo.txt",
                       "bucket_1/batch_1/accel_0.hlo.txt", "bucket_1/batch_2/accel_0.hlo.txt"]
    # Each holds its own shape: bucket 1 at batch 2 is f32[2,4,4].
    assert "f32[2,4,4]" in (tmp_path / "buckets" / "bucket_1" / "batch_2" / "accel_0.hlo.txt").read_text()

    def model_fn():
        return model, {}

    config = neuron_serve.BucketModelConfig(lambda: (lambda inputs: (inputs, torch.tensor(0))))
    neuron_serve.bucket_model_trace(model_fn, [torch.rand(1, 4), torch.rand(3, 4)], config, str(tmp_path / "bmt"))
    assert "f32[3,4]" in (tmp_path / "bmt" / "bucket_1" / "accel_0.hlo.txt").read_text()
    assert "f32[1,4]" in (tmp_path / "bmt" / "bucket_0" / "accel_0.hlo.txt").read_text()


# --- keyword arguments passed positionally ---------------------------------------------------


def test_positional_keywords_warn_and_are_inferred_in_the_reference_order(sort_mlp, tmp_path):
    model, x = sort_mlp
    config = neuron_serve.PartitionerConfig()
    with pytest.warns(DeprecationWarning, match="passing keyword arguments as positional arguments is deprecated"):
        traced = neuron_serve.trace(model, x, {}, str(tmp_path), "--optlevel 2", config)
    assert (tmp_path / "accel_0.hlo.txt").exists()  # compiler_workdir
    assert traced.first.report["compiler_args"]["argv"] == ["--optlevel", "2"]  # compiler_args
    assert [p.device for p in traced.partitions] == ["neuron", "cpu"]  # partitioner_config
    assert torch.allclose(traced(x), model(x), atol=1e-5)


def test_positional_and_keyword_twice_is_refused(sort_mlp):
    model, x = sort_mlp
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="compiler_workdir given both"):
        neuron_serve.trace(model, x, {}, "/tmp/a", compiler_workdir="/tmp/b")
    with pytest.raises(ConfigError, match="at most 5 inferred keyword arguments"):
        neuron_serve.trace(model, x, {}, None, None, None, True, 7)


# --- the Neuron logger -------------------------------------------------------------------------


def test_the_app_notes_neuron_logger_shows_the_partitioner_lines(sort_mlp, caplog):
    model, x = sort_mlp
    logger = logging.getLogger("Neuron")  # configured as the graph partitioner app note does
    previous = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(caplog.handler)  # the Neuron logger prints itself and does not propagate
    try:
        neuron_serve.trace(model, x, partitioner_config=neuron_serve.PartitionerConfig())
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(previous)
    lines = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.name == "Neuron"]
    assert lines[:2] == ["Neuron: The following operations are currently supported:", "Neuron: aten::linear"]
    assert "Neuron: aten::sort, " in "\n".join(lines)
    assert "Neuron: 80.00% of arithmetic operations (4 of 5) are supported" in lines
    assert "Neuron: Num Partitions: 2" in lines
    assert "Neuron: Creating Partition #2 for device: Device.CPU" in lines
    assert "Neuron: aten::sort:1" in lines


def test_the_neuron_logger_prints_in_the_app_notes_format(sort_mlp, tmp_path):
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    script = (
        "import logging, torch, neuron_serve\n"
        "logging.getLogger('Neuron').setLevel(logging.INFO)\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()\n"
        "neuron_serve.trace(m, torch.rand(2, 4), partitioner_config=neuron_serve.PartitionerConfig())\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert "Neuron: Num Partitions: 1\n" in run.stderr
    assert "INFO:Neuron" not in run.stderr  # printed once, in the app note's format
    assert "Neuron: Creating Partition #1 for device: Device.NEURON\n" in run.stderr


def test_a_root_level_alone_does_not_print_the_neuron_lines_twice(tmp_path):
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    script = (
        "import logging, torch, neuron_serve\n"
        "logging.basicConfig(level=logging.INFO, format='%(name)s| %(message)s')\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()\n"
        "neuron_serve.trace(m, torch.rand(2, 4), partitioner_config=neuron_serve.PartitionerConfig())\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert run.stderr.count("Num Partitions: 1") == 1
    assert "neuron_serve| Num Partitions: 1" in run.stderr
