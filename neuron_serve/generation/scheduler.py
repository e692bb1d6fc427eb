"""Iteration-level scheduling over KV-cache slots (continuous batching, as in Orca and vLLM).

Policy, once per engine step:

1. Aborted sequences give their slots back.
2. Waiting prompts, oldest first, are prefilled into free slots while the prompt
   tokens prefilled in this step stay within ``max_num_batched_tokens``. The first
   prompt of a step is always taken when a slot is free, so a prompt longer than the
   budget still runs; the budget only bounds how long running sequences wait for
   their next token while new ones are prefilled (decode is never starved).
3. Every running sequence, the ones just prefilled included, decodes one token in a
   single compiled call. The call covers slots 0 to the highest running one, so when no
   prompt is waiting and the running sequences would fit a smaller decode bucket, the
   ones above it first move down into free slots below it (their cache slots copied on
   the core): sequences ending out of slot order no longer keep every step at the
   bucket of the highest slot.
4. A sequence that ends (EOS, a stop token or string, ``max_tokens``, a full context)
   gives its slot back at once, before the next step admits anyone.

With prefix caching (:mod:`.prefix_cache`), a prompt whose leading blocks a slot holds
takes that slot when it is free, or a free slot to copy it into when a running sequence
holds them; it costs the budget only the tokens it computes. A prompt that reuses nothing
takes an empty slot first, then the least recently used cached one.

The default budget, a quarter of ``max_model_len`` (at least 32 tokens), admits about one
prompt per step when prompts are long: a step with several prefills in front of its
decode call is what makes the slow tail of time per output token.

The scheduler is plain bookkeeping over :class:`Sequence` objects; the engine runs
the compiled models and samples.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from .sampling import SamplingParams


@dataclass
class Sequence:
    """One generate request from submission to its end."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[Any], None]  # receives each TokenEvent (from the engine's thread)
    arrival: float = field(default_factory=time.perf_counter)
    output: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    prompt_logprobs: list | None = None  # with params.prompt_logprobs: handed out on the first event
    constraint: Any = None  # with params.structured: its structured.RowConstraint
    cached: int = 0  # prompt tokens whose keys and values its slot holds already (prefix caching)
    copy_from: int | None = None  # the slot to copy into its own before its prefill (a running sequence's)
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base model)
    adapter_key: Any = None  # what its prefix is cached under (adapters.Adapters.key)
    adapter_slot: int | None = None  # the buffer slot holding its adapter, once it holds one (it then counts as a user)

    @property
    def length(self) -> int:
        """Tokens the sequence holds: prompt and output."""
        return len(self.prompt) + len(self.output)

    @property
    def position(self) -> int:
        """Where its last token goes when it is fed back: the next cache position to write."""
        return self.length - 1


def default_budget(max_model_len: int) -> int:
    """Prompt tokens prefilled per step when model.yaml does not say (see the module docstring)."""
    return max(32, max_model_len // 4)


class Scheduler:
    """Waiting queue, running set and free slots; see the module docstring for the policy."""

    def __init__(self, slots: int, max_num_batched_tokens: int, prefix: Any = None) -> None:
        # A heap: the lowest free slot is handed out first, so running sequences stay in the
        # low slots and a decode call (which covers slots 0 to the highest running) stays small.
        self.free = list(range(slots))
        self.slots = slots
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self.prefix = prefix  # a PrefixCache, with prefix caching

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (the engine bounds the queue when a request is submitted)."""
        self.waiting.append(seq)

    def admit(self, startable: Callable[[Sequence], bool] = lambda seq: True) -> list[Sequence]:
        """Waiting sequences to prefill this step, each given a free slot. One that is not ``startable`` yet (its
        model still compiling) keeps its place and the ones behind it go ahead."""
        admitted: list[Sequence] = []
        skipped: list[Sequence] = []
        tokens = 0
        while self.waiting and self.free:
            seq = self.waiting.popleft()
            if not startable(seq):
                skipped.append(seq)
                continue
            src, cached = None, 0
            if self.prefix is not None and seq.params.prompt_logprobs is None:  # prompt logprobs need every position
                src, cached = self.prefix.match(seq.prompt, prefer=self.free, key=seq.adapter_key)
            if admitted and tokens + len(seq.prompt) - cached > self.max_num_batched_tokens:
                self.waiting.appendleft(seq)
                break
            if self.prefix is None:
                seq.slot = heapq.heappop(self.free)
            else:
                seq.slot = src if src in self.free else self.prefix.empty_first(self.free)
                self.free.remove(seq.slot)
                heapq.heapify(self.free)
                seq.cached, seq.copy_from = cached, (src if src is not None and src != seq.slot else None)
                self.prefix.hold(seq.slot, seq.prompt, seq.adapter_key)
            self.running[seq.slot] = seq
            tokens += len(seq.prompt) - seq.cached
            admitted.append(seq)
        self.waiting.extendleft(reversed([s for s in skipped if s.finish_reason is None]))  # not ended meanwhile
        return admitted

    def release(self, seq: Sequence) -> None:
        """Give ``seq``'s slot back (it ended or was aborted), or take it off the waiting queue."""
        if seq.slot is not None and self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            heapq.heappush(self.free, seq.slot)
            seq.slot = None
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def compaction(self, bucket: Callable[[int], int]) -> list[tuple[Sequence, int]]:
        """Moves (sequence, free slot) that bring the running sequences into the smallest decode
        bucket their number fits, ``bucket(rows)`` being the bucket that ``rows`` rows run in.
        None while prompts wait: the next step's prefills fill the lowest free slots instead."""
        if self.waiting or not self.running:
            return []
        target = bucket(len(self.running))
        if target >= bucket(max(self.running) + 1):
            return []
        above = sorted(slot for slot in self.running if slot >= target)
        below = sorted(slot for slot in self.free if slot < target)
        return [(self.running[src], dst) for src, dst in zip(above, below)]

    def move(self, seq: Sequence, slot: int) -> None:
        """Record that ``seq`` now holds free slot ``slot`` (its cache was copied there) and its old slot is free."""
        self.free.remove(slot)
        heapq.heapify(self.free)
        del self.running[seq.slot]
        heapq.heappush(self.free, seq.slot)
        seq.slot = slot
        self.running[slot] = seq

    def decoding(self) -> list[Sequence]:
        """The running sequences, in slot order (one row each in the decode call)."""
        return [self.running[slot] for slot in sorted(self.running)]

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running
