"""The pooling plane of one model (task: embed, score, classify): a `PoolingRequest` in, a `PoolingResult` out.

It is built on the model's infer data plane (`ModelDataPlane`), which holds the compiled
model on the cores, its request queue and metrics, and still serves OIP v2 for the same
model. For each request it tokenizes the inputs on the host (`Tokens`), refuses what the
model cannot take (naming the field), groups the inputs by the length bucket that holds
them and hands each group to the request queue, where rows of every client's requests
are batched together and run over the cores round-robin; then it cuts embeddings to the
asked dimensions. The wire formats are codecs around it (`serve/protocols/openai_pooling.py`).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ...buckets import usage as bucket_usage
from ...config.schema import ModelConfig
from ...errors import InvalidInput
from ...pooling.spec import PoolingSpec
from ...pooling.tokens import THREAD_CHARS, Row, Tokens, tensors
from ..infer.plane import InferCall, ModelDataPlane
from ..protocols.pooling import PoolingRequest, PoolingResult
from .observer import PoolingMetrics


class PoolingPlane:
    """One pooling model on one replica: text to vectors or scores, through the infer plane's queue and cores."""

    def __init__(self, config: ModelConfig, data: ModelDataPlane, tokens: Tokens, spec: PoolingSpec) -> None:
        self.config = config
        self.name = config.name
        self.data = data
        self.tokens = tokens
        self.spec = spec
        self.metrics = PoolingMetrics(self.name, data.replica, data.observer.deferred)
        # The lengths asked for and what the length buckets pad of them (buckets/usage.py): counted, kept in the
        # compile cache for `neuron-serve buckets`, and summed up in the metadata.
        self.usage = bucket_usage.for_model(self.name, data.replica)
        self.rebucket = None  # a pooling/rebucket.LengthRebucketing when pooling.length_buckets is auto
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")  # requests of much text

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        self.data.start()

    async def stop(self) -> None:
        await self.data.stop()
        self.usage.save()
        self._tokenizing.shutdown(wait=False)

    def ready(self) -> bool:
        return self.data.ready()

    def metadata(self) -> dict:
        """OIP v2 model metadata: the compiled model's tensors, and the pooling settings in ``parameters``
        (the data plane's, given them when the replica built it, so gRPC's metadata holds them too)."""
        found = self.data.metadata()
        found["parameters"]["padding"] = self.usage.summary()
        if self.rebucket is not None:
            found["parameters"]["rebucketing"] = self.rebucket.describe()
        return found

    def switch(self, model, spec: PoolingSpec) -> None:
        """Serve ``model``, compiled over ``spec``'s length buckets, from now on (on the compile queue's thread:
        loading compiles). Requests already grouped by the old buckets run on the new model's bucket that holds
        them."""
        self.data.grow(model)
        self.data.parameters.update(spec.describe())
        self.spec = spec
        self.tokens.spec = spec

    def model_card(self) -> dict:
        """What ``GET /v1/models`` says of this model beyond its id."""
        return {"max_model_len": self.spec.max_model_len, "task": self.spec.task, "dtype": self.spec.dtype}

    # -- requests -------------------------------------------------------------------

    async def pool(self, request: PoolingRequest, call: InferCall) -> PoolingResult:
        """Tokenize, check, batch and run ``request``'s inputs; its embeddings, scores or class probabilities."""
        spec = self.spec
        if request.kind != spec.task and not (request.kind == "score" and spec.task == "embed"):
            raise InvalidInput(f"model {self.name!r} is a task: {spec.task} model; it cannot {request.kind}")
        truncate = self._truncation(request.truncate)
        dimensions = self._dimensions(request.dimensions) if request.kind == "embed" else None
        if request.kind == "score" and spec.task == "embed":
            return await self._cosine(request, truncate, call)
        rows = await self._rows(request, truncate)
        call.times.decoded = time.perf_counter()  # Triton's compute_input: the request's tokenization
        values, padded = await self._run(rows, call)
        if dimensions is not None:
            values = values[:, :dimensions]
            if spec.normalize:  # as vLLM and OpenAI answer: a shortened embedding is unit length again
                values = torch.nn.functional.normalize(values, dim=-1)
        elif request.kind == "score":
            values = values.reshape(-1)
        call.rows = len(rows)
        return PoolingResult(values, sum(len(r.ids) for r in rows), padded)

    async def _cosine(self, request: PoolingRequest, truncate: int | None, call: InferCall) -> PoolingResult:
        """Scores of an embedding model: the cosine similarity of each pair's embeddings (as vLLM scores them)."""
        texts = list(dict.fromkeys(t for pair in request.pairs for t in pair))
        place = {t: i for i, t in enumerate(texts)}
        embedded = PoolingRequest("embed", texts=texts, truncate=request.truncate, field=request.field)
        rows = await self._rows(embedded, truncate)
        call.times.decoded = time.perf_counter()
        vectors, padded = await self._run(rows, call)
        vectors = torch.nn.functional.normalize(vectors.float(), dim=-1)
        first = vectors[[place[q] for q, _ in request.pairs]]
        second = vectors[[place[d] for _, d in request.pairs]]
        call.rows = len(rows)
        tokens = {t: len(r.ids) for t, r in zip(texts, rows)}
        return PoolingResult((first * second).sum(-1), sum(tokens[q] + tokens[d] for q, d in request.pairs), padded)

    def _truncation(self, truncate: int | None) -> int | None:
        limit = self.spec.max_model_len
        if truncate is None:
            return None
        if truncate == -1:
            return limit
        if truncate == 0:
            raise InvalidInput("truncate_prompt_tokens: 0 keeps nothing; give at least 1, -1 for the model's "
                               f"maximum ({limit}), or leave it out to refuse longer inputs", "truncate_prompt_tokens")
        if truncate > limit:
            raise InvalidInput(f"truncate_prompt_tokens: {truncate} is more than this model's maximum of {limit} "
                               f"tokens (pooling.max_model_len); give at most {limit}, or -1 for that",
                               "truncate_prompt_tokens")
        return truncate

    def _dimensions(self, asked: int | None) -> int | None:
        """The embedding's dimensions to answer (None: all of them); refuses what the model cannot give."""
        spec = self.spec
        if asked is None:
            return spec.dimensions
        if asked > spec.hidden_size:
            raise InvalidInput(f"dimensions: {asked} is more than this model's {spec.hidden_size}; give at most "
                               f"{spec.hidden_size}", "dimensions")
        if not spec.is_matryoshka:
            raise InvalidInput(f"dimensions: model {self.name!r} is not a Matryoshka model (pooling.is_matryoshka), "
                               f"so its embeddings cannot be shortened; remove dimensions", "dimensions")
        if spec.matryoshka_dimensions is not None and asked not in spec.matryoshka_dimensions:
            raise InvalidInput(f"dimensions: {asked} is not one of this model's Matryoshka dimensions "
                               f"{list(spec.matryoshka_dimensions)}; give one of them", "dimensions")
        return asked

    async def _rows(self, request: PoolingRequest, truncate: int | None) -> list[Row]:
        """The request's inputs as token rows: text tokenized (on a thread when there is much of it), ids checked."""
        if request.token_ids is not None:
            vocab = self.spec.vocab_size
            for i, ids in enumerate(request.token_ids):
                bad = next((j for j, t in enumerate(ids) if not 0 <= t < vocab), None)
                if bad is not None:
                    raise InvalidInput(f"{request.name(i)}[{bad}]: token id {ids[bad]} is not in this model's "
                                       f"vocabulary (0 to {vocab - 1})", request.field)
            rows = self.tokens.ids(request.token_ids, truncate)
        else:
            inputs = request.texts if request.texts is not None else request.pairs
            encode = self.tokens.texts if request.texts is not None else self.tokens.pairs
            if Tokens.characters(inputs) > THREAD_CHARS:
                rows = await asyncio.get_running_loop().run_in_executor(self._tokenizing, encode, inputs, truncate)
            else:
                rows = encode(inputs, truncate)
        self._check(rows, request)
        return rows

    def _check(self, rows: list[Row], request: PoolingRequest) -> None:
        limit = self.spec.max_model_len
        for i, row in enumerate(rows):
            if not row.ids:
                raise InvalidInput(f"{request.name(i)} has no tokens; give a non-empty text or token list",
                                   request.field)
            if len(row.ids) > limit:
                what = f"{request.name(i)} with its query" if request.field == "documents" else \
                    f"{request.name(i)} with its text_1" if request.pairs is not None else request.name(i)
                raise InvalidInput(f"{what} is {len(row.ids)} tokens, more than this model's maximum of {limit} "
                                   f"(pooling.max_model_len, its longest length bucket); shorten it, or set "
                                   f"truncate_prompt_tokens (at most {limit}, or -1 for that) to cut it",
                                   request.field)

    async def _run(self, rows: list[Row], call: InferCall) -> tuple[torch.Tensor, int]:
        """Every row through the request queue, grouped by length bucket; (outputs in row order, tokens padded)."""
        buckets = self.spec.length_buckets
        groups: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault(bisect.bisect_left(buckets, len(row.ids)), []).append(i)
        runs = [self.data.run(tensors([rows[i] for i in members], buckets[b], self.spec), call)
                for b, members in groups.items()]
        # One group (the usual case) is awaited directly: gather would wrap it in a task.
        outputs = [await runs[0]] if len(runs) == 1 else await asyncio.gather(*runs)
        padded = sum(buckets[b] * len(m) for b, m in groups.items()) - sum(len(r.ids) for r in rows)
        self._used(rows, groups, buckets)
        if len(groups) == 1:
            return outputs[0][0], padded
        first = outputs[0][0]
        joined = torch.empty((len(rows), *first.shape[1:]), dtype=first.dtype)
        for members, output in zip(groups.values(), outputs):
            joined[members] = output[0]
        return joined, padded

    def _used(self, rows: list[Row], groups: dict[int, list[int]], buckets: tuple[int, ...]) -> None:
        """Each input's length recorded against the bucket that ran it, and counted (with the answer's metrics)."""
        for b, members in groups.items():
            bucket = buckets[b]
            for i in members:
                size = len(rows[i].ids)
                self.metrics.bucket_work(self.usage.record("length", size, bucket), size, bucket - size)
        if self.rebucket is not None:
            self.rebucket.observe()


_current: PoolingPlane | None = None


def current() -> PoolingPlane | None:
    """The pooling plane of this process's replica."""
    return _current


def set_current(plane: PoolingPlane | None) -> None:
    global _current
    _current = plane
