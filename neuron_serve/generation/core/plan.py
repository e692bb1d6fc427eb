"""An engine step's plan as data: the calls the scheduler decided, in the order they run.

Each entry names requests by id and slots by number, never a live request: the plan says what
to do, the runner (runner/calls.py) does it, and the request-state owner (states.py) applies what came
back. A step runs, in order, the prompts prefilled whole (those from position 0 together, in
:class:`PrefillBatch` calls of as many prompts as a compiled prefill takes; one after a cached
prefix or asking for its prompt logprobs in a :class:`Prefill` call of its own; a prompt given
a slot this step is first :class:`Admit`-ted: a cached prefix copied into its slot, its adapter
set), the compaction :class:`Move`-s, and one call for every running row: a :class:`Decode`
(or a verify round of speculative decoding), or with chunked prefill a :class:`Mixed` call that
also writes a prompt's :class:`Chunk`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True, slots=True)
class Admit:
    """A waiting request given ``slot`` this step: ``copy_from`` (a running slot holding its cached prefix)
    copied into it first, and its adapter's buffer slot set for it (0: the base model)."""

    request_id: str
    slot: int
    copy_from: int | None
    adapter_slot: int


@dataclass(frozen=True, slots=True)
class Prefill:
    """``request_id``'s prompt written whole into ``slot`` after the ``cached`` tokens it holds; ``scored``:
    every prompt position's logits come back too (prompt logprobs)."""

    request_id: str
    slot: int
    length: int
    cached: int
    scored: bool


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    """Prompts prefilled whole in one call, each into its slot from position 0 (no cached prefix, no prompt
    logprobs): the call's rows, longest prompt first."""

    prompts: tuple[Prefill, ...]


@dataclass(frozen=True, slots=True)
class Move:
    """Compaction: the cache of ``request_id`` copied from ``src`` to the free slot ``dst`` below."""

    request_id: str
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """The next ``length`` prompt tokens of ``request_id`` from ``start``, in the step's mixed call."""

    request_id: str
    slot: int
    start: int
    length: int
    last: bool  # it ends its prompt: its last token's logits give the first output token


@dataclass(frozen=True, slots=True)
class Decode:
    """One call over every running row, in slot order: a token each (``decode_steps`` when nothing else waits),
    or a verify round. A row whose first token, from a prefill earlier in the step, ended it is left out."""

    rows: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Mixed:
    """The decode rows and a prompt's chunk in one call."""

    rows: tuple[str, ...]
    chunk: Chunk


Call = Union[Admit, Prefill, PrefillBatch, Move, Decode, Mixed]


@dataclass
class StepPlan:
    """Everything one engine step holds, as Scheduler.schedule decided it."""

    failed: list[tuple[str, str]] = field(default_factory=list)  # (request id, error): never started
    calls: list[Call] = field(default_factory=list)  # in the order they run

    def of(self, kind: type) -> list:
        return [call for call in self.calls if isinstance(call, kind)]

    @property
    def admitted(self) -> list[Admit]:
        return self.of(Admit)

    @property
    def prefills(self) -> list[Prefill]:
        """Every prompt prefilled whole, alone or in a batch, in the order they run."""
        return [p for call in self.calls if isinstance(call, (Prefill, PrefillBatch))
                for p in (call.prompts if isinstance(call, PrefillBatch) else (call,))]

    @property
    def moves(self) -> list[Move]:
        return self.of(Move)

    @property
    def batch(self) -> Decode | Mixed | None:
        """The step's call over the running rows."""
        last = self.calls[-1] if self.calls else None
        return last if isinstance(last, (Decode, Mixed)) else None

    @property
    def chunk(self) -> Chunk | None:
        batch = self.batch
        return batch.chunk if isinstance(batch, Mixed) else None

    @property
    def decode(self) -> tuple[str, ...]:
        """The ids of the batch call's decode rows."""
        batch = self.batch
        return batch.rows if batch is not None else ()

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens this step computes (a prefix cached already costs none)."""
        chunk = self.chunk
        return sum(p.length - p.cached for p in self.prefills) + (chunk.length if chunk is not None else 0)
