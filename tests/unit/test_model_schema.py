"""The JSON schema shipped for editors is current and accepts the examples."""

import importlib.util
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from neuron_serve.config.schema import json_schema

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_schema_is_current():
    shipped = json.loads((ROOT / "model.schema.json").read_text())
    assert shipped == json_schema(), "regenerate it: make schema"


def test_the_model_yaml_reference_in_the_repository_is_the_schemas():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = hooks.MODEL_YAML_PAGE.read_text()
    assert page == hooks.with_reference(page, json.loads((ROOT / "model.schema.json").read_text())), \
        "regenerate it: make schema"
    assert "| `max_num_seqs` |" in page.split(hooks.MODEL_YAML_BEGIN)[1]  # a generation field, read on the forge


@pytest.mark.parametrize("name", ["mlp", "encoder", "convnet", "llm"])
def test_examples_validate(name):
    jsonschema.validate(yaml.safe_load((ROOT / "deployments" / f"{name}.yaml").read_text()), json_schema())


def test_schema_rejects_a_typo():
    with pytest.raises(jsonschema.ValidationError, match="targte"):
        jsonschema.validate({"name": "x", "model": {"factory": "a:b"}, "inputs": [{"name": "x", "shape": [1]}],
                             "targte": "xla"}, json_schema())
