"""When a sequence ends, by its tokens: the engine's part of the stop rules.

EOS (unless ``ignore_eos``), a stop token id, a structured output's completed grammar,
``max_tokens`` and a full context end a sequence as its token is appended, so its slot
is free before the next step admits anyone. Stop strings are found in the text, by the
front end, which then aborts the sequence here with reason "stop".
"""

from __future__ import annotations

from typing import Any


def stop_reason(seq: Any, token: int, eos_token_ids: frozenset[int],
                max_model_len: int) -> tuple[str | None, int | None]:
    """``("stop", token)``, ``("length", None)`` or ``(None, None)`` once ``seq`` holds ``token``."""
    params = seq.params
    if token in params.stop_token_ids or (seq.constraint is not None and seq.constraint.done):
        return "stop", token
    if token in eos_token_ids and not params.ignore_eos:
        return "stop", token
    if (params.max_tokens is not None and len(seq.output) >= params.max_tokens) or seq.length >= max_model_len:
        return "length", None
    return None, None
