"""The server app's OpenAI routes at ``/v1``: decode a request once, find the model it names, forward it.

``/v1/completions`` and ``/v1/chat/completions`` decode and check the body here (the
JSON once; a model that is not served is a 404 naming the served ones, as OpenAI
answers, before its other fields are looked at); a replica of that generate model runs
the decoded request and encodes its answer (``serve/generate/answers.py``), whose bytes
are relayed as they come. A client that leaves cancels the call, which aborts its
sequences on the replica.
"""

from __future__ import annotations

import asyncio

from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from .base import read_body
from .disconnect import ClientGone, unless_disconnected
from .model_lookup import States, check_ready, error_response, unavailable
from ..protocols import openai

class AdapterControl(Protocol):
    """The server's LoRA adapters (serve/ray/applications.py keeps them in Ray's key-value store)."""

    async def entries(self) -> dict[str, dict]:
        """Every adapter: name -> ``{"base": its model, "path": its directory}``."""

    async def entry(self, name: str) -> dict | None:
        """Adapter ``name``'s ``{"base", "path"}``, or None (one read: a request's route looks it up)."""

    async def load(self, base: str, name: str, path: str | None) -> None:
        """A replica of ``base`` loads adapter ``name`` from ``path`` (None: drops it), raising what it refused
        with; the entry is recorded (or removed) after it."""


def requested_model(data: dict) -> str:
    """The ``model`` of a decoded OpenAI request body."""
    if "model" not in data:
        raise openai.OpenAIError("model: Field required (the name of a served model; GET /v1/models lists them)",
                                 param="model")
    if not isinstance(data["model"], str):
        raise openai.OpenAIError("model: Input should be a valid string", param="model")
    return data["model"]


async def _relay(rest: Any) -> AsyncIterator[bytes]:
    try:
        async for chunk in rest:
            yield chunk
    finally:  # the client left (or the stream ended): a running call is cancelled, its sequences aborted
        rest.cancel()


def install(app: FastAPI, model_states: States, generate_states: States,
            forward: Callable[..., Awaitable[Any]],
            describe: Callable[[str], Awaitable[dict]] | None = None, pooling_states: States | None = None,
            adapters: AdapterControl | None = None) -> None:
    """Add ``GET /v1/models`` and the two generation routes to the server app; ``describe(name)`` gives a
    model's fields beyond its id. The models listed are the generate and the pooling ones (``pooling_states``),
    those OpenAI's API serves, and each LoRA adapter of a generate model (``adapters``: it names its base as
    ``parent``), which a request names as its model; ``forward(model, kind, request, adapter)`` runs one."""

    async def listed() -> dict[str, str]:
        return {**(await generate_states()), **(await pooling_states() if pooling_states is not None else {})}

    async def adapter_cards(states: dict[str, str]) -> dict[str, dict]:
        """Each adapter of a ready generate model: its /v1/models entry's fields (vLLM's root and parent)."""
        found = await adapters.entries() if adapters is not None else {}
        return {name: {"root": entry["path"], "parent": entry["base"]}
                for name, entry in sorted(found.items()) if states.get(entry["base"]) == "ready"}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        states = await listed()
        names = sorted(n for n, s in states.items() if s == "ready")
        details = dict(zip(names, await asyncio.gather(*(describe(n) for n in names)))) if describe else {}
        cards = await adapter_cards(states)
        for name, card in cards.items():  # vLLM lists an adapter with its base's max_model_len
            details[name] = {**card, **{k: v for k, v in details.get(card["parent"], {}).items()
                                        if k == "max_model_len"}}
        return JSONResponse(openai.models_list(names + list(cards), details))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        states = await listed()
        cards = await adapter_cards(states)
        if model_id in cards:
            return JSONResponse(openai.model_card(model_id, cards[model_id]))
        if states.get(model_id) != "ready":
            served = sorted(n for n, s in states.items() if s == "ready") + list(cards)
            return error_response(openai.unknown_model(model_id, served))
        return JSONResponse(openai.model_card(model_id, await describe(model_id) if describe else None))

    async def answer(request: Request, kind: str) -> Response:
        adapter = None
        try:
            data = openai.json_object(await read_body(request))
            name = requested_model(data)
            states = await generate_states()
            if name not in states and adapters is not None:
                entry = await adapters.entry(name)
                if entry is not None and entry["base"] in states:
                    adapter, name = name, entry["base"]
            # The names a 404 lists (the adapters read from Ray's key-value store) only for that 404.
            served = [] if name in states else sorted(states) + sorted(await adapter_cards(states))
            await check_ready(name, states, served, (
                (pooling_states, f"{name!r} is a pooling model, task embed, score or classify: "
                                 f"POST /v1/embeddings, /v1/rerank, /v1/score or /classify"),
                (model_states, f"{name!r} is a task: infer model: POST /v2/models/{name}/infer")))
            decoded = openai.validate(kind, data)
        except openai.OpenAIError as exc:
            return error_response(exc)
        except Exception as exc:  # noqa: BLE001 - 413 and the like, as OpenAI error objects
            status, error = openai.error_of(exc)
            return JSONResponse(error, status_code=status)
        call = await forward(name, kind, decoded, adapter)
        try:
            status, headers, streamed = await unless_disconnected(request, call.__anext__())
            if not streamed:
                content = await unless_disconnected(request, call.__anext__())
                return Response(content, status_code=status, headers=headers)
        except ClientGone:
            call.cancel()
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - the replica went away mid-call (stopped, crashed)
            return unavailable(name, exc)
        return StreamingResponse(_relay(call), status_code=status, headers=headers)

    async def completions(request: Request) -> Response:
        return await answer(request, "completions")

    async def chat(request: Request) -> Response:
        return await answer(request, "chat")

    app.add_api_route("/v1/completions", completions, methods=["POST"], include_in_schema=False)
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"], include_in_schema=False)
    if adapters is None or describe is None:
        return

    async def updatable(data: dict) -> str:
        """The generate model whose adapters a load or unload changes: the one with
        generation.lora.allow_runtime_updates, or the body's ``model`` among several."""
        states = await generate_states()
        ready = sorted(n for n, s in states.items() if s == "ready")
        cards = dict(zip(ready, await asyncio.gather(*(describe(n) for n in ready))))
        allowed = [n for n, card in cards.items() if (card.get("lora") or {}).get("allow_runtime_updates")]
        if not allowed:
            raise openai.OpenAIError("LoRA adapters are loaded and unloaded while serving only for a generate model "
                                     "whose model.yaml sets generation.lora.allow_runtime_updates: true", 404,
                                     code="not_found")
        if "model" in data:
            if data["model"] not in allowed:
                raise openai.OpenAIError(f"model: {data['model']!r} does not take adapters while serving; these do: "
                                         f"{', '.join(allowed)}", 400, "model")
            return data["model"]
        if len(allowed) > 1:
            raise openai.OpenAIError(f"model: Field required: several models take adapters while serving "
                                     f"({', '.join(allowed)}); name the one this adapter is of", 400, "model")
        return allowed[0]

    def only(data: dict, *fields: str) -> None:
        """A field these routes do not know is refused, not ignored."""
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise openai.OpenAIError(f"{unknown[0]}: Extra inputs are not permitted", 400, unknown[0])

    def field(data: dict, name: str) -> str:
        value = data.get(name)
        if not isinstance(value, str) or not value:
            raise openai.OpenAIError(f"{name}: a non-empty string is required", 400, name)
        return value

    async def load_adapter(request: Request) -> Response:
        # vLLM's body: {"lora_name", "lora_path", "load_inplace"}; its answers, in plain text on success.
        try:
            data = openai.json_object(await read_body(request))
            base = await updatable(data)
            name, path = field(data, "lora_name"), field(data, "lora_path")
            only(data, "lora_name", "lora_path", "load_inplace", "model")
            if name in await model_states():
                raise openai.OpenAIError(f"lora_name: {name!r} is the name of a served model; give the adapter "
                                         f"another", 400, "lora_name")
            held = await adapters.entry(name)
            if held is not None and (held["base"] != base or data.get("load_inplace") is not True):
                raise openai.OpenAIError(f"The lora adapter '{name}' has already been loaded. (load_inplace: true "
                                         f"replaces it)", 400, "lora_name")
            await adapters.load(base, name, path)
        except openai.OpenAIError as exc:
            return error_response(exc)
        except Exception as exc:  # noqa: BLE001 - the adapter's own refusal (AdapterError: file and reason), ...
            status, error = openai.error_of(exc)
            return JSONResponse(error, status_code=status)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_adapter(request: Request) -> Response:
        try:
            data = openai.json_object(await read_body(request))
            base = await updatable(data)
            name = field(data, "lora_name")
            only(data, "lora_name", "model")
            held = await adapters.entry(name)
            if held is None or held["base"] != base:
                raise openai.OpenAIError(f"The lora adapter '{name}' cannot be found.", 404, "lora_name",
                                         "model_not_found")
            await adapters.load(base, name, None)
        except openai.OpenAIError as exc:
            return error_response(exc)
        except Exception as exc:  # noqa: BLE001
            status, error = openai.error_of(exc)
            return JSONResponse(error, status_code=status)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    app.add_api_route("/v1/load_lora_adapter", load_adapter, methods=["POST"], include_in_schema=False)
    app.add_api_route("/v1/unload_lora_adapter", unload_adapter, methods=["POST"], include_in_schema=False)
