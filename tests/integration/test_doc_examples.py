"""Every code block of README.md and docs/ runs against the real package (see tests/doc_examples.py).

One test per block a reader sees, in page order; a page's invisible setup blocks and skip
directives run on the way. Running one block runs the blocks of its page before it first,
so ``-k`` works. Examples run in a scratch directory that holds ``deployments/`` (a link to
the repository's), so paths such as ``deployments/llm.yaml`` and ``build/tiny`` work as in a
checkout without writing into it. Examples that name the server's addresses get a real
``neuron-serve deploy`` of the mlp and encoder examples (or of the LLM example), its ports
put in place of 8000 and 8001; KServe's client runs under .venv-kserve's python, as tests/integration/test_kserve_client.py does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unittest
from pathlib import Path

import pytest

import doc_examples

pytestmark = pytest.mark.serial  # make test runs it apart: the examples run in this process and set XLA's environment

ROOT = doc_examples.ROOT
KSERVE_PYTHON = ROOT / ".venv-kserve" / "bin" / "python"


class Pages:
    """Each page's examples, evaluated in order once each; the pytest request of the running test."""

    def __init__(self) -> None:
        self.sybil = doc_examples.sybil(python=self.python, shell=self.shell)
        self.examples = {path: list(self.sybil.parse(path)) for path in doc_examples.documents()}
        self.done: dict[Path, int] = {}          # examples evaluated so far, per page
        self.environ: dict[Path, dict] = {}      # os.environ before the page's first example
        self.request = None

    def run_through(self, path: Path, index: int) -> None:
        """Evaluate the page's examples up to ``index``, each once, in order: a failure of one
        before it (a setup block) fails this test too, a skipped one does not. After the page's
        last visible block, its trailing setup blocks run and its environment is put back."""
        examples = self.examples[path]
        last = index == max(i for i, e in enumerate(examples) if doc_examples.is_code(e))
        self.environ.setdefault(path, dict(os.environ))
        try:
            self._evaluate(examples, path, index)
            if last:
                self._evaluate(examples, path, len(examples) - 1)
        finally:
            if last:
                _restore(self.environ.pop(path))

    def _evaluate(self, examples: list, path: Path, index: int) -> None:
        while self.done.get(path, 0) <= index:
            current = self.done.get(path, 0)
            self.done[path] = current + 1
            try:
                examples[current].evaluate()
            except (pytest.skip.Exception, unittest.SkipTest):
                if current == index:
                    raise

    # -- evaluators --------------------------------------------------------------------------

    def _addressed(self, source: str) -> str:
        needed = doc_examples.server_needed(source)
        if needed is None:
            return source
        server = self.request.getfixturevalue("llm_server" if needed == "llm" else "examples_server")
        return doc_examples.with_addresses(source, f"127.0.0.1:{server.port}", server.grpc_url)

    def python(self, example) -> None:
        __tracebackhide__ = True
        source = example.parsed
        if "deployments/llm" in source:
            self.request.getfixturevalue("llm_example")
        source = self._addressed(source)
        if "from kserve import" in source or "import kserve" in source:
            self._kserve(source)
            return
        code = compile("\n" * (example.line + example.parsed.line_offset) + source, example.path, "exec")
        exec(code, example.namespace)  # noqa: S102 - the documented example itself
        example.namespace.pop("__builtins__", None)

    def _kserve(self, source: str) -> None:
        python = self.request.getfixturevalue("kserve_python")
        done = subprocess.run([str(python), "-c", source], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"under .venv-kserve:\n{done.stdout}\n{done.stderr}"

    def shell(self, example) -> None:
        __tracebackhide__ = True
        source = example.parsed
        checked = subprocess.run(["bash", "-n"], input=source, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr
        if not doc_examples.runs_shell(source):
            return
        source = self._addressed(source)
        done = subprocess.run(["bash", "-eo", "pipefail", "-c", source], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0 and done.stdout.strip(), f"{source}\n{done.stdout}\n{done.stderr}"
        assert not _error_answer(done.stdout), done.stdout


def _error_answer(stdout: str) -> bool:
    """Whether a shell example printed an error answer: a JSON object with a top-level "error"
    (OIP's and OpenAI's errors), as the whole output, a line or a server-sent event. Not the
    word in generated text: the example LLM's tokenizer is trained on these docs, so what it
    says changes with them."""
    for text in [stdout, *(line.removeprefix("data:").strip() for line in stdout.splitlines())]:
        try:
            answer = json.loads(text)
        except ValueError:
            continue
        if isinstance(answer, dict) and "error" in answer:
            return True
    return False


def _restore(environ: dict) -> None:
    for key in set(os.environ) - set(environ):
        del os.environ[key]
    os.environ.update(environ)


PAGES = Pages()


def _cases():
    cases = []
    for path, examples in PAGES.examples.items():
        for index, example in enumerate(examples):
            if doc_examples.is_code(example):
                cases.append(pytest.param(path, index, id=f"{path.relative_to(ROOT)}:{example.line}"))
    return cases


@pytest.fixture(scope="session")
def examples_dir(tmp_path_factory) -> Path:
    """A scratch working directory with the repository's deployments/ in it."""
    where = tmp_path_factory.mktemp("examples")
    (where / "deployments").symlink_to(ROOT / "deployments", target_is_directory=True)
    return where


@pytest.fixture(scope="session")
def llm_example() -> Path:
    """deployments/llm/, as `make llm-example` writes it (SmolLM2-135M-Instruct; nothing downloaded when served)."""
    import real_models  # noqa: PLC0415

    return real_models.smollm2()


@pytest.fixture(scope="session")
def llm_server(examples_llm_server):
    """`neuron-serve deploy deployments/llm.yaml deployments/embedder.yaml` (OpenAI's routes), the real-model tests'."""
    return examples_llm_server


@pytest.fixture(scope="session")
def kserve_python() -> Path:
    """.venv-kserve's python; `make kserve-client` builds it when only pytest was run."""
    if not (ROOT / ".venv-kserve" / ".installed").exists():
        subprocess.run(["make", "-s", "kserve-client"], cwd=ROOT, check=True)
    return KSERVE_PYTHON


@pytest.mark.parametrize(("path", "index"), _cases())
def test_example(path, index, request, examples_dir, monkeypatch):
    monkeypatch.chdir(examples_dir)
    PAGES.request = request
    try:
        PAGES.run_through(path, index)
    finally:
        PAGES.request = None
