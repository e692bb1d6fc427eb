"""The generation engine's Prometheus metrics per engine, queued by a step and applied together."""

from __future__ import annotations

import time
from typing import Any, Callable

from ... import metrics
from ..runner.shapes import Shape


class EngineMetrics:
    """The engine's metric children, looked up once, and the updates a step leaves to apply.

    A step makes several updates a token (a latency observed, a token counted), each a
    locked write to a shared file in Prometheus' multiprocess mode: about 80 at 32 running
    sequences, 0.2 ms of the engine thread's Python a step. They are queued as the step
    runs and applied by :meth:`flush` with the step's events, while the next step's model
    call computes, so they leave the step's critical path.
    """

    def __init__(self, model: str, replica: str) -> None:
        labels = {"model_name": model, "replica": replica}
        self.ttft = metrics.TIME_TO_FIRST_TOKEN.labels(**labels)
        self.tpot = metrics.TIME_PER_OUTPUT_TOKEN.labels(**labels)
        self.itl = metrics.INTER_TOKEN_LATENCY.labels(**labels)
        self.step_prompt = metrics.ITERATION_TOKENS.labels(**labels, kind="prompt")
        self.step_decode = metrics.ITERATION_TOKENS.labels(**labels, kind="decode")
        self.chunked_steps = metrics.CHUNKED_STEPS.labels(**labels)
        self.e2e = metrics.E2E_REQUEST_LATENCY.labels(**labels)
        self.queue = metrics.REQUEST_QUEUE_TIME.labels(**labels)
        self.step_core_wait = metrics.STEP_CORE_WAIT.labels(**labels)
        self.step_host = metrics.STEP_HOST.labels(**labels)
        self.decodes_ahead = metrics.DECODES_AHEAD.labels(**labels)
        self.ahead_dropped = metrics.DECODES_AHEAD_DROPPED.labels(**labels)
        self.prompt_tokens = metrics.PROMPT_TOKENS.labels(**labels)
        self.generation_tokens = metrics.GENERATION_TOKENS.labels(**labels)
        self.prefix_queries = metrics.PREFIX_CACHE_QUERIES.labels(**labels)
        self.prefix_hits = metrics.PREFIX_CACHE_HITS.labels(**labels)
        self.drafts = metrics.SPEC_DRAFTS.labels(**labels)
        self.draft_tokens = metrics.SPEC_DRAFT_TOKENS.labels(**labels)
        self.accepted_tokens = metrics.SPEC_ACCEPTED_TOKENS.labels(**labels)
        self._accepted_at: dict[int, Any] = {}
        self.running = metrics.REQUESTS_RUNNING.labels(**labels)
        self.waiting = metrics.REQUESTS_WAITING.labels(**labels)
        self.usage = metrics.KV_SLOTS_USAGE.labels(**labels)
        # Exported at 0 for vLLM's dashboards: a sequence keeps its slot to its end, never preempted.
        metrics.PREEMPTIONS.labels(**labels)
        self.labels = labels
        self.core_memory = {kind: metrics.CORE_MEMORY.labels(**labels, kind=kind) for kind in ("weights", "kv_cache")}
        self._steps: dict[str, Any] = {}
        # Every reason exported at 0 from the start (as vLLM does), so the first of each is a visible increase.
        self._finished: dict[str, Any] = {reason: metrics.REQUEST_SUCCESS.labels(**labels, finished_reason=reason)
                                          for reason in ("stop", "length", "abort", "error")}
        self._observed: list[tuple[Any, float]] = []  # (histogram, value), in order
        self._counted: dict[Any, float] = {}  # counter -> amount to add
        self._gauges: dict[Any, float] = {}  # gauge -> its latest value
        self._lora_seen: tuple[str, str] | None = None  # the adapters of the running and the waiting requests

    @property
    def queued(self) -> bool:
        return bool(self._observed or self._counted or self._gauges)

    def observe(self, histogram: Any, value: float) -> None:
        self._observed.append((histogram, value))

    def held(self, kind: str, value: int) -> None:
        """Bytes one core holds of ``kind`` (weights, kv_cache; lora with adapter buffers)."""
        if kind not in self.core_memory:
            self.core_memory[kind] = metrics.CORE_MEMORY.labels(**self.labels, kind=kind)
        self.core_memory[kind].set(value)

    def count(self, counter: Any, amount: float = 1) -> None:
        self._counted[counter] = self._counted.get(counter, 0) + amount

    def set(self, gauge: Any, value: float) -> None:
        self._gauges[gauge] = value

    def flush(self) -> None:
        """Apply what was queued (on the engine's thread, as it was queued)."""
        observed, self._observed = self._observed, []
        counted, self._counted = self._counted, {}
        gauges, self._gauges = self._gauges, {}
        for histogram, value in observed:
            histogram.observe(value)
        for counter, amount in counted.items():
            counter.inc(amount)
        for gauge, value in gauges.items():
            gauge.set(value)

    def step_tokens(self, prompt: int, decode: int, chunked: bool) -> None:
        """One step's tokens by kind, and whether its call carried a prompt's chunk (a step of no call: nothing)."""
        if prompt or decode:
            self.observe(self.step_prompt, prompt)
            self.observe(self.step_decode, decode)
        if chunked:
            self.count(self.chunked_steps)

    def token_gap(self, seconds: float) -> None:
        """The time between two tokens of a sequence: vLLM's time_per_output_token and inter_token_latency."""
        self.observe(self.tpot, seconds)
        self.observe(self.itl, seconds)

    def speculated(self, proposed: list[int], taken: list[int]) -> None:
        """One sequence's round: its proposals, and the tokens it took (the accepted ones, then one of the model's)."""
        accepted = len(taken) - 1  # a round takes its accepted proposals and one token more
        self.count(self.drafts)
        self.count(self.draft_tokens, len(proposed))
        self.count(self.accepted_tokens, accepted)
        for position in range(len(proposed)):  # vLLM's accepted_tokens_per_pos: every position counted, at 0 too
            child = self._accepted_at.get(position)
            if child is None:
                child = self._accepted_at[position] = metrics.SPEC_ACCEPTED_PER_POSITION.labels(
                    **self.labels, position=str(position))
            self.count(child, 1 if position < accepted else 0)

    def lora_requests(self, max_lora: int, running: str, waiting: str) -> None:
        """vLLM's lora_requests_info: the adapters of the running and of the waiting requests (comma-separated),
        a labelled series set to the time it changed to them."""
        if (running, waiting) == self._lora_seen:
            return
        self._lora_seen = (running, waiting)
        self.set(metrics.LORA_REQUESTS_INFO.labels(**self.labels, max_lora=str(max_lora), running_lora_adapters=running,
                                                   waiting_lora_adapters=waiting), time.time())

    def step(self, shape: Shape) -> Any:
        if shape.label not in self._steps:
            self._steps[shape.label] = metrics.STEP_TIME.labels(**self.labels, bucket=shape.label)
        return self._steps[shape.label]

    def finished(self, reason: str) -> Any:
        if reason not in self._finished:
            self._finished[reason] = metrics.REQUEST_SUCCESS.labels(**self.labels, finished_reason=reason)
        return self._finished[reason]


def compile_state(build: Any, background: bool) -> dict:
    """Where ``build``'s compiles stand (compiling.GenerationBuild), as a replica reports it: compiled, pending
    (queued or compiling) and failed models, each failure's reason, and whether the rest compile in the
    background."""
    state = build.compiles.counts().as_dict()
    failures = build.compiles.failures()
    if failures:
        state["failures"] = [{"model": label, "error": reason} for label, reason in failures]
    state["background"] = background
    return state


def compile_listener(model: str, replica: str, build: Any, background: bool,
                     tell: Callable[[dict], None]) -> Callable[[Any], None]:
    """A compile queue listener of ``build``'s jobs: each compiled model's seconds and the counts by state as
    metrics, and the state to ``tell`` (the replica)."""
    labels = {"model": model, "replica": replica}

    def counted() -> dict:
        state = compile_state(build, background)
        for name in ("compiled", "pending", "failed"):
            metrics.COMPILED_MODELS.labels(**labels, state=name).set(state.get(name, 0))
        return state

    def heard(job: Any) -> None:
        if job.kind == "compile" and job.state == "compiled" and job.seconds is not None:
            metrics.COMPILE_SECONDS.labels(**labels, bucket=job.label.removeprefix(f"{build.name} ")).set(job.seconds)
        tell(counted())

    # The counts from now, not from the first background compile's end: until then a scrape would find no
    # pending models and take the replica for fully compiled (bench/servers.py waits on it).
    counted()
    return heard
