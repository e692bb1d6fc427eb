"""Plain Ray Serve serving a causal LM: eager ``model.generate`` per request, OpenAI-style.

    python -m bench.peers.ray_generate_app --model deployments/llm --port 18830

The generation peer of bench/generate_http.py: one replica behind Ray Serve's default HTTP
proxy, answering ``POST /v1/completions`` (a text prompt or a list of token ids; ``stream``
with ``stream_options.include_usage``; ``max_tokens``; ``temperature`` 0 or absent is
greedy, above 0 samples; vLLM's ``ignore_eos``) and ``GET /v1/models``. Each request runs
its own ``generate`` on a thread of its own (no batching across requests, as a first Ray
Serve deployment of an LLM would; concurrent requests share torch's default threads, one per
core, with nothing capping them); a streamer hands every new token to the event loop,
which sends it as one SSE chunk once its text is complete (tokenizers' ``DecodeStream``,
as ``transformers serve`` does). ``ignore_eos`` makes the end-of-text id one the model
cannot produce (the vocabulary size), so the request runs to ``max_tokens``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from bench.peers.ray_app import configure_ingress

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_ONGOING = 64  # more than the benchmark's highest concurrency: every request runs at once, none waits in Serve


class Cancelled(Exception):
    """Raised in the streamer to stop a generate() whose client went away."""


class TokenStreamer:
    """A generate() streamer: each new token id onto an asyncio queue (the first put() is the prompt)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue = loop, queue
        self.cancelled = threading.Event()
        self._prompt = True

    def put(self, value) -> None:
        if self.cancelled.is_set():
            raise Cancelled
        if self._prompt:
            self._prompt = False
            return
        for token in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, token)

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


def chunk(request_id: str, model: str, text: str = "", finish: str | None = None, usage: dict | None = None) -> bytes:
    body = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n".encode()


class Generator:
    """The model, its tokenizer and the thread pool its generate() calls run on."""

    def __init__(self, model_dir: str, name: str) -> None:
        import torch  # noqa: PLC0415
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

        torch.set_grad_enabled(False)
        self.name = name
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.lm = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
        self.pool = ThreadPoolExecutor(MAX_ONGOING, thread_name_prefix="generate")

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        raise ValueError("prompt: give one string or one list of token ids")

    async def tokens(self, body: dict):
        """(prompt length, async iterator of new token ids) of one request."""
        import torch  # noqa: PLC0415

        ids = self.prompt_ids(body.get("prompt"))
        temperature = body.get("temperature")
        kwargs = {"max_new_tokens": int(body.get("max_tokens") or 16), "do_sample": bool(temperature)}
        if temperature:
            kwargs.update(temperature=float(temperature), top_p=float(body.get("top_p") or 1.0))
        if body.get("ignore_eos"):
            kwargs["eos_token_id"] = self.lm.config.vocab_size  # an id the model never produces
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        streamer = TokenStreamer(loop, queue)

        def run() -> None:
            try:
                self.lm.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 streamer=streamer, pad_token_id=self.tokenizer.pad_token_id, **kwargs)
            except Cancelled:
                pass
            except Exception as exc:  # noqa: BLE001 - the stream reports it
                loop.call_soon_threadsafe(queue.put_nowait, exc)
                streamer.end()

        future = loop.run_in_executor(self.pool, run)

        async def new_tokens():
            try:
                while (token := await queue.get()) is not None:
                    if isinstance(token, Exception):
                        raise token
                    yield token
            finally:
                streamer.cancelled.set()
                await asyncio.shield(future)

        return len(ids), kwargs["max_new_tokens"], new_tokens()

    async def complete(self, body: dict):
        """The SSE stream (``stream``) or the completion object of one /v1/completions request."""
        from tokenizers.decoders import DecodeStream  # noqa: PLC0415

        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompt_len, limit, stream = await self.tokens(body)
        decoder, count, texts = DecodeStream([], skip_special_tokens=True), 0, []

        def usage() -> dict:
            return {"prompt_tokens": prompt_len, "completion_tokens": count, "total_tokens": prompt_len + count}

        if not body.get("stream"):
            async for token in stream:
                count += 1
                texts.append(decoder.step(self.tokenizer._tokenizer, token) or "")
            return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.name,
                    "choices": [{"index": 0, "text": "".join(texts), "logprobs": None,
                                 "finish_reason": "length" if count >= limit else "stop"}], "usage": usage()}

        async def events():
            nonlocal count
            async for token in stream:
                count += 1
                text = decoder.step(self.tokenizer._tokenizer, token)
                if text:
                    yield chunk(request_id, self.name, text)
            yield chunk(request_id, self.name, finish="length" if count >= limit else "stop")
            if (body.get("stream_options") or {}).get("include_usage"):
                final = json.dumps({"id": request_id, "object": "text_completion", "created": int(time.time()),
                                    "model": self.name, "choices": [], "usage": usage()})
                yield f"data: {final}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return events()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=os.path.join(ROOT, "deployments", "llm"), help="save_pretrained directory")
    parser.add_argument("--name", default="llm", help="the model's name in the API")
    parser.add_argument("--port", type=int, default=18830)
    args = parser.parse_args()
    configure_ingress(args.port, haproxy=False)

    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415
    from starlette.requests import Request  # noqa: PLC0415
    from starlette.responses import JSONResponse, Response, StreamingResponse  # noqa: PLC0415

    @serve.deployment(num_replicas=1, max_ongoing_requests=MAX_ONGOING, ray_actor_options={"num_cpus": 0})
    class LLM:
        def __init__(self, model_dir: str, name: str) -> None:
            self.generator = Generator(model_dir, name)

        async def __call__(self, request: Request) -> Response:
            path = request.url.path.rstrip("/")
            if request.method == "GET" and path.endswith("/v1/models"):
                return JSONResponse({"object": "list", "data": [{"id": self.generator.name, "object": "model",
                                                                 "owned_by": "bench"}]})
            if request.method != "POST" or not path.endswith("/v1/completions"):
                return JSONResponse({"error": {"message": f"no route {request.method} {path}"}}, status_code=404)
            try:
                result = await self.generator.complete(await request.json())
            except (ValueError, TypeError) as exc:
                return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error"}}, status_code=400)
            if isinstance(result, dict):
                return JSONResponse(result)
            return StreamingResponse(result, media_type="text/event-stream")

    ray.init(include_dashboard=False, logging_level="WARNING", runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(LLM.bind(os.path.abspath(args.model), args.name), name="llm", route_prefix="/")
    print("ready", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
