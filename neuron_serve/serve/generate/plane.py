"""The data plane of one ``task: generate`` model on one replica: prompts in, text deltas out.

It holds the engines' front end (``generation/frontend/processor.py``: checks, admission, grammars,
detokenizing and stop strings) and its tokenizer, turns text and chat messages into
prompt ids, and runs a request's choices as requests of the front end, yielding what
each event adds (its text never half a character, never a stop string). Protocols
(OpenAI, the OIP generate extension) encode those pieces; leaving the stream early, as a
disconnected client does, aborts every sequence of the request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol, Sequence

from ... import metrics
from ...config.schema import ModelConfig, _under
from ...config.generation import GenerationSettings
from ...errors import AdapterNotLoaded, InvalidInput, NeuronServeError, RequestTimeout
from ...generation.frontend.processor import Frontend
from ...generation.frontend.protocol import TokenEvent
from ...generation.sample.sampling import SamplingParams
from ...targets.pjrt import emulated
from ...version import __version__
from ...generation.frontend.mailbox import Mailbox

logger = logging.getLogger("neuron_serve")


@dataclass
class Piece:
    """What one engine event of one choice adds: text, ids and log-probabilities; the reason on the last."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # (token text, its log-probability, the top alternatives as (text, log-probability)) per token
    logprobs: list[tuple[str, float | None, list[tuple[str, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # With prompt logprobs (on the choice's first piece): per prompt token (text, logprob or None, top
    # alternatives or None), and the token ids with their (logprob, top as (id, logprob)) as the engine gave them.
    prompt_logprobs: list[tuple[str, float | None, list[tuple[str, float]] | None]] | None = None
    prompt_scores: list[tuple[int, tuple | None]] | None = None

    def merge(self, later: "Piece") -> None:
        """Fold a later piece of the same choice into this one (events that arrived together)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs, self.prompt_scores = later.prompt_logprobs, later.prompt_scores
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.finish_reason = later.finish_reason
        self.prompt_tokens, self.completion_tokens = later.prompt_tokens, later.completion_tokens


class GenerationFailed(NeuronServeError):
    """A generation step failed for this request (the engine keeps serving the others)."""


class UnknownModel(NeuronServeError):
    """A request names neither this model nor one of its LoRA adapters."""


class Registry(Protocol):
    """Where the server keeps a model's adapters (serve/ray/adapter_registry.py: Ray's key-value store)."""

    async def find(self, name: str) -> tuple[str, int] | None:
        """Adapter ``name``'s (directory, version): a new version is read again; None: not served."""

    async def all(self) -> dict[str, str]:
        """Every adapter: name -> directory."""


class GenerationPlane:
    """One generate model on one replica: its front end, tokenizer, metadata and request runs."""

    def __init__(self, config: ModelConfig, frontend: Frontend, replica: str | None = None, cores: int = 1,
                 base_dir: str | None = None, registry: Registry | None = None) -> None:
        self.config = config
        self.name = config.name
        lora = config.generation.lora if config.generation is not None else None
        self.lora = lora
        # The LoRA adapters the engines serve, name -> directory: the model.yaml's (loaded as they were built),
        # then those a request named that ``registry`` holds (loaded while serving: the load route's).
        self.adapters: dict[str, str] = {n: _under(base_dir, p) for n, p in (lora.lora_modules if lora else {}).items()}
        self._versions: dict[str, int] = dict.fromkeys(self.adapters, 0)  # what the engines hold of each
        self._registry = registry
        self._adapter_lock: asyncio.Lock | None = None
        self.frontend = frontend
        self.tokenizer = frontend.tokenizer
        self.max_model_len = frontend.max_model_len
        self.replica = replica or str(os.getpid())
        self.cores = cores
        self.tensor_parallel_size = int(frontend.info.get("tensor_parallel_size", 1))
        self.memory_per_core: dict = frontend.info.get("memory_per_core", {})
        self.precision: dict = frontend.info.get("precision", {})  # dtype, quantization, kv_cache_dtype
        self._latency = metrics.REQUEST_LATENCY.labels(model=self.name, replica=self.replica)
        self._codes: dict[str, Any] = {}
        self._mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._ready = False

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self._ready = True

    def ready(self) -> bool:
        return self._ready

    def alive(self) -> bool:
        """False once the engines can serve no more (their process has ended)."""
        return self.frontend.alive

    async def stop(self) -> None:
        self._ready = False
        await asyncio.get_running_loop().run_in_executor(None, self.frontend.close)

    def record(self, code: int, seconds: float) -> None:
        """Count one answered request by status, and its latency (to the last byte)."""
        key = str(code)
        child = self._codes.get(key)
        if child is None:
            child = self._codes[key] = metrics.REQUESTS.labels(model=self.name, replica=self.replica, code=key)
        child.inc()
        self._latency.observe(seconds)

    @property
    def compiles(self) -> Any:
        """What tells of each change of the compile state (the engine process; None in process)."""
        engines = self.frontend.engines
        return engines if hasattr(engines, "subscribe") else None

    def compile_state(self) -> dict:
        """The engines' compiled models by state (``compiled``, ``pending``: queued or compiling, ``failed``),
        each failure's reason, and whether the rest compile in the background."""
        state = getattr(self.frontend.engines, "compile_state", None)
        return dict(state) if state is not None else {"compiled": None, "pending": 0, "failed": 0,
                                                      "background": False}

    def metadata(self) -> dict:
        """OIP v2 model metadata: text in, text out (the generate extension's tensors)."""
        settings = self.config.generation or GenerationSettings()
        return {
            "name": self.name,
            "versions": ["1"],
            "platform": f"neuron-serve/{self.config.target}" + ("-emulated" if emulated() else ""),
            "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
            "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}],
            "parameters": {
                "task": "generate",
                "emulated": emulated(),
                "cores": self.cores,
                "tensor_parallel_size": self.tensor_parallel_size,
                "engines": self.cores // self.tensor_parallel_size,
                "max_num_seqs": settings.max_num_seqs,
                "max_model_len": self.max_model_len,
                **self.precision_card(),
                "neuron_serve_version": __version__,
                "compile": self.compile_state(),
                # What the prefill and decode buckets padded, per family (buckets/usage.py), since the replica started.
                "padding": dict(getattr(self.frontend.engines, "padding", {})),
                # What the engines' process holds of host memory: weights (once, whatever the compiled models), cache,
                # each compiled model's code (assembly/host_memory.report).
                **({"host_memory": found} if (found := getattr(self.frontend.engines, "host_memory", {})) else {}),
                # With auto buckets: the lists served now and their switches while serving (generation/compiling/rebucket.py).
                **({"rebucketing": found} if (found := getattr(self.frontend.engines, "rebucketing", {})) else {}),
                **({"lora": self.lora_card()} if self.lora is not None else {}),
            },
        }

    def lora_card(self) -> dict:
        """The LoRA settings a client sees (model metadata; the server app's load route reads
        ``allow_runtime_updates``)."""
        return {"max_loras": self.lora.max_loras, "max_lora_rank": self.lora.max_lora_rank,
                "allow_runtime_updates": self.lora.allow_runtime_updates}

    def model_card(self) -> dict:
        """What ``GET /v1/models`` says of this model beyond its id (vLLM's ``max_model_len``, and its cores)."""
        return {"max_model_len": self.max_model_len, "tensor_parallel_size": self.tensor_parallel_size,
                **self.precision_card(), "compile": self.compile_state()}

    def precision_card(self) -> dict:
        """What the weights and the KV cache hold, in vLLM's names: dtype, quantization (None: full precision),
        kv_cache_dtype (auto: the model's dtype), and with quantization its type and source."""
        keys = ("dtype", "quantization", "quantization_type", "quantized_by", "kv_cache_dtype", "kv_cache_scales")
        return {k: self.precision[k] for k in keys if k in self.precision}

    # -- LoRA adapters ----------------------------------------------------------------------

    async def adapter_for(self, model: str) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: this model itself), loaded into the engines
        when the registry holds it and they do not (or hold another directory under its name); UnknownModel
        when neither this model nor an adapter has that name."""
        if model == self.name:
            return None
        if self.lora is None:
            raise UnknownModel(model)
        held = (self.adapters[model], self._versions[model]) if model in self.adapters else None
        source = await self._registry.find(model) if self._registry is not None else held
        if source is None or source != held:
            await self.load_adapter(model, source)
        return model

    async def adapter_cards(self) -> dict[str, dict]:
        """What /v1/models says of each adapter served (vLLM's ``root``, its directory, and ``parent``, this model)."""
        if self.lora is None:
            return {}
        served = await self._registry.all() if self._registry is not None else dict(self.adapters)
        return {name: {"root": path, "parent": self.name, "max_model_len": self.max_model_len}
                for name, path in served.items()}

    async def load_adapter(self, name: str, source: tuple[str, int] | None) -> None:
        """Serve adapter ``name`` from ``source``, its (directory, version) (None: no longer); raises what loading
        raises (an AdapterError names the file and the reason), UnknownModel for None when it was not served."""
        if self._adapter_lock is None:
            self._adapter_lock = asyncio.Lock()
        async with self._adapter_lock:  # one load at a time; a request that waited finds it loaded
            held = (self.adapters[name], self._versions[name]) if name in self.adapters else None
            if held is not None and held != source:  # unloaded or replaced since: running requests finish on it
                await self._engines_call(self.frontend.engines.unload_adapter, name)
                del self.adapters[name], self._versions[name]
                logger.info("%s: LoRA adapter %r unloaded", self.name, name)
            if source is None:
                raise UnknownModel(name)
            if name not in self.adapters:
                path, version = source
                loop = asyncio.get_running_loop()
                started = loop.time()
                await self._engines_call(self.frontend.engines.load_adapter, name, path)
                self.adapters[name], self._versions[name] = path, version
                metrics.ADAPTER_LOAD_SECONDS.labels(model=self.name, replica=self.replica).observe(loop.time() - started)
                logger.info("%s: LoRA adapter %r loaded from %s", self.name, name, path)

    async def _engines_call(self, call: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, call, *args)

    # -- prompts --------------------------------------------------------------------------

    def _need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise InvalidInput(f"{what} needs a tokenizer, and model {self.name!r} has none; give the model.yaml a "
                               f"tokenizer: directory (or send token ids as the prompt).")
        return self.tokenizer

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Prompt ids of a text (through the tokenizer) or of ids given as they are."""
        if isinstance(prompt, str):
            return list(self._need_tokenizer("a text prompt")(prompt)["input_ids"])
        return [int(t) for t in prompt]

    @property
    def tool_call_parser(self) -> str | None:
        """How the model writes tool calls (model.yaml's generation.tool_call_parser); None: not configured."""
        return self.config.generation.tool_call_parser if self.config.generation is not None else None

    def chat(self, messages: list[dict], tools: list[dict] | None = None, calls: bool = False) -> list[int]:
        """Prompt ids of chat messages, through the tokenizer's chat template (with the assistant's turn opened);
        ``tools`` reach the template as transformers passes them (``tools=``). ``calls``: the request lets the
        model call them (a tool_choice other than "none")."""
        tokenizer = self._need_tokenizer("a chat request")
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise InvalidInput(f"model {self.name!r}'s tokenizer has no chat template; use /v1/completions, or give "
                               f"the tokenizer a chat_template.")
        # A template that never reads `tools` (SmolLM2's, many small models') would drop them without a word: the
        # model would answer, or be forced into a call, without seeing a tool.
        if tools and calls and "tools" not in (template if isinstance(template, str) else " ".join(template)):
            raise InvalidInput(f"tools: model {self.name!r}'s chat template does not show tools to the model, so it "
                               f"cannot call them; send the request without tools (or with tool_choice \"none\"), or "
                               f"give the tokenizer a chat template that renders tools.")
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # a template's own checks (roles in order, ...) raise jinja errors
            raise InvalidInput(f"messages: the chat template refused them: {exc}") from None
        # The template writes the special tokens itself (as vLLM encodes it).
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def check_constraint(self, constraint: Any) -> None:
        """Compile a structured-output constraint (the front end's, once per distinct constraint), so one the
        library refuses is the request's 400."""
        self._need_tokenizer("a structured output")
        self.frontend.compile_grammar(constraint)

    def token_text(self, token: int) -> str:
        """A token's text in logprobs: its share of the output text, which leaves special tokens
        out (a random model can emit its chat template's markers), so that a choice's tokens join
        to its text and ``text_offset`` indexes it."""
        return self.tokenizer.decode([token], skip_special_tokens=True) if self.tokenizer is not None else str(token)

    # -- runs -------------------------------------------------------------------------------

    async def run(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
                  adapter: str | None = None) -> AsyncIterator[list[Piece]]:
        """Generate every (prompt, params) pair as one choice each; yields the pieces that arrived together.

        Every choice ends with a piece carrying its finish reason. Leaving the iteration
        early aborts the choices still running (their slots are free at the next step).
        The replica's route checked readiness; the front end checks each choice.
        """
        if self.tokenizer is None:
            raise InvalidInput(f"model {self.name!r} has no tokenizer, so its output cannot be text; give the "
                               f"model.yaml a tokenizer: directory.")
        mailbox = self._mailbox()
        queue: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()

        def sink_for(index: int):
            def sink(event: TokenEvent) -> None:
                mailbox.post(queue.put_nowait, (index, event))
            return sink

        running: dict[int, str] = {}
        try:
            for index, (prompt, p) in enumerate(zip(prompts, params)):
                running[index] = self.frontend.submit(prompt, p, sink_for(index), adapter=adapter)
            while running:
                arrived = [await queue.get()]
                while not queue.empty():
                    arrived.append(queue.get_nowait())
                pieces: dict[int, Piece] = {}
                for index, event in arrived:
                    piece = self._piece(index, event, params[index], prompts[index])
                    if event.finished:
                        running.pop(index, None)
                    if index in pieces:
                        pieces[index].merge(piece)
                    else:
                        pieces[index] = piece
                yield list(pieces.values())
        finally:
            for rid in running.values():
                self.frontend.abort(rid)

    def _mailbox(self) -> Mailbox:
        """The mailbox of the running loop (a replica serves from one loop; tests may use several)."""
        loop = asyncio.get_running_loop()
        found = self._mailboxes.get(loop)
        if found is None:
            found = self._mailboxes[loop] = Mailbox(loop)
        return found

    def _piece(self, index: int, event: TokenEvent, params: SamplingParams, prompt: list[int]) -> Piece:
        if event.timed_out:
            raise RequestTimeout(event.error)
        if event.error is not None:
            # A refusal at the engine process's submit is answered as the in-process engine's raise is.
            if event.error_status == AdapterNotLoaded.http_status:
                raise AdapterNotLoaded(event.error)
            if event.error_status == InvalidInput.http_status:
                raise InvalidInput(event.error)
            raise GenerationFailed(f"generation failed: {event.error}")
        piece = Piece(index, prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens)
        if event.prompt_logprobs is not None:
            piece.prompt_scores = list(zip(prompt, event.prompt_logprobs))
            piece.prompt_logprobs = [
                (self.token_text(token), None, None) if scored is None else
                (self.token_text(token), scored[0], [(self.token_text(t), lp) for t, lp in scored[1]])
                for token, scored in piece.prompt_scores]
        piece.text = event.text
        if event.token is not None:
            piece.token_ids.append(event.token)
            if params.logprobs is not None:
                # The top n, and the chosen token after them when it is not among them (as OpenAI lists it).
                top = [(self.token_text(t), lp) for t, lp in event.top_logprobs]
                piece.logprobs.append((self.token_text(event.token), event.logprob, top))
        if event.finished:
            piece.finish_reason = event.finish_reason
        return piece


_current: GenerationPlane | None = None


def current() -> GenerationPlane | None:
    """The generation plane of this process's replica."""
    return _current


def set_current(plane: GenerationPlane | None) -> None:
    global _current
    _current = plane
