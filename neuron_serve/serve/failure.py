"""The model's own error, out of Ray Serve's messages about a replica that failed to start.

Serve reports a replica whose constructor raised as "The deployment failed to start ...
Error:" followed by Ray's actor-death text and the replica's traceback. A user wants the
last line of that traceback (``FileNotFoundError: weights file ... is missing``), not
Ray's wrapping; the full text stays in the debug log.
"""

from __future__ import annotations

import re

from .. import errors

# The exception line that ends a Python traceback: "Name: message" or "pkg.Name: message".
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Exit|Interrupt)):\s?(.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Ray's wrappers around the replica's exception, never the model's error itself.
_RAY_WRAPPERS = {"RayActorError", "ActorDiedError", "RayTaskError", "RuntimeError"}


def model_error(messages: list[str]) -> str:
    """The last exception raised in the replica (``Type: message``, with the message's
    further lines), else the messages joined."""
    found = None
    for message in messages:
        lines = _ANSI.sub("", message or "").splitlines()
        for index, line in enumerate(lines):
            match = _EXCEPTION_LINE.match(line.strip())
            if match and match.group(1) not in _RAY_WRAPPERS:
                # A traceback ends with the exception, so its message runs to the end.
                rest = "\n".join(lines[index + 1:]).rstrip()
                found = f"{match.group(1)}: {match.group(2)}" + (f"\n{rest}" if rest else "")
    if found is not None:
        return found
    return " ".join(m.strip() for m in messages if m and m.strip()) or "no message from Ray Serve"


def exit_code(error: str) -> int:
    """The CLI exit code of a failure message: a neuron-serve error type's own, else 1."""
    name = error.split(":", 1)[0]
    found = getattr(errors, name, None)
    if isinstance(found, type) and issubclass(found, errors.NeuronServeError):
        return found.exit_code
    return 1
