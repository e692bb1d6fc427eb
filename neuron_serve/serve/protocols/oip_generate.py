"""The Open Inference Protocol's generate extension (Triton's and KServe's), as a codec.

``POST /v2/models/{name}/generate`` takes ``{"id"?, "text_input", "parameters"?}`` and
answers ``{"id"?, "model_name", "model_version", "text_output", "details"}``;
``/generate_stream`` sends the same object per text delta as server-sent events.
``parameters`` take the engine's sampling names (vLLM's, as KServe's runtimes do).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...errors import InvalidInput
from ...generation.sample.sampling import MAX_LOGPROBS, SamplingParams
from .openai import json_object

DEFAULT_MAX_TOKENS = 16  # as /v1/completions: a request without max_tokens is answered quickly


class GenerateParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(DEFAULT_MAX_TOKENS, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    text_input: str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)


def parse(body: bytes) -> GenerateRequest:
    """The request decoded and checked; errors name the field."""
    data = json_object(body, InvalidInput)
    try:
        return GenerateRequest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            raise InvalidInput(f"{where}: unknown field; a generate request has id, text_input and parameters "
                               f"({', '.join(GenerateParameters.model_fields)})") from None
        raise InvalidInput(f"{where}: {first['msg']}") from None


def sampling(request: GenerateRequest) -> SamplingParams:
    p = request.parameters
    return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                          min_p=p.min_p, repetition_penalty=p.repetition_penalty,
                          presence_penalty=p.presence_penalty,
                          frequency_penalty=p.frequency_penalty, seed=p.seed,
                          stop=tuple([p.stop] if isinstance(p.stop, str) else p.stop),
                          stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos, logprobs=p.logprobs)


def response(model: str, request: GenerateRequest, piece: Any) -> dict:
    """The answer (or one streamed delta) for ``piece`` (a GenerationPlane Piece)."""
    body: dict[str, Any] = {"model_name": model, "model_version": "1", "text_output": piece.text}
    if request.id is not None:
        body["id"] = request.id
    details: dict[str, Any] = {"finish_reason": piece.finish_reason, "prompt_tokens": piece.prompt_tokens,
                               "completion_tokens": piece.completion_tokens}
    if request.parameters.logprobs is not None:
        details["logprobs"] = [{"token": t, "logprob": lp, "top_logprobs": [{"token": a, "logprob": b} for a, b in top]}
                               for t, lp, top in piece.logprobs]
    body["details"] = details
    return body
