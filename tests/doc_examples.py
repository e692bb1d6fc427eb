"""The code blocks of README.md and docs/, as Sybil parses them, and what each needs to run.

Markdown conventions the examples follow (HTML comments, so GitHub and the site hide them):

- ``<!-- invisible-code-block: python ... -->`` runs setup code in the page's namespace;
- ``<!-- skip: next "why" -->`` skips the next block, saying why.

Python blocks run in the page's namespace, in page order. Shell blocks (bash, sh) are all
parse-checked with ``bash -n``; the ones made only of ``curl`` commands also run. An example
naming the server's addresses (``127.0.0.1:8000``, ``localhost:8000``, ``:8001``) runs against
a real server started by the tests, its addresses put in place of those: the examples'
``deployments/mlp.yaml`` server, or for OpenAI's routes (``/v1``) ``deployments/llm.yaml``'s.
"""

from __future__ import annotations

import re
from pathlib import Path

from sybil import Sybil
from sybil.parsers.markdown import CodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parents[1]
SHELLS = ("bash", "sh", "shell", "console")
HTTP_ADDRESS = re.compile(r"\b(?:127\.0\.0\.1|localhost):8000\b")
GRPC_ADDRESS = re.compile(r"\b(?:127\.0\.0\.1|localhost):8001\b")


def documents() -> list[Path]:
    """README.md and every page of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def sybil(python=None, shell=None) -> Sybil:
    """A Sybil parsing python and shell blocks (each with its evaluator) and skip directives."""
    parsers = [CodeBlockParser(language="python", evaluator=python), SkipParser()]
    parsers += [CodeBlockParser(language=shell_name, evaluator=shell) for shell_name in SHELLS]
    return Sybil(parsers=parsers, path=str(ROOT), patterns=["*.md"])


def is_code(example) -> bool:
    """A code block a reader sees (not an invisible setup block, not a directive)."""
    return isinstance(example.parsed, str) and "directive" not in example.region.lexemes


def language(example) -> str:
    return str(example.region.lexemes.get("arguments") or "").strip()


def runs_shell(source: str) -> bool:
    """A shell block made of curl commands only (continuation lines included) runs."""
    commands = re.sub(r"\\\n", " ", source).strip().splitlines()
    return bool(commands) and all(c.strip().startswith("curl ") for c in commands if c.strip())


def server_needed(source: str) -> str | None:
    """'llm' (OpenAI's routes), 'mlp' (the OIP v2 examples) or None."""
    if not (HTTP_ADDRESS.search(source) or GRPC_ADDRESS.search(source)):
        return None
    return "llm" if "/v1" in source else "mlp"


def with_addresses(source: str, http: str, grpc: str) -> str:
    """The example with the test server's host:port in place of the documented ones."""
    return GRPC_ADDRESS.sub(grpc, HTTP_ADDRESS.sub(http, source))
