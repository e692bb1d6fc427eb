"""Turn a torch.export or torch-xla failure into one error a user can act on.

torch.export's messages run to thousands of lines (whole graphs, hints about internal
config flags) and torch-xla's name FX nodes the user never wrote. The user needs three
things: which construct or operator failed, the line of their (or their library's)
code it came from, and what to do. The original exception is kept as ``cause`` on the
error for debugging, but not chained, so no traceback from inside torch reaches the user.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import traceback

import torch
import torch.fx

from ..errors import InternalCompileError, UnsupportedModelError
from .callsite import CallSite, call_site

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_UNKNOWN_OUTPUT = re.compile(r"Found <class '(?P<cls>[\w.]+)'> in output, which is not a known type")
_DATA_DEPENDENT = re.compile(r"Could not guard on data-dependent expression (?P<expr>.+?) \(unhinted")
_CAUSED_BY = re.compile(r"Caused by: \((?P<file>[^\s:()]+):(?P<line>\d+) in (?P<func>\w+)\)")
_NODE = re.compile(r"While executing %(?P<node>\w+)")


def _is_library_frame(filename: str) -> bool:
    # torch, torch-xla and neuron-serve itself are never "the user's code".
    return (filename.startswith((_TORCH_DIR, _OWN_DIR, "<")) or "/torch_xla/" in filename)


def _raising_site(exc: BaseException) -> CallSite | None:
    """The innermost frame of the traceback outside torch, torch-xla and neuron-serve."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if not _is_library_frame(frame.filename):
            code = frame.line or linecache.getline(frame.filename, frame.lineno).strip()
            return CallSite(frame.filename, frame.lineno, code)
    return None


def _site_named_in(text: str) -> CallSite | None:
    """torch.export names the line of a data-dependent guard relative to site-packages."""
    found = _CAUSED_BY.search(text)
    if found is None:
        return None
    line = int(found["line"])
    for root in sys.path:
        path = os.path.join(root, found["file"])
        if os.path.isfile(path):
            return CallSite(path, line, linecache.getline(path, line).strip())
    return CallSite(found["file"], line, found["func"])


def _where(site: CallSite | None) -> str:
    return f"{site.log_form} ({site.file})" if site else "<call site unknown>"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def capture_error(exc: BaseException, model: object) -> UnsupportedModelError:
    """The error for a model torch.export cannot capture."""
    text = str(exc)
    unknown = _UNKNOWN_OUTPUT.search(text)
    if unknown:
        cls = unknown["cls"]
        hint = ("; for transformers caches call transformers.integrations.executorch."
                "register_dynamic_cache_export_support() before tracing, or call the model with use_cache=False"
                if cls.startswith("transformers.") else ", or return plain tensors, tuples, lists or dicts")
        error = UnsupportedModelError(
            f"torch.export cannot capture the model: {type(model).__name__}.forward returns a {cls}, which it cannot "
            f"flatten into tensors. Register {cls.rsplit('.', 1)[-1]} as a pytree node "
            f"(torch.utils._pytree.register_pytree_node){hint}."
        )
    elif (dependent := _DATA_DEPENDENT.search(text)) is not None:
        error = UnsupportedModelError(
            f"torch.export cannot capture the model: Python control flow depends on the input's values at "
            f"{_where(_site_named_in(text) or _raising_site(exc))}. The condition ({dependent['expr']}) is a size computed from tensor "
            "contents (after an operator such as nonzero, boolean-mask indexing or a score threshold), so no one "
            "graph holds for every input. Rewrite that branch without Python control flow (torch.cond, or "
            "torch._check to state which case holds), or trace only the part of the model before it and run "
            "the rest in eager PyTorch."
        )
    else:
        error = UnsupportedModelError(
            f"torch.export cannot capture the model: {type(exc).__name__}: {_first_line(exc)} at "
            f"{_where(_raising_site(exc))}. Change that code so torch.export can trace it "
            "(https://pytorch.org/docs/stable/export.html), or trace a smaller part of the model."
        )
    error.cause = exc
    return error


def compile_error(exc: BaseException, gm: torch.fx.GraphModule, subgraph: str) -> UnsupportedModelError:
    """The error for an accelerator subgraph that torch-xla fails to trace or compile."""
    found = _NODE.search(str(exc))
    node = next((n for n in gm.graph.nodes if found and n.name == found["node"]), None)
    if node is not None and node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        op = schema.name if schema is not None else str(node.target)
        where = _where(call_site(node))
        fix = f"Run it on CPU: PartitionerConfig(ops_to_partition={{'{op}'}})."
    else:
        op, where, fix = "an operator", "<call site unknown>", "Run the model on CPU or report the model."
    error = UnsupportedModelError(
        f"torch-xla could not compile subgraph {subgraph}: {op} at {where} failed with "
        f"{type(exc).__name__}: {_first_line(exc)}. {fix}"
    )
    error.cause = exc
    return error


def internal_compile_error(exc: BaseException, subgraph: str) -> InternalCompileError:
    """The error for a subgraph whose compile failed inside torch-xla's own state twice (the second time in a clean
    state): not the model's operators, so it names none and asks for no change to the model."""
    error = InternalCompileError(
        f"torch-xla failed inside its own state compiling subgraph {subgraph}, twice (the second time in a clean "
        f"state): {type(exc).__name__}: {_first_line(exc)}. This is not the model's operators: nothing about them "
        "was cached; deploy again, and report it if it persists."
    )
    error.cause = exc
    return error
