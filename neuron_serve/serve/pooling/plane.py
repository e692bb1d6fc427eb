"""The pooling plane of one model (task: embed, score, classify): a `PoolingRequest` in, a `PoolingResult` out.

It is built on the model's infer data plane (`ModelDataPlane`), which holds the compiled
model on the cores (its runner) and metrics, and still serves OIP v2 for the same model
on its own request queue. For each request it tokenizes the inputs on the host (`Tokens`),
refuses what the model cannot take (naming the field) and queues them on its batcher,
which takes requests into a batch while their tokens fit ``batching.max_batch_tokens``;
a batch's texts, of every client, are packed into compiled rows (pooling/packing.py: one
text a row when the model is not packed) and run over the cores round-robin; then it
cuts embeddings to the asked dimensions. The wire formats are codecs around it (`serve/protocols/openai_pooling.py`).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ...buckets import usage as bucket_usage
from ...config.schema import ModelConfig
from ...errors import InvalidInput
from ...pooling.spec import PoolingSpec
from ...pooling import packing
from ...pooling.tokens import THREAD_CHARS, Row, Tokens
from ...runtime.request_queue import DynamicBatcher
from ..infer import triton as triton_ext
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
        batching = config.batching
        # Batches by tokens (text-embeddings-inference's max-batch-tokens), the requests' texts packed into rows
        # as each batch runs; the data plane's own batcher still serves OIP v2 requests of token tensors. One batch
        # a core: while both run, the next fills with more texts, which pack into fewer rows (in process, 16 clients
        # of one text: 1.28x the texts' tokens computed instead of 1.46x with two a core, requests/s alike).
        self.max_batch_tokens = batching.max_batch_tokens or batching.max_batch_size * spec.length_buckets[-1]
        self._batcher = DynamicBatcher(self._run_batch, max_batch_size=self.max_batch_tokens,
                                       max_queue_delay_s=batching.max_queue_delay_ms / 1000,
                                       max_queue_size=batching.max_queue_size,
                                       request_timeout_s=batching.request_timeout_s,
                                       max_concurrent_batches=len(data.runner.cores))

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        self.data.start()
        self._batcher.start()

    async def stop(self) -> None:
        await self._batcher.stop(drain=True)
        await self.data.stop()
        self.usage.save()
        self._tokenizing.shutdown(wait=False)

    def ready(self) -> bool:
        return self.data.ready()

    def admit(self) -> None:
        """Raise Overloaded now when the batcher would refuse a request (full, or stopping)."""
        self._batcher.admit()

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
        """The rows through the batcher, with other requests' (see `_run_batch`); (outputs in row order, tokens of
        padding counted for them)."""
        return await self._batcher.submit((rows, call.times), rows=sum(len(r.ids) for r in rows))

    async def _run_batch(self, items: list[tuple[list[Row], triton_ext.RequestTimes]]) -> list:
        """A batch of requests' texts packed into rows of the compiled lengths (pooling/packing.py: the cheapest
        packing by what the compiled calls cost, one text a row for a padded graph) and run over the cores; each
        request's outputs and its texts' share of the padding."""
        started = time.perf_counter()
        texts = [row for rows, _ in items for row in rows]
        self.data.observer.batch(len(texts), [started - times.decoded for _, times in items])
        inline = await self.data.lone.alone(len(items))
        runner = self.data.runner
        lengths = [len(row.ids) for row in texts]
        compiled = [sizes[0] for sizes in runner.model.spec.sizes]  # the lengths compiled now, smallest first

        def cost(bucket: int, count: int) -> float:
            return sum(runner.costs[bucket][size] for size in runner.plan(bucket, count))

        packings = packing.plan(lengths, compiled, cost, self.spec.segments)
        names = self.spec.input_names
        ids, types = [row.ids for row in texts], [row.type_ids for row in texts]
        results = await runner.infer([packing.tensors(p, ids, types, names, self.spec.pad_token_id)
                                      for p in packings], inline=inline)
        ran = time.perf_counter()
        for _, times in items:
            times.started, times.ran = started, ran
        failed = next((r for r in results if isinstance(r, Exception)), None)
        if failed is not None:
            return [failed] * len(items)
        self.data.observer.executed()
        first = results[0][0]
        outputs = torch.empty((len(texts), first.shape[-1]), dtype=first.dtype)
        padded = [0] * len(texts)
        for packed, result in zip(packings, results):
            values = result[0] if result[0].dim() == 3 else result[0][:, None]  # a padded graph: one text a row
            for r, row in enumerate(packed.rows):
                outputs[list(row)] = values[r, :len(row)]
            for i, share in packing.padding_shares(packed, lengths).items():
                padded[i] = share
                self.metrics.bucket_work(self.usage.record("length", lengths[i], packed.length, share), lengths[i],
                                         share)
        if self.rebucket is not None:
            self.rebucket.observe()
        answers, at = [], 0
        for rows, _ in items:
            answers.append((outputs[at:at + len(rows)], sum(padded[at:at + len(rows)])))
            at += len(rows)
        return answers


_current: PoolingPlane | None = None


def current() -> PoolingPlane | None:
    """The pooling plane of this process's replica."""
    return _current


def set_current(plane: PoolingPlane | None) -> None:
    global _current
    _current = plane
