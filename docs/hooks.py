"""MkDocs hooks: the pages written from the code, so they cannot drift from it.

- docs/reference/model-yaml.md holds a table of every model.yaml field, written into the
  file (so the repository shows it too) from ``model.schema.json`` by ``python docs/hooks.py``
  (``make schema`` regenerates both): the JSON schema of neuron_serve/config/schema.py's pydantic
  models, which tests/unit/test_model_schema.py keeps equal to ``json_schema()``, and the
  table to the schema.
- ``<!-- readme -->`` (docs/index.md) becomes README.md, its links into docs/ made relative
  to the site, so the front page and the README are one text.
- ``<!-- python-api -->`` (docs/reference/api.md) becomes one mkdocstrings entry per public
  name of ``neuron_serve`` (its ``_PUBLIC`` table, read with ``ast``), each documented where
  it is defined.

Neither imports neuron_serve (nor torch): the schema is read as JSON, the package as source.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "model.schema.json"
PACKAGE_INIT = ROOT / "neuron_serve" / "__init__.py"
MODEL_YAML_PAGE = ROOT / "docs" / "reference" / "model-yaml.md"
MODEL_YAML_BEGIN = "<!-- model-yaml-reference: written from model.schema.json by `make schema`; do not edit -->"
MODEL_YAML_END = "<!-- end of model-yaml-reference -->"
API_MARKER = "<!-- python-api -->"
README_MARKER = "<!-- readme -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if README_MARKER in markdown:
        markdown = markdown.replace(README_MARKER, (ROOT / "README.md").read_text().replace("](docs/", "]("))
    if API_MARKER in markdown:
        markdown = markdown.replace(API_MARKER, api_entries(public_names(PACKAGE_INIT.read_text())))
    return markdown


# -- model.yaml ----------------------------------------------------------------------------

def with_reference(page: str, schema: dict) -> str:
    """``page`` (model-yaml.md) with the table between its markers written from ``schema``."""
    head, rest = page.split(MODEL_YAML_BEGIN, 1)
    _, tail = rest.split(MODEL_YAML_END, 1)
    return f"{head}{MODEL_YAML_BEGIN}\n\n{model_yaml_reference(schema).strip()}\n\n{MODEL_YAML_END}{tail}"


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _sections(schema: dict) -> list[tuple[str, dict]]:
    """(dotted path, object schema): the top level, then each nested object where it is first met."""
    defs = schema.get("$defs", {})
    found, queue, seen = [], [("", schema)], set()
    while queue:
        path, node = queue.pop(0)
        found.append((path, node))
        for field, spec in node.get("properties", {}).items():
            for ref in _refs(spec):
                if ref not in seen:
                    seen.add(ref)
                    queue.append((f"{path}.{field}" if path else field, defs[ref]))
    return found


def _refs(spec: dict) -> list[str]:
    """The definitions a field's schema names, wherever they are nested (lists, maps, unions)."""
    refs = [_ref_name(spec["$ref"])] if "$ref" in spec else []
    for key in ("anyOf", "oneOf", "allOf"):
        for option in spec.get(key, []):
            refs += _refs(option)
    for key in ("items", "additionalProperties"):
        if isinstance(spec.get(key), dict):
            refs += _refs(spec[key])
    return refs


def _anchor(path: str) -> str:
    return "field-" + path.replace(".", "-")


def _type(spec: dict, paths: dict[str, str]) -> str:
    if "$ref" in spec:
        name = _ref_name(spec["$ref"])
        return f"[{paths[name]}](#{_anchor(paths[name])})"
    for key in ("anyOf", "oneOf"):
        if key in spec:
            return " or ".join(_type(option, paths) for option in spec[key])
    if "enum" in spec:
        return " or ".join(f"`{json.dumps(v)}`" for v in spec["enum"])
    if "const" in spec:
        return f"`{json.dumps(spec['const'])}`"
    kind = spec.get("type")
    if kind == "array":
        return f"list of {_type(spec.get('items', {}), paths)}"
    if kind == "object":
        values = spec.get("additionalProperties")
        return f"map of string to {_type(values, paths)}" if isinstance(values, dict) else "mapping"
    text = {"integer": "integer", "number": "number", "string": "string", "boolean": "boolean",
            "null": "null"}.get(kind, "any")
    limits = _limits(spec)
    return f"{text} ({limits})" if limits else text


def _limits(spec: dict) -> str:
    words = {"minimum": ">= {}", "maximum": "<= {}", "exclusiveMinimum": "> {}", "exclusiveMaximum": "< {}",
             "minLength": "at least {} characters", "maxLength": "at most {} characters",
             "minItems": "at least {} items", "minProperties": "at least {} entries",
             "pattern": "matching `{}`"}
    return ", ".join(text.format(spec[key]) for key, text in words.items() if key in spec)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _field_limits(spec: dict) -> str:
    """Limits stated beside the type: a union's non-null option carries them."""
    options = [o for o in spec.get("anyOf", [spec]) if o.get("type") != "null"]
    return "; ".join(filter(None, (_limits(o) for o in options if o.get("type") in ("array", "object"))))


def model_yaml_reference(schema: dict) -> str:
    sections = _sections(schema)
    paths = {_ref_name_of(schema, node): path for path, node in sections if path}
    out = []
    for path, node in sections:
        title = f"`{path}`" if path else "Top level"
        out += [f"### {title} {{ #{_anchor(path or 'top')} }}", ""]
        if node.get("description"):
            out += [_cell(node["description"]), ""]
        out += ["| field | type | default | description |", "| --- | --- | --- | --- |"]
        required = set(node.get("required", []))
        for field, spec in node.get("properties", {}).items():
            default = "required" if field in required else (
                f"`{json.dumps(spec['default'])}`" if "default" in spec else "")
            limits = _field_limits(spec)
            type_text = _type(spec, paths) + (f" ({limits})" if limits else "")
            out.append(f"| `{field}` | {_cell(type_text)} | {default} | {_cell(spec.get('description', ''))} |")
        out.append("")
    return "\n".join(out)


def _ref_name_of(schema: dict, node: dict) -> str:
    return next(name for name, spec in schema.get("$defs", {}).items() if spec is node)


# -- Python API ------------------------------------------------------------------------------

def public_names(source: str) -> list[tuple[str, str]]:
    """(name, defining module) of neuron_serve's ``_PUBLIC`` table, in its order."""
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "_PUBLIC" for t in targets) and node.value is not None:
            table = ast.literal_eval(node.value)
            return [(name, "neuron_serve" + module) for name, module in table.items()]
    raise ValueError("neuron_serve/__init__.py has no _PUBLIC table")


def api_entries(names: list[tuple[str, str]]) -> str:
    out = []
    for name, module in names:
        out += [f"## `neuron_serve.{name}`", "", f"::: {module}.{name}", "    options:",
                "      show_root_heading: false",
                "      show_root_toc_entry: false", ""]
    return "\n".join(out)


if __name__ == "__main__":  # write the model.yaml reference into its page
    MODEL_YAML_PAGE.write_text(with_reference(MODEL_YAML_PAGE.read_text(), json.loads(SCHEMA.read_text())))
