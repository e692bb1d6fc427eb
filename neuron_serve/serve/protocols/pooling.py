"""The protocol-neutral request and result of the pooling plane (task: embed, score, classify).

Each wire format of the pooling routes (OpenAI's embeddings, Jina's and Cohere's rerank,
vLLM's score and classify: `openai_pooling`) decodes into one `PoolingRequest` and encodes
from its `PoolingResult`, so the plane sees no JSON and no route's conventions. Which
inputs came from which field of the request (``field``) travels with it, so the plane's
refusals (too long, empty, an id outside the vocabulary) name the field the client sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Kind = Literal["embed", "score", "classify"]


@dataclass
class PoolingRequest:
    """What to compute, on which inputs: texts, token-id lists, or (query, document) pairs.

    ``kind`` embed and classify take ``texts`` or ``token_ids``; score takes ``pairs``.
    ``truncate`` is ``truncate_prompt_tokens`` as sent (-1: the model's longest). ``field``
    names the inputs in messages (``input``, ``documents``, ``text_2``); ``single``: the
    client sent one input, not a list of one (messages then name the field alone).
    """

    kind: Kind
    texts: list[str] | None = None
    token_ids: list[list[int]] | None = None
    pairs: list[tuple[str, str]] | None = None
    truncate: int | None = None
    dimensions: int | None = None
    field: str = "input"
    single: bool = False

    @property
    def count(self) -> int:
        """How many inputs (texts, token lists or pairs) the request holds."""
        return len(self.texts or self.token_ids or self.pairs or ())

    def name(self, index: int) -> str:
        """How messages name input ``index``: ``input[3]``, or ``input`` for a lone input."""
        return self.field if self.single else f"{self.field}[{index}]"


@dataclass
class PoolingResult:
    """The plane's answer: a row of ``values`` per input, in order, and the tokens the inputs took.

    ``values`` are embeddings (rows x dimensions), scores (one per row) or class
    probabilities or logits (rows x labels); ``padded``: tokens added to fill length buckets.
    """

    values: torch.Tensor
    tokens: int
    padded: int = 0
