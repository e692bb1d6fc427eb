"""How a model.yaml's validation errors read: a line per error, the field's dotted path (``inputs.0.dtype``),
pydantic's message or a model-level check's own (a FieldError naming its field), and the fix where one is known.
"""

from __future__ import annotations

import re

from pydantic import ValidationError

from .generation import FieldError


_HINTS = {
    "extra_forbidden": "remove it or check its spelling",
    "missing": "add it",
    "string_pattern_mismatch": "see the pattern above",
    "literal_error": "use one of the values listed",
}


_BRANCH = re.compile(r"^(list|literal)\[.*\]$")  # pydantic's tag of a union's member in an error's location


def _one_branch(items: list[dict]) -> list[dict]:
    """A list-or-``auto`` field's errors of the branch its value took: the list's when a list was given, the
    literal's when a string was (not both, which pydantic reports), without the branch's tag in the location."""
    def tags_of(item: dict) -> list[str]:
        return [p for p in item["loc"] if isinstance(p, str) and _BRANCH.match(p)]

    auto = {item["loc"][:item["loc"].index(t)] for item in items for t in tags_of(item) if t.startswith("literal")}
    kept = []
    for item in items:
        tags = tags_of(item)
        if tags and item["loc"][:item["loc"].index(tags[0])] in auto:
            gave_text = isinstance(item.get("input"), str) and item["loc"].index(tags[0]) == len(item["loc"]) - 1
            if tags[0].startswith("literal") != gave_text:
                continue
            item = {**item, "loc": tuple(p for p in item["loc"] if p not in tags)}
        kept.append(item)
    return kept


def format_errors(error: ValidationError, source: str) -> str:
    """A model.yaml's validation errors, a line each: the field's dotted path, what is wrong, how to fix it."""
    lines = [f"{source}: invalid model.yaml"]
    for item in _one_branch(error.errors()):
        field = ".".join(str(p) for p in item["loc"]) or "(top level)"
        hint = _HINTS.get(item["type"])
        message, cause = item["msg"], item.get("ctx", {}).get("error")
        if isinstance(cause, FieldError):  # a model-level check naming its field
            field, message, hint = ".".join([*map(str, item["loc"]), cause.field]), cause.message, None
        lines.append(f"  {field}: {message}" + (f" ({hint})" if hint else ""))
    return "\n".join(lines)
