"""The JSON schema shipped for editors is current and accepts the examples."""

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from neuron_serve.config import json_schema

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_schema_is_current():
    shipped = json.loads((ROOT / "model.schema.json").read_text())
    assert shipped == json_schema(), "regenerate: python -c 'from neuron_serve.config import json_schema' (see docs/reference/model-yaml.md)"


@pytest.mark.parametrize("name", ["mlp", "encoder", "convnet", "llm"])
def test_examples_validate(name):
    jsonschema.validate(yaml.safe_load((ROOT / "deployments" / f"{name}.yaml").read_text()), json_schema())


def test_schema_rejects_a_typo():
    with pytest.raises(jsonschema.ValidationError, match="targte"):
        jsonschema.validate({"name": "x", "model": {"factory": "a:b"}, "inputs": [{"name": "x", "shape": [1]}],
                             "targte": "xla"}, json_schema())
