"""The documentation site builds strictly, and what it writes from the code covers the code.

The examples themselves run in tests/integration/test_doc_examples.py.
"""

import os
import subprocess
import sys

import pytest

import doc_examples
from neuron_serve.config.schema import json_schema

ROOT = doc_examples.ROOT


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """`mkdocs build --strict` of mkdocs.yml: a warning (a broken link or anchor, a page
    missing from the nav, a docstring mkdocstrings cannot read) fails the build."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONWARNINGS": "ignore"}
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stdout}\n{built.stderr}"
    return out


def test_site_builds_strictly(site):
    assert (site / "index.html").is_file()
    assert (site / "assets" / "partition-report.png").is_file()


def test_front_page_is_the_readme_with_links_into_the_site(site):
    page = (site / "index.html").read_text()
    assert "make serve" in page and "Generation quick start" in page
    assert 'href="guides/clients/"' in page and "docs/guides" not in page


def _pydantic_fields() -> set[tuple[str, str]]:
    """(model, field) of every pydantic model model.yaml is made of, from the live schema."""
    schema = json_schema()
    fields = {("ModelConfig", name) for name in schema["properties"]}
    for model, spec in schema["$defs"].items():
        fields |= {(model, name) for name in spec.get("properties", {})}
    return fields


def test_model_yaml_reference_lists_every_field(site):
    page = (site / "reference" / "model-yaml" / "index.html").read_text()
    missing = [(model, name) for model, name in _pydantic_fields() if f"<code>{name}</code>" not in page]
    assert not missing, f"fields of neuron_serve/config/schema.py missing from the model.yaml reference: {missing}"
    for section in ("generation", "batching", "http.auth", "partitioner.trace_kwargs", "placement"):
        assert f"<code>{section}</code>" in page


def test_api_page_documents_every_public_name(site):
    import neuron_serve  # noqa: PLC0415

    page = (site / "reference" / "api" / "index.html").read_text()
    for name in neuron_serve.__all__:
        if name != "__version__":
            assert f"neuron_serve.{name}" in page, name
    assert "Report which ATen operators" in page  # a docstring, not only a heading (analyze's)
    for name in ("engine_for", "SamplingParams", "Engine"):
        assert name in page


def test_zoo_table_lives_in_the_docs():
    page = (ROOT / "docs" / "reference" / "zoo.md").read_text()
    assert "<!-- zoo-table:begin -->" in page and "<!-- zoo-table:end -->" in page
    assert '"docs" / "reference" / "zoo.md"' in (ROOT / "tests" / "zoo_table.py").read_text()


def _blocks(languages):
    blocks = []
    parser = doc_examples.sybil()
    for path in doc_examples.documents():
        for example in parser.parse(path):
            if isinstance(example.parsed, str) and doc_examples.language(example) in languages:
                blocks.append(pytest.param(str(example.parsed), id=f"{path.relative_to(ROOT)}:{example.line}"))
    return blocks


@pytest.mark.parametrize("source", _blocks(doc_examples.SHELLS))
def test_shell_example_parses(source):
    checked = subprocess.run(["bash", "-n"], input=source, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize("source", _blocks(["python"]))
def test_python_example_compiles(source):
    """Every Python block, run or not (one that needs a server this checkout cannot start is
    skipped where it runs), is at least valid Python."""
    compile(source, "<example>", "exec")


def test_make_docs_serves_the_site():
    makefile = (ROOT / "Makefile").read_text()
    assert "mkdocs serve" in makefile
    assert "'.[test,docs]'" in makefile, "make test installs the docs extra: its strict build runs in the tests"
