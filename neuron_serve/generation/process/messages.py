"""The messages between a replica and its engine process: one frozen dataclass a kind (:class:`Kind`).

The replica's side (``client.py``) sends, over the socket pair it shares with the worker
(``worker.py``; ``multiprocessing.connection`` framing, pickled):

- :class:`Start`, once, first: what the worker builds the engines of;
- :class:`Submit`: a request the replica's front end admitted, for the engine group;
- :class:`Abort`: end a request (its last event has finish_reason ``reason``);
- :class:`LoadAdapter`, :class:`UnloadAdapter`: a LoRA adapter to serve or to drop, answered by an
  :class:`AdapterReply` with the same ``call``;
- :class:`Close`: stop; running requests end with finish_reason "abort".

The worker answers :class:`Start` with :class:`Ready` or :class:`Failed`, then sends

- :class:`Batch`: the token events that arrived while the last message was being sent (a step's events for
  all its sequences, in one message) and, when one of them ends its request, one :class:`Usage` (what the
  buckets padded so far, where the auto buckets stand), at most one a batch;
- :class:`Compiled`: where the compiles stand, as each compile of the models still compiling ends;
- :class:`HostMemory`: what the process holds of host memory, once it serves and as each compile ends;
- :class:`AdapterReply`;
- :class:`Closed`, last, once the engines have stopped after a :class:`Close`.

Each side hands what it receives to a :class:`Dispatch`: a handler per message class, found by the
message's type; anything else is refused with :class:`UnknownMessage`.

A :class:`Batch` crosses every step: a message pickles as its class and its fields in order (no field names,
no kind: the class says it), and its class as a one-byte extension code (``copyreg``) rather than its module
and name: a message pickles to what the tagged tuple it replaced did, within a few bytes (a step's
:class:`Batch` of 32 events to 2,330 bytes, against 2,334).
"""

from __future__ import annotations

import copyreg
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generic, Mapping, TypeVar

if TYPE_CHECKING:
    from ..frontend.protocol import EngineRequest, TokenEvent

R = TypeVar("R")


class Kind(str, enum.Enum):
    """What a message is; its class says it (``Message.kind``), the pickle does not carry it."""

    # replica -> engine process
    START = "start"
    SUBMIT = "submit"
    ABORT = "abort"
    LOAD_ADAPTER = "load_adapter"
    UNLOAD_ADAPTER = "unload_adapter"
    CLOSE = "close"
    # engine process -> replica
    READY = "ready"
    FAILED = "failed"
    BATCH = "batch"
    USAGE = "usage"
    COMPILED = "compiled"
    HOST_MEMORY = "host_memory"
    ADAPTER_REPLY = "adapter_reply"
    CLOSED = "closed"


class Message:
    """A message between the replica and its engine process; pickled as ``(class, fields)``."""

    __slots__ = ()
    kind: ClassVar[Kind]

    def __reduce__(self) -> tuple[type, tuple]:
        return type(self), tuple(getattr(self, name) for name in self.__slots__)


# -- replica -> engine process --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start(Message):
    """Build the engines of ``config`` (a model.yaml dict) for ``replica``, importing from ``sys_path`` as the
    replica does; ``group`` (index, size): the tensor-parallel group whose cores are all the process sees."""

    kind: ClassVar[Kind] = Kind.START
    config: dict
    base_dir: str | None
    replica: str
    sys_path: list[str]
    group: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Submit(Message):
    """A request the replica's front end admitted."""

    kind: ClassVar[Kind] = Kind.SUBMIT
    request: EngineRequest


@dataclass(frozen=True, slots=True)
class Abort(Message):
    """End request ``request_id``; its last event has finish_reason ``reason``."""

    kind: ClassVar[Kind] = Kind.ABORT
    request_id: str
    reason: str = "abort"


@dataclass(frozen=True, slots=True)
class LoadAdapter(Message):
    """Serve LoRA adapter ``name`` from PEFT directory ``path``; answered by ``AdapterReply(call)``."""

    kind: ClassVar[Kind] = Kind.LOAD_ADAPTER
    call: int
    name: str
    path: str


@dataclass(frozen=True, slots=True)
class UnloadAdapter(Message):
    """Stop serving LoRA adapter ``name``; answered by ``AdapterReply(call)``."""

    kind: ClassVar[Kind] = Kind.UNLOAD_ADAPTER
    call: int
    name: str


@dataclass(frozen=True, slots=True)
class Close(Message):
    """Stop the engines (running requests end with finish_reason "abort"), then the process."""

    kind: ClassVar[Kind] = Kind.CLOSE


# -- engine process -> replica --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready(Message):
    """The engines serve: what the front end needs to know of them (group.describe), their tokenizer, and where
    their compiles stand (None: nothing compiles after start, an artifact)."""

    kind: ClassVar[Kind] = Kind.READY
    info: dict
    tokenizer: Any
    compile: dict | None


@dataclass(frozen=True, slots=True)
class Failed(Message):
    """Building the engines raised ``error`` (pickled; a RuntimeError with its message where it does not pickle)."""

    kind: ClassVar[Kind] = Kind.FAILED
    error: bytes


@dataclass(frozen=True, slots=True)
class Usage(Message):
    """What the engines' buckets padded so far (bucket_usage.Usage.summary: the metadata's ``parameters.padding``)
    and where their auto buckets stand (rebucket.describe: ``parameters.rebucketing``)."""

    kind: ClassVar[Kind] = Kind.USAGE
    padding: dict
    rebucketing: dict


@dataclass(frozen=True, slots=True)
class Batch(Message):
    """Token events in the order the engines emitted them, and, when one of them ends its request, the usage
    as it stood when the batch was sent (taken before the events are delivered)."""

    kind: ClassVar[Kind] = Kind.BATCH
    events: list[TokenEvent]
    usage: Usage | None = None


@dataclass(frozen=True, slots=True)
class Compiled(Message):
    """Where the engines' compiles stand: compiled, pending and failed model counts, each failure's reason, and
    whether the rest compile in the background (metrics.compile_state)."""

    kind: ClassVar[Kind] = Kind.COMPILED
    state: dict


@dataclass(frozen=True, slots=True)
class HostMemory(Message):
    """What the engine process holds of host memory (assembly/host_memory.report)."""

    kind: ClassVar[Kind] = Kind.HOST_MEMORY
    report: dict


@dataclass(frozen=True, slots=True)
class AdapterReply(Message):
    """The answer to a LoadAdapter or UnloadAdapter: the error it raised, pickled (None: done)."""

    kind: ClassVar[Kind] = Kind.ADAPTER_REPLY
    call: int
    error: bytes | None = None


@dataclass(frozen=True, slots=True)
class Closed(Message):
    """The engines have stopped; nothing follows."""

    kind: ClassVar[Kind] = Kind.CLOSED


TO_ENGINES = (Start, Submit, Abort, LoadAdapter, UnloadAdapter, Close)
TO_REPLICA = (Ready, Failed, Batch, Usage, Compiled, HostMemory, AdapterReply, Closed)

# copyreg's private-use extension codes (240 to 255): both ends import this module before the first message.
EXTENSION_CODES = 240
for _code, _message in enumerate((*TO_ENGINES, *TO_REPLICA), start=EXTENSION_CODES):
    copyreg.add_extension(_message.__module__, _message.__qualname__, _code)


class UnknownMessage(TypeError):
    """A message the receiving side has no handler for."""


class Dispatch(Generic[R]):
    """Hands each message ``receiver`` (its name, for errors) gets to the handler of its class."""

    def __init__(self, receiver: str, handlers: Mapping[type[Message], Callable[[Any], R]]) -> None:
        self.receiver = receiver
        self._handlers = dict(handlers)

    def __call__(self, message: object) -> R:
        try:
            handler = self._handlers[type(message)]
        except KeyError:
            raise UnknownMessage(self.refusal(message)) from None
        return handler(message)

    def refusal(self, message: object) -> str:
        what = message.kind.value if isinstance(message, Message) else type(message).__qualname__
        shown = repr(message)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        takes = ", ".join(sorted(kind.kind.value for kind in self._handlers))
        return f"{self.receiver} got a message it does not take: {what} {shown}; it takes {takes}"
