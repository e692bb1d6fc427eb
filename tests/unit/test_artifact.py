"""save() / load(): self-contained artifacts, equal outputs, and refusals that say what to rebuild."""

import hashlib
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import List, Tuple

import pytest
import torch

import neuron_serve
from example_models import encoder
from neuron_serve.errors import ArtifactError
from neuron_serve.targets.pjrt import versions
from reference_models import MLP

TOLERANCE = 1e-4  # traced vs eager (XLA:CPU reassociates float sums)
SAME = 1e-6  # loaded vs the saved module: the same graphs compiled the same way


@pytest.fixture(scope="module")
def saved_mlp(tmp_path_factory):
    """The app note's MLP, partitioned (sort on CPU), with dynamic batch, saved."""
    torch.manual_seed(0)
    model = MLP().eval()
    traced = neuron_serve.dynamic_batch(
        neuron_serve.trace(model, torch.rand(8, 784), partitioner_config=neuron_serve.PartitionerConfig())
    )
    path = neuron_serve.save(traced, tmp_path_factory.mktemp("artifact") / "mlp")
    return model, traced, path


def test_loaded_mlp_equals_the_saved_one_and_keeps_its_plan(saved_mlp):
    model, traced, path = saved_mlp
    loaded = neuron_serve.load(path)
    assert loaded.partition_devices == traced.partition_devices == ["neuron", "cpu"]
    assert [p.op_counts for p in loaded.partitions] == [p.op_counts for p in traced.partitions]
    assert loaded.dynamic_batch_enabled and loaded.report == traced.report
    for rows in (1, 8, 21):
        x = torch.rand(rows, 784)
        torch.testing.assert_close(loaded(x), traced(x), atol=SAME, rtol=SAME)
        torch.testing.assert_close(loaded(x), model(x), atol=TOLERANCE, rtol=TOLERANCE)


def test_a_fresh_process_loads_it_without_the_model_class_or_pickle(saved_mlp, tmp_path):
    model, _, path = saved_mlp
    x = torch.rand(5, 784)
    torch.save(x, tmp_path / "x.pt")
    script = (
        "import sys, torch, neuron_serve\n"
        "assert 'reference_models' not in sys.modules\n"
        f"m = neuron_serve.load({str(path)!r})\n"
        f"x = torch.load({str(tmp_path / 'x.pt')!r}, weights_only=True)\n"
        f"torch.save(m(x), {str(tmp_path / 'y.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True, capture_output=True,
                   env={"PATH": "/usr/bin:/bin", "PJRT_DEVICE": "CPU", "PYTHONWARNINGS": "ignore"})
    y = torch.load(tmp_path / "y.pt", weights_only=True)
    torch.testing.assert_close(y, model(x), atol=TOLERANCE, rtol=TOLERANCE)
    for pt2 in path.rglob("*.pt2"):  # raw tensor bytes only; nothing that unpickles
        with zipfile.ZipFile(pt2) as archive:
            configs = [json.loads(archive.read(n)) for n in archive.namelist() if n.endswith("_config.json")]
            samples = [archive.getinfo(n).file_size for n in archive.namelist() if "/sample_inputs/" in n]
        assert "use_pickle\": true" not in json.dumps(configs) and samples == [0]


def test_artifact_holds_the_lowered_hlo_of_each_accelerator_partition(saved_mlp):
    _, _, path = saved_mlp
    manifest = json.loads((path / "manifest.json").read_text())
    hlo = (path / manifest["buckets"][0]["modules"]["accel_0"]["hlo"]).read_text()
    # fc1.weight (4096x784) as the compiled program reads it: transposed once, at load
    assert hlo.startswith("HloModule") and "f32[784,4096]" in hlo
    assert manifest["versions"]["torch_version"] == torch.__version__
    assert set(manifest["files"]) >= {"bucket_0/accel_0.pt2", "bucket_0/cpu_0.pt2", "bucket_0/accel_0.hlo.txt"}


def _copy(path: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(path, tmp_path / "copy"))


def test_a_corrupted_file_is_refused_naming_it(saved_mlp, tmp_path):
    path = _copy(saved_mlp[2], tmp_path)
    data = bytearray((path / "bucket_0/cpu_0.pt2").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "bucket_0/cpu_0.pt2").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=rf"^artifact {path}: bucket_0/cpu_0.pt2 is corrupt \(SHA-256 mismatch\)\. "
                                            rf"Rebuild it: neuron-serve build model.yaml -o {path}$"):
        neuron_serve.load(path)


def test_a_truncated_file_and_an_edited_manifest_are_refused(saved_mlp, tmp_path):
    path = _copy(saved_mlp[2], tmp_path)
    (path / "bucket_0/accel_0.pt2").write_bytes((path / "bucket_0/accel_0.pt2").read_bytes()[:1000])
    with pytest.raises(ArtifactError, match="bucket_0/accel_0.pt2 is corrupt"):
        neuron_serve.load(path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["buckets"][0]["partitions"][0]["device"] = "cpu"
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"manifest.json is corrupt or was edited \(SHA-256 check failed\)"):
        neuron_serve.load(path)


def test_an_artifact_from_other_versions_is_refused_with_the_rebuild_command(saved_mlp, tmp_path):
    path = _copy(saved_mlp[2], tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["versions"]["torch_xla_version"] = "2.8.0"
    text = json.dumps(manifest)
    (path / "manifest.json").write_text(text)
    (path / "manifest.sha256").write_text(hashlib.sha256(text.encode()).hexdigest())
    here = versions()["torch_xla_version"]
    with pytest.raises(ArtifactError, match=rf"was built with torch_xla 2.8.0 \(this is {re.escape(here)}\); compiled "
                                            "models do not carry over between versions. Rebuild it: neuron-serve "
                                            "build model.yaml -o"):
        neuron_serve.load(path)


def test_a_directory_that_is_no_artifact_is_refused(tmp_path):
    with pytest.raises(ArtifactError, match="is not a neuron-serve artifact: it has no manifest.json"):
        neuron_serve.load(tmp_path)


def test_buckets_and_dynamic_batch_round_trip_on_an_encoder(tmp_path):
    model = encoder.build(layers=1, hidden=32, heads=2, vocab=64)
    example = (torch.randint(0, 64, (2, 16)), torch.ones(2, 16, dtype=torch.int64))
    spec = neuron_serve.BucketSpec.build(sizes=[16, 32], inputs={0: 1, 1: 1}, outputs={0: 1})
    bucketed = neuron_serve.dynamic_batch(neuron_serve.trace_buckets(
        model, example, spec, partitioner_config=neuron_serve.PartitionerConfig(ops_to_partition={"aten::gelu"})))
    loaded = neuron_serve.load(neuron_serve.save(bucketed, tmp_path / "encoder"))
    assert [len(b.partitions) for b in loaded.buckets] == [3, 3]
    for batch, length in [(1, 5), (3, 20)]:
        ids, mask = torch.randint(0, 64, (batch, length)), torch.ones(batch, length, dtype=torch.int64)
        out, ref = loaded(ids, mask), model(ids, mask)
        assert type(out) is type(ref) and out.last_hidden_state.shape == (batch, length, 32)
        torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=TOLERANCE, rtol=TOLERANCE)
    with pytest.raises(ValueError, match="larger than the largest bucket"):
        loaded(torch.zeros(1, 40, dtype=torch.int64), torch.ones(1, 40, dtype=torch.int64))


class _Doubler(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) * 2


@torch.jit.script
def _script_kernel(inputs: List[torch.Tensor]) -> Tuple[List[torch.Tensor], torch.Tensor]:
    x = inputs[0]
    size = 2 if x.shape[0] <= 2 else 8
    return [torch.nn.functional.pad(x, [0, 0, 0, size - x.shape[0]])], torch.tensor(0 if size == 2 else 1)


def test_a_torchscript_bucket_kernel_is_saved_and_a_python_one_refused(tmp_path):
    model = _Doubler().eval()
    examples = [torch.rand(2, 4), torch.rand(8, 4)]
    scripted = neuron_serve.bucket_model_trace(lambda: (model, {}), examples,
                                               neuron_serve.BucketModelConfig(lambda: _script_kernel))
    loaded = neuron_serve.load(neuron_serve.save(scripted, tmp_path / "scripted"))
    x = torch.rand(5, 4)
    torch.testing.assert_close(loaded(x)[:5], model(x), atol=TOLERANCE, rtol=TOLERANCE)
    python = neuron_serve.bucket_model_trace(lambda: (model, {}), examples,
                                             neuron_serve.BucketModelConfig(lambda: lambda inputs: (inputs, 0)))
    with pytest.raises(ArtifactError, match="bucket kernel is a plain Python function, which cannot be saved"):
        neuron_serve.save(python, tmp_path / "python")
