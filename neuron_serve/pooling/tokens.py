"""Text to the rows a pooling model takes, on the replica's host: token ids and segment ids (packing.py makes the
compiled rows of them).

Tokenization calls the model's Rust tokenizer (``tokenizers``) directly, as transformers'
fast tokenizer does inside ``tokenizer(texts)`` (what sentence-transformers' ``encode`` and
``predict`` call), without the Python around it (bench/embed_placement.py: 69 µs for a
text instead of 97). A request's texts are tokenized on the event loop, since handing them to
a thread and back costs more than a few short texts take (about 100 µs on 2 vCPUs);
a request of more text than ``THREAD_CHARS`` goes to a thread, so that the loop goes on
taking and answering other requests meanwhile rather than stopping for it.

Nothing here loads the compiler or torch-xla: a replica imports it beside its plane.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence


from ..errors import ConfigError, InvalidInput
from .spec import PoolingSpec

# Characters of text above which a request is tokenized on a thread (see the module's docstring).
THREAD_CHARS = 4096
TRUNCATING_KEPT = 8  # tokenizers kept for distinct truncate_prompt_tokens values


@dataclass(frozen=True)
class Row:
    """One input as tokens: ids, and segment ids (0 for a text or a query, 1 for a document)."""

    ids: list[int]
    type_ids: list[int] | None = None


class Tokens:
    """The model's tokenizer as a pooling replica uses it (a transformers fast tokenizer's Rust core)."""

    def __init__(self, tokenizer: Any, spec: PoolingSpec) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ConfigError(f"tokenizer: {type(tokenizer).__name__} is not a fast (Rust) tokenizer; save the "
                              f"model's tokenizer with its tokenizer.json (AutoTokenizer.from_pretrained(..., "
                              f"use_fast=True).save_pretrained(dir)).")
        import tokenizers  # noqa: PLC0415

        self._source = backend.to_str()
        self._load = tokenizers.Tokenizer.from_str
        self.backend = self._plain()
        self.spec = spec
        self.side = getattr(tokenizer, "truncation_side", "right")
        self.segments = "token_type_ids" in spec.input_names
        self._truncating: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.Lock()  # the event loop and the tokenizing thread both look truncators up

    def _plain(self) -> Any:
        # A copy: transformers sets truncation and padding on its own before each call; these stay off.
        backend = self._load(self._source)
        backend.no_truncation()
        backend.no_padding()
        return backend

    def _with_truncation(self, tokens: int | None) -> Any:
        if tokens is None:
            return self.backend
        with self._lock:
            found = self._truncating.get(tokens)
            if found is None:
                found = self._plain()
                found.enable_truncation(tokens, strategy="longest_first", direction=self.side)
                self._truncating[tokens] = found
                if len(self._truncating) > TRUNCATING_KEPT:
                    self._truncating.popitem(last=False)
            self._truncating.move_to_end(tokens)
            return found

    def texts(self, texts: Sequence[str], truncate: int | None = None) -> list[Row]:
        """Each text as the tokenizer makes it (the default prompt before it), cut to ``truncate`` tokens."""
        prompt = self.spec.prompt
        return self._encode([prompt + t for t in texts] if prompt else list(texts), truncate)

    def pairs(self, pairs: Sequence[tuple[str, str]], truncate: int | None = None) -> list[Row]:
        """Each (query, document) pair as one input, the longer cut first to ``truncate`` tokens."""
        prompt = self.spec.prompt
        return self._encode([(prompt + q, d) for q, d in pairs], truncate)

    def _encode(self, inputs: list, truncate: int | None) -> list[Row]:
        if truncate is not None and inputs:
            # tokenizers leaves an input whole when the length asked cannot hold the special tokens it adds
            special = self.backend.num_special_tokens_to_add(not isinstance(inputs[0], str))
            if truncate <= special:
                raise InvalidInput(f"truncate_prompt_tokens: {truncate} tokens cannot hold an input with its {special} "
                                   f"special tokens; give at least {special + 1}", "truncate_prompt_tokens")
        try:
            encodings = self._with_truncation(truncate).encode_batch(inputs)
        except Exception as exc:  # tokenizers refuses what it cannot cut (a pair cut past one of its texts)
            raise InvalidInput(f"truncate_prompt_tokens: {truncate} tokens cannot hold these inputs ({exc}); give "
                               f"more", "truncate_prompt_tokens") from None
        if self.segments:
            return [Row(e.ids, e.type_ids) for e in encodings]
        return [Row(e.ids) for e in encodings]

    @staticmethod
    def characters(inputs: Sequence[str | tuple[str, str]]) -> int:
        """The text a request holds, to choose where it is tokenized (see THREAD_CHARS)."""
        return sum(len(i) if isinstance(i, str) else len(i[0]) + len(i[1]) for i in inputs)

    def ids(self, lists: Sequence[Sequence[int]], truncate: int | None = None) -> list[Row]:
        """Token ids as given (vLLM keeps the last ``truncate`` of a list: left truncation)."""
        if truncate is not None:
            lists = [ids[-truncate:] for ids in lists]
        return [Row(list(ids), [0] * len(ids) if self.segments else None) for ids in lists]
