"""The pooling routes' wire formats, as vLLM serves them: a codec to and from `PoolingRequest` and `PoolingResult`.

- ``/v1/embeddings``: OpenAI's embeddings API (``input`` a string, a list of strings, token
  ids or a list of token-id lists; ``encoding_format`` float or base64; ``dimensions``).
- ``/rerank``, ``/v1/rerank`` (Jina's) and ``/v2/rerank`` (Cohere's v2): ``query`` against
  ``documents``, results sorted by ``relevance_score``, the first ``top_n``.
- ``/score``, ``/v1/score`` (vLLM's): ``text_1`` against one or many ``text_2``.
- ``/classify`` (vLLM's): a label and its class probabilities per input.

Every route also takes vLLM's ``truncate_prompt_tokens``. Errors are OpenAI's error object
(`openai.OpenAIError`), naming the field; a field none of these APIs defines is refused by
name, as is one this server cannot honour.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import Any, Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .openai import OpenAIError, json_object
from .pooling import PoolingRequest, PoolingResult

MAX_INPUTS = 2048  # inputs of one request (OpenAI's bound for embeddings)
# route -> the API its body follows (vLLM's paths; /v1/classify beside vLLM's /classify).
ROUTES = {"/v1/embeddings": "embeddings", "/rerank": "rerank", "/v1/rerank": "rerank", "/v2/rerank": "rerank",
          "/score": "score", "/v1/score": "score", "/classify": "classify", "/v1/classify": "classify"}
# API -> the model tasks that answer it: an embedding model scores pairs by the cosine of their embeddings.
TASKS = {"embeddings": ("embed",), "rerank": ("score", "embed"), "score": ("score", "embed"),
         "classify": ("classify",)}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    user: str | None = None  # an end user's id (OpenAI's): kept nowhere


class EmbeddingBody(_Body):
    model: str
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)


class RerankBody(_Body):
    query: str
    documents: list[str | dict]
    top_n: int | None = Field(None, ge=0)  # None or 0: every document (vLLM's 0)
    return_documents: bool = True  # Jina's default; Cohere's v2 clients read past the extra field
    max_tokens_per_doc: int | None = None  # Cohere's: refused (truncate_prompt_tokens cuts the pair)
    priority: int | None = None  # Cohere's and vLLM's: every request here has the same priority


class ScoreBody(_Body):
    text_1: str | list[str]
    text_2: str | list[str]


class ClassifyBody(_Body):
    input: Any


_SCHEMAS = {"embeddings": EmbeddingBody, "rerank": RerankBody, "score": ScoreBody, "classify": ClassifyBody}


def parse(api: str, body: bytes | dict) -> _Body:
    """The request body of ``api`` (a ROUTES value) decoded and checked; errors are OpenAIErrors naming the field."""
    data = body if isinstance(body, dict) else json_object(body)
    try:
        request = _SCHEMAS[api].model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            raise OpenAIError(f"unknown field {param!r}: this server does not support it", param=param) from None
        raise OpenAIError(f"{param}: {first['msg']}" if param else first["msg"], param=param) from None
    if isinstance(request, RerankBody):
        if request.max_tokens_per_doc is not None:
            raise OpenAIError("max_tokens_per_doc is not supported; truncate_prompt_tokens cuts each query and "
                              "document pair to that many tokens", param="max_tokens_per_doc")
        if request.priority:
            raise OpenAIError("priority: every request is served in arrival order here; remove priority or give 0",
                              param="priority")
    return request


def _inputs(value: Any, field: str) -> tuple[list[str] | None, list[list[int]] | None, bool]:
    """OpenAI's ``input``: (texts, token-id lists, whether one input was sent rather than a list)."""
    if isinstance(value, str):
        return [value], None, True
    if not isinstance(value, list):
        raise OpenAIError(f"{field}: give a string, a list of strings, a list of token ids or a list of token-id "
                          f"lists, not {_kind(value)}", param=field)
    if not value:
        raise OpenAIError(f"{field}: the list is empty; give at least one text or token list", param=field)
    if len(value) > MAX_INPUTS:
        raise OpenAIError(f"{field}: {len(value)} inputs, more than the {MAX_INPUTS} a request may hold; send them "
                          f"in several requests", param=field)
    if all(isinstance(v, str) for v in value):
        return list(value), None, False
    if all(_is_id(v) for v in value):
        return None, [list(value)], True
    if all(isinstance(v, list) for v in value):
        for i, ids in enumerate(value):
            bad = next((j for j, v in enumerate(ids) if not _is_id(v)), None)
            if bad is not None:
                raise OpenAIError(f"{field}[{i}][{bad}]: a token id is an integer, not {_kind(ids[bad])}",
                                  param=field)
        return None, [list(ids) for ids in value], False
    first = value[0]
    if not (isinstance(first, (str, list)) or _is_id(first)):
        raise OpenAIError(f"{field}[0]: {_kind(first)}; give strings, token ids or token-id lists", param=field)
    index = next(i for i, v in enumerate(value) if _kind(v) != _kind(first))
    raise OpenAIError(f"{field}[{index}]: {_kind(value[index])} where {field}[0] is {_kind(first)}; give strings, "
                      f"token ids or token-id lists, all of one kind", param=field)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _texts(value: str | list[str], field: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise OpenAIError(f"{field}: the list is empty; give at least one text", param=field)
    if len(texts) > MAX_INPUTS:
        raise OpenAIError(f"{field}: {len(texts)} texts, more than the {MAX_INPUTS} a request may hold; send them in "
                          f"several requests", param=field)
    return texts


def _document(document: str | dict, index: int) -> str:
    if isinstance(document, str):
        return document
    if isinstance(document.get("text"), str):  # Jina's and Cohere's v1 objects: {"text": ...}
        return document["text"]
    raise OpenAIError(f"documents[{index}]: give a string or an object with a string 'text'", param="documents")


def decode(request: _Body) -> PoolingRequest:
    """The plane's request of a parsed body."""
    truncate = request.truncate_prompt_tokens
    if isinstance(request, EmbeddingBody):
        texts, ids, single = _inputs(request.input, "input")
        return PoolingRequest("embed", texts, ids, truncate=truncate, dimensions=request.dimensions, single=single)
    if isinstance(request, ClassifyBody):
        texts, ids, single = _inputs(request.input, "input")
        return PoolingRequest("classify", texts, ids, truncate=truncate, single=single)
    if isinstance(request, RerankBody):
        documents = [_document(d, i) for i, d in enumerate(_texts(request.documents, "documents"))]
        return PoolingRequest("score", pairs=[(request.query, d) for d in documents], truncate=truncate,
                              field="documents")
    firsts, seconds = _texts(request.text_1, "text_1"), _texts(request.text_2, "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise OpenAIError(f"text_1 holds {len(firsts)} texts and text_2 {len(seconds)}: give one text_1 (scored "
                          f"against every text_2) or as many as text_2 (scored pairwise)", param="text_1")
    return PoolingRequest("score", pairs=list(zip(firsts, seconds)), truncate=truncate, field="text_2",
                          single=isinstance(request.text_2, str))


def _usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def encode(request: _Body, result: PoolingResult, model: str, labels: Sequence[str] = ()) -> bytes:
    """The JSON answer to ``request`` (parsed) from the plane's ``result``; ``labels``: a classifier's class names."""
    values, created = result.values, int(time.time())
    if isinstance(request, EmbeddingBody):
        rows = values.float().numpy()
        if request.encoding_format == "base64":  # little-endian float32, as OpenAI's client decodes it
            data = [base64.b64encode(row.astype("<f4").tobytes()).decode() for row in rows]
        else:
            data = rows.tolist()
        body = {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": created, "model": model,
                "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
                "usage": {"prompt_tokens": result.tokens, "total_tokens": result.tokens}}
    elif isinstance(request, RerankBody):
        scores = values.float().reshape(-1).tolist()
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if request.top_n:
            order = order[:request.top_n]
        results = []
        for i in order:
            item = {"index": i, "relevance_score": scores[i]}
            if request.return_documents:
                item["document"] = {"text": _document(request.documents[i], i)}
            results.append(item)
        body = {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": result.tokens},
                "results": results}
    elif isinstance(request, ScoreBody):
        scores = values.float().reshape(-1).tolist()
        body = {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": created, "model": model,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": _usage(result.tokens)}
    else:
        rows = values.float().numpy()
        data = [{"index": i, "label": str(labels[int(np.argmax(row))]) if labels else str(int(np.argmax(row))),
                 "probs": row.tolist(), "num_classes": int(row.shape[-1])} for i, row in enumerate(rows)]
        body = {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": created, "model": model,
                "data": data, "usage": _usage(result.tokens)}
    return json.dumps(body, separators=(",", ":")).encode()
