"""Structured outputs: a request's answer held to a JSON schema, a regex, a list of choices or a grammar.

The constraint is compiled by xgrammar (the library vLLM and SGLang use) against the
model's tokenizer into a grammar, once, by the front end (:class:`Grammars`), which hands it
to the engine serialized; the engine (:class:`Matchers`) gives each constrained sequence its
own matcher over it: every step the matcher's bitmask of allowed tokens is applied to the row's
logits on the host (disallowed tokens to -inf) before greedy choice or sampling, and the
chosen token advances the matcher. A constrained row and an unconstrained one share a
decode call; only the constrained row's logits cross to the host. The model's EOS ids
are the grammar's stop tokens: once the answer is complete, EOS is the only token
allowed, and the sequence ends with finish_reason "stop"; one that runs out of
``max_tokens`` first ends with "length", as any other.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ...errors import InvalidInput

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """One request's constraint: ``kind`` (see KINDS) and its ``spec`` (a schema or grammar as text, a regex,
    a tuple of choices); ``field`` is the request field it came from, named in errors."""

    kind: str
    spec: Any = None
    field: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidInput(f"{self.field}: unknown constraint {self.kind!r}; one of {', '.join(KINDS)}.")


def _tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
    """xgrammar's view of the tokenizer: the same on the front end's side and the engine's, or the engine
    refuses the grammar (its metadata must match)."""
    import xgrammar  # noqa: PLC0415 - only structured requests need it

    stops = sorted(stop_token_ids) or None  # None: xgrammar finds the tokenizer's own
    with warnings.catch_warnings():  # it warns that it looks for them itself, which is what None asks
        warnings.simplefilter("ignore", UserWarning)
        return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)


class Grammars:
    """Constraints compiled for one tokenizer and vocabulary (compiled grammars are cached by xgrammar)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = ()) -> None:
        import xgrammar  # noqa: PLC0415 - only structured requests need it

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(_tokenizer_info(tokenizer, vocab_size, stop_token_ids))

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar of ``constraint``; InvalidInput naming its field when the library refuses it."""
        compiler, kind, spec = self._compiler, constraint.kind, constraint.spec
        try:
            if kind == "json_object":  # OpenAI's json_object is an object; xgrammar's builtin JSON is any value
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "json_schema":
                return compiler.compile_json_schema(spec if isinstance(spec, str) else json.dumps(spec),
                                                    any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))
            return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise InvalidInput(f"{constraint.field}: the {kind.replace('_', ' ')} cannot be compiled: {reason}") from None



class Matchers:
    """The engine's side: a matcher per constrained sequence, over a grammar the front end compiled and
    serialized (deserialized here, never compiled again)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = ()) -> None:
        import xgrammar  # noqa: PLC0415

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        self._info = _tokenizer_info(tokenizer, vocab_size, stop_token_ids)

    def matcher(self, serialized: str) -> "RowConstraint":
        grammar = self._xgr.CompiledGrammar.deserialize_json(serialized, self._info)
        return RowConstraint(self._xgr, self._xgr.GrammarMatcher(grammar), self.vocab_size)


class RowConstraint:
    """One sequence's walk through its grammar."""

    def __init__(self, xgr: Any, matcher: Any, vocab_size: int) -> None:
        self._xgr = xgr
        self._matcher = matcher
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._stops = bool(matcher.stop_token_ids)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (vocab,) with every token the grammar does not allow next at -inf (in place)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgr.apply_token_bitmask_inplace(logits[None], self._bitmask)
        return logits

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar does not allow it."""
        return bool(self._matcher.accept_token(token))

    @property
    def done(self) -> bool:
        """The answer is complete: its stop token (EOS) accepted, or, for a model without one, the grammar's end reached."""
        return bool(self._matcher.is_terminated() or (not self._stops and self._matcher.is_completed()))
