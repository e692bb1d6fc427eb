"""One generate request inside the engine, from submission to its end, and the status it is in.

A request is *waiting* until the scheduler gives it a KV-cache slot, *prefilling* while part of
its prompt is still to be written into that slot (a chunked prompt between its chunks, or one
admitted this step), *running* once its prompt is written (each step then decodes a token for it),
and *finished* with a reason (``stop``, ``length``, ``abort``, ``error``). The status is set where
the state changes (scheduler.py places and moves, states.py writes tokens and ends), never inferred
from the other fields.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ..frontend.protocol import TokenEvent
    from ..sample.sampling import SamplingParams
    from ..frontend.structured import RowConstraint


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # compared by identity: two requests are never the same one
class Sequence:
    """One generate request from submission to its end."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[TokenEvent], None]  # receives each TokenEvent (from the engine's thread)
    arrival: float = field(default_factory=time.perf_counter)
    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None  # set with Status.FINISHED
    stop_reason: int | str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    prompt_logprobs: list | None = None  # with params.prompt_logprobs: handed out on the first event
    constraint: RowConstraint | None = None  # with params.structured
    cached: int = 0  # prompt tokens whose keys and values its slot holds already (prefix caching)
    computed: int = 0  # prompt tokens written into its slot so far (a chunked prompt's grow chunk by chunk)
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

    @property
    def prefilling(self) -> bool:
        return self.status is Status.PREFILLING

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def wrote(self, end: int) -> None:
        """Its prompt is in its slot up to ``end``: running once all of it is."""
        self.computed = end
        self.status = Status.RUNNING if end >= len(self.prompt) else Status.PREFILLING
