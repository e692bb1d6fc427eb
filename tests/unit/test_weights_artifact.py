"""Weight-separated models as artifacts and in model.yaml: weights apart from the graph, new checkpoints
served without compiling, and a checkpoint that does not fit refused naming the weight."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import pytest
import torch

import neuron_serve
from neuron_serve.errors import ArtifactError
from neuron_serve.assembly.from_config import build, check_weights
from neuron_serve.compile.subgraph import compile_count
from neuron_serve.config.schema import parse_config
from neuron_serve.assembly.weights import is_weight_separated
from test_weights import ATOL, Net, X

from example_models import mlp  # deployments/, on the path of every test (tests/conftest.py)

SMALL = {"input_size": 16, "output_size": 4, "layers": [8, 8]}


def _mlp(seed: int) -> torch.nn.Module:
    return mlp.build(**SMALL, seed=seed).eval()


def _config(**fields) -> dict:
    return {"name": "mlp", "inputs": [{"name": "x", "shape": [2, 16]}], "partitioner": {}, "dynamic_batch": False,
            **fields}


FACTORY = {"factory": "example_models.mlp:build", "kwargs": SMALL}
XM = torch.rand(2, 16, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Net(0) with relu and the scale's mul forced to CPU (CPU partitions with and without a weight), traced
    weight-separated and saved."""
    config = neuron_serve.PartitionerConfig(ops_to_partition={"aten::relu", "aten::mul"})
    traced = neuron_serve.trace(Net(0).eval(), X, partitioner_config=config, inline_weights_to_neff=False)
    path = tmp_path_factory.mktemp("separated") / "net"
    neuron_serve.save(traced, path)
    return path


def test_artifact_stores_weights_apart_from_the_graphs(saved):
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["weights"] == "weights.pt"
    stored = torch.load(saved / "weights.pt", weights_only=True)
    assert stored.keys() == Net(0).state_dict().keys()
    for name, tensor in Net(0).state_dict().items():
        assert torch.equal(stored[name], tensor), name
    accelerator = {n: m for n, m in manifest["buckets"][0]["modules"].items() if m["compiled"]}
    assert len(accelerator) == 2  # relu on CPU splits the linear layers
    for part in accelerator.values():
        # The compiled graph's program takes its weights as inputs: no tensor data inside it.
        program = torch.export.load(str(saved / part["file"]))
        assert program.state_dict == {} and program.constants == {}
        assert part["weights"] and set(part["weights"]) <= set(stored)
        with zipfile.ZipFile(saved / part["file"]) as archive:
            assert not [m for m in archive.namelist() if "/data/weights/" in m and not m.endswith(".json")]


def test_loaded_artifact_equals_eager_and_takes_a_new_checkpoint_without_compiling(saved):
    loaded = neuron_serve.load(saved)
    torch.testing.assert_close(loaded(X), Net(0).eval()(X), atol=ATOL, rtol=0)
    assert is_weight_separated(loaded)
    before = compile_count()
    neuron_serve.replace_weights(loaded, Net(1).eval().state_dict())
    assert compile_count() == before
    torch.testing.assert_close(loaded(X), Net(1).eval()(X), atol=ATOL, rtol=0)
    with pytest.raises(neuron_serve.ConfigError, match=re.escape(
            "replace_weights: weight 'a.weight' has shape (8, 5); the traced model has (8, 4).")):
        neuron_serve.replace_weights(loaded, {**Net(1).state_dict(), "a.weight": torch.zeros(8, 5)})


def test_an_edited_weights_file_is_refused(saved, tmp_path):
    import shutil

    copy = tmp_path / "net"
    shutil.copytree(saved, copy)
    torch.save({**Net(1).state_dict()}, copy / "weights.pt")
    with pytest.raises(ArtifactError, match=r"weights\.pt is corrupt \(SHA-256 mismatch\)"):
        neuron_serve.load(copy)


# --- model.yaml: inline_weights_to_neff, weights ----------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoints")
    torch.save(_mlp(1).state_dict(), folder / "second.pt")
    state = _mlp(1).state_dict()
    state["fc9.weight"] = state.pop("fc2.weight")
    torch.save(state, folder / "renamed.pt")
    torch.save({**_mlp(1).state_dict(), "fc2.weight": torch.zeros(8, 9)}, folder / "reshaped.pt")
    torch.save({**_mlp(1).state_dict(), "fc3.bias": torch.zeros(4, dtype=torch.float64)}, folder / "retyped.pt")
    torch.save([1, 2], folder / "list.pt")
    return folder


@pytest.fixture(scope="module")
def built_artifact(tmp_path_factory):
    """`neuron-serve build` of the small MLP with inline_weights_to_neff: false (and a CPU sort)."""
    config = parse_config(_config(model=FACTORY, inline_weights_to_neff=False))
    built = build(config)
    assert built.build_info.compiles == 1  # one accelerator subgraph, one batch size
    path = tmp_path_factory.mktemp("artifact") / "mlp"
    served = config.model_dump(mode="json", exclude_none=True)
    neuron_serve.save(built, path, config={**served, "model": {"artifact": "."}})
    return path


def test_model_yaml_weights_swap_a_checkpoint_into_a_factory_model(checkpoints):
    config = parse_config(_config(model=FACTORY, inline_weights_to_neff=False, weights="second.pt"))
    built = build(config, checkpoints)  # 'weights' is relative to the model.yaml's folder
    torch.testing.assert_close(built(XM), _mlp(1)(XM), atol=ATOL, rtol=0)
    assert built.build_info.weights == str(checkpoints / "second.pt")
    assert built.build_info.compiles == 1  # the trace's; the swap adds none


def test_neuron_serve_build_saves_the_swapped_in_checkpoint(checkpoints, tmp_path):
    import yaml

    from neuron_serve.cli import main

    config = tmp_path / "mlp.yaml"
    config.write_text(yaml.safe_dump(_config(model=FACTORY, inline_weights_to_neff=False,
                                             weights=str(checkpoints / "second.pt"))))
    assert main(["build", str(config), "-o", str(tmp_path / "out")]) == 0
    served = yaml.safe_load((tmp_path / "out" / "model.yaml").read_text())
    assert served["inline_weights_to_neff"] is False and "weights" not in served  # weights.pt holds them now
    torch.testing.assert_close(neuron_serve.load(tmp_path / "out")(XM), _mlp(1)(XM), atol=ATOL, rtol=0)


def test_model_yaml_weights_serve_a_new_checkpoint_of_an_artifact_without_compiling(built_artifact, checkpoints):
    base = _config(model={"artifact": str(built_artifact)})
    plain = build(parse_config(base))
    torch.testing.assert_close(plain(XM), _mlp(0)(XM), atol=ATOL, rtol=0)
    swapped = build(parse_config({**base, "weights": str(checkpoints / "second.pt")}))
    torch.testing.assert_close(swapped(XM), _mlp(1)(XM), atol=ATOL, rtol=0)
    # Loading the artifact compiles its one subgraph (emulation cannot load executables); the checkpoint adds none.
    assert swapped.build_info.compiles == plain.build_info.compiles == 1


@pytest.mark.parametrize("file, problem", [
    ("renamed.pt", "the state dict does not match the traced model: missing weight(s) fc2.weight; unexpected "
                   "weight(s) fc9.weight. It must hold exactly the weights of the traced architecture."),
    ("reshaped.pt", "weight 'fc2.weight' has shape (8, 9); the traced model has (8, 8)."),
    ("retyped.pt", "weight 'fc3.bias' has dtype torch.float64; the traced model has torch.float32."),
])
def test_a_checkpoint_that_does_not_fit_is_refused_naming_the_weight(built_artifact, checkpoints, file, problem):
    path = checkpoints / file
    expected = (f"weights: {path}: {problem} Give a checkpoint of the served architecture "
                "(torch.save(model.state_dict(), path) of the same model class and config), or remove 'weights' "
                "to serve the model's own.")
    artifact_config = parse_config(_config(model={"artifact": str(built_artifact)}, weights=str(path)))
    before = compile_count()
    with pytest.raises(neuron_serve.ConfigError) as err:
        check_weights(artifact_config, None)  # what deploy runs before starting anything
    assert str(err.value) == expected
    with pytest.raises(neuron_serve.ConfigError) as err:
        build(artifact_config)
    assert str(err.value) == expected
    assert compile_count() == before  # refused before the artifact's subgraphs compile
    with pytest.raises(neuron_serve.ConfigError) as err:
        build(parse_config(_config(model=FACTORY, inline_weights_to_neff=False, weights=str(path))))
    assert str(err.value) == expected


def test_weights_that_are_no_state_dict_are_refused(built_artifact, checkpoints):
    for name, message in [
        ("list.pt", f"weights: {checkpoints / 'list.pt'} holds a list, not a dict of tensors; save it with "
                    "torch.save(model.state_dict(), path)."),
        ("missing.pt", f"weights: no such file {checkpoints / 'missing.pt'}; give the path of a state dict saved "
                       "with torch.save(model.state_dict(), path)."),
    ]:
        config = parse_config(_config(model={"artifact": str(built_artifact)}, weights=name))
        with pytest.raises(neuron_serve.ConfigError) as err:
            check_weights(config, checkpoints)
        assert str(err.value) == message


def test_weights_need_a_weight_separated_model(checkpoints, tmp_path):
    with pytest.raises(neuron_serve.ConfigError, match=re.escape(
            "  (top level): Value error, weights: a checkpoint can only be swapped into a weight-separated model; "
            "set inline_weights_to_neff: false (or serve an artifact built with it)")):
        parse_config(_config(model=FACTORY, weights="second.pt"))
    inline = build(parse_config(_config(model=FACTORY)))
    neuron_serve.save(inline, tmp_path / "inline")
    config = parse_config(_config(model={"artifact": str(tmp_path / "inline")}, weights=str(checkpoints / "second.pt")))
    with pytest.raises(neuron_serve.ConfigError, match=re.escape(
            f"weights: {tmp_path / 'inline'} was built with its weights inside its executables, so "
            f"{checkpoints / 'second.pt'} cannot be swapped in; build it from a model.yaml with "
            "inline_weights_to_neff: false.")):
        build(config)
    with pytest.raises(ArtifactError, match=re.escape(
            f"inline_weights_to_neff: {tmp_path / 'inline'} was built with its weights inside "
            "(inline_weights_to_neff: true) its executables, but this model.yaml says otherwise; remove the field or "
            "rebuild the artifact.")):
        build(parse_config(_config(model={"artifact": str(tmp_path / "inline")}, inline_weights_to_neff=False)))


# --- model.yaml: partitioner.trace_kwargs and analyze_parameters --------------------


def test_model_yaml_partitioner_trace_kwargs_and_analyze_parameters_reach_the_trace(tmp_path):
    config = parse_config(_config(model=FACTORY, partitioner={
        "trace_kwargs": {"compiler_workdir": "hlo", "compiler_args": "--auto-cast matmult"},
        "analyze_parameters": {"compiler_workdir": "analysis", "additional_ignored_ops": ["aten::relu"],
                               "max_workers": 2},
    }))
    built = build(config, tmp_path)  # folders are relative to the model.yaml's
    assert (tmp_path / "hlo" / "accel_0.hlo.txt").read_text().startswith("HloModule")
    report = json.loads((tmp_path / "analysis" / "analyze.json").read_text())
    assert "aten::relu" not in report["supported_operators"]["aten"]
    assert report["supported_operators"]["aten"]["aten::linear"] == 3
    assert built.first.report["compiler_args"]["argv"] == ["--auto-cast", "matmult"]
    # --auto-cast matmult (bf16) shows in the outputs: close to eager, not equal.
    out, eager = built(XM), _mlp(0)(XM)
    assert not torch.equal(out, eager) and torch.allclose(out, eager, atol=2e-2)


@pytest.mark.parametrize("partitioner, message", [
    ({"trace_kwargs": {"compiler_arg": "-O1"}},
     "partitioner.trace_kwargs.compiler_arg: Extra inputs are not permitted (remove it or check its spelling)"),
    ({"trace_kwargs": {"compiler_args": "--autocast matmult"}},
     "partitioner.trace_kwargs.compiler_args: Value error, neuronx-cc arguments: unknown neuronx-cc option "
     "'--autocast'; did you mean '--auto-cast'?"),
    ({"analyze_parameters": {"max_workers": 0}},
     "partitioner.analyze_parameters.max_workers: Input should be greater than or equal to 1"),
    ({"analyze_parameters": {"additional_ignored_ops": ["relu"]}},
     "PartitionerConfig.analyze_parameters['additional_ignored_ops'] entry 'relu' has no namespace; write it as "
     "'aten::relu'."),
])
def test_bad_partitioner_kwargs_in_model_yaml_name_the_field(partitioner, message):
    with pytest.raises(neuron_serve.ConfigError) as err:
        parse_config(_config(model=FACTORY, partitioner=partitioner))
    assert message in str(err.value)


def test_compiler_args_given_twice_in_model_yaml_is_refused():
    with pytest.raises(neuron_serve.ConfigError, match=re.escape(
            "compiler_args is given both at the top level and in partitioner.trace_kwargs; give it once")):
        parse_config(_config(model=FACTORY, compiler_args="-O1", partitioner={"trace_kwargs": {"compiler_args": "-O2"}}))
