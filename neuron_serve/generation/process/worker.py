"""The engine process: a replica's generation engines, run apart from its event loop.

``python -m neuron_serve.generation.process.worker FD`` is started by :class:`~.process.EngineProcess`
with one end of a socket pair as ``FD``. Over it (``multiprocessing.connection`` framing,
the messages of ``messages.py``) the replica sends a ``Start``; this process builds the
engines, compiling or loading an artifact (``build_engines``): one per core of the
replica, or with ``group`` = (index, size) the one engine of that tensor-parallel group,
whose cores are all this process sees. It answers ``Ready`` or ``Failed``. Then it takes

- ``Submit``: a request the replica's front end admitted, for the engine group;
- ``Abort``;
- ``LoadAdapter``, ``UnloadAdapter``: a LoRA adapter to serve or to drop, answered by an ``AdapterReply``;
- ``Close``: stop; running requests end with finish_reason "abort";

and sends a ``Batch``: every token event that arrived while the last message was being
sent, so a step's events for all its sequences cross in one message, with one ``Usage``
when any of them ends its request (not one a request); ``Compiled`` and ``HostMemory`` as
each compile of the models still compiling ends. It ends with ``Closed``, or when the
replica's end of the socket closes (the replica is gone: nothing is left to serve).
"""

from __future__ import annotations

import logging
import pickle
import sys
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable

from .messages import (
    Abort, AdapterReply, Batch, Close, Closed, Compiled, Dispatch, Failed, HostMemory, LoadAdapter, Message, Ready,
    Start, Submit, UnknownMessage, UnloadAdapter, Usage
)

if TYPE_CHECKING:
    from ..frontend.protocol import TokenEvent

logger = logging.getLogger("neuron_serve")


class Outbox:
    """Messages to the replica, sent by a thread of their own: token events in batches, the rest as they come.

    The engine's thread only appends (its sinks run while the next step computes); the
    pickling and the socket write happen here, once for every event that arrived together.
    A batch with an event that ends its request carries one ``usage()`` (a :class:`Usage`),
    taken here as it is sent: the usage after every request it ends.
    """

    def __init__(self, conn: Connection, usage: Callable[[], Usage] | None = None) -> None:
        self._conn = conn
        self._usage = usage
        self._events: list[TokenEvent] = []
        self._finished = False  # an event among them ends its request
        self._others: list[Message] = []
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="engine-outbox", daemon=True)
        self._thread.start()

    def post(self, event: TokenEvent) -> None:
        """A request's event (the engines' sink)."""
        with self._ready:
            self._events.append(event)
            if event.finish_reason is not None:
                self._finished = True
            if len(self._events) == 1 and not self._others:
                self._ready.notify()

    def tell(self, message: Message) -> None:
        """Any other message to the replica (Compiled, HostMemory, AdapterReply)."""
        with self._ready:
            self._others.append(message)
            if len(self._others) == 1 and not self._events:
                self._ready.notify()

    def close(self) -> None:
        """Send what is left, then ``Closed``."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join()

    def _taken(self) -> Usage | None:
        if self._usage is None:
            return None
        try:
            return self._usage()
        except Exception:  # noqa: BLE001 - the metadata's figures must never stop the events
            logger.exception("the bucket usage could not be read")
            return None

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._events and not self._others and not self._closed:
                    self._ready.wait()
                events, self._events = self._events, []
                others, self._others = self._others, []
                finished, self._finished = self._finished, False
                closed = self._closed
            try:
                for message in others:
                    self._conn.send(message)
                if events:
                    self._conn.send(Batch(events, self._taken() if finished else None))
                if closed and not events and not others:
                    self._conn.send(Closed())
                    return
            except OSError:  # the replica is gone
                return


def _portable(exc: BaseException) -> bytes:
    """``exc`` pickled, or a RuntimeError with its message where it does not pickle."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001 - any exception type may come out of a model's build
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))


def _adapter_call(engines: Any, outbox: Outbox, message: LoadAdapter | UnloadAdapter) -> None:
    try:
        match message:
            case LoadAdapter(name=name, path=path):
                engines.load_adapter(name, path)
            case UnloadAdapter(name=name):
                engines.unload_adapter(name)
    except BaseException as exc:  # noqa: BLE001 - the replica raises it to the caller
        outbox.tell(AdapterReply(message.call, _portable(exc)))
        return
    outbox.tell(AdapterReply(message.call))


def serve(conn: Connection) -> int:
    start = conn.recv()
    if not isinstance(start, Start):
        raise UnknownMessage(f"the engine process got a message it does not take before its Start: {start!r:.80}")
    config, base_dir, replica, group = start.config, start.base_dir, start.replica, start.group
    # Factory models import from where the replica could import (Ray's working_dir, py_modules).
    sys.path[:0] = [p for p in start.sys_path if p not in sys.path]
    from ... import logs  # noqa: PLC0415

    logs.configure()  # a progress line per compiled model; the operator lists with NEURON_SERVE_VERBOSE

    from ...config.schema import parse_config  # noqa: PLC0415 - after sys.path is set
    from ...targets.pjrt import THREADS_ENV, emulated_core_threads, start_emulated_cores_on_threads  # noqa: PLC0415
    from ..compiling.build import build_engines  # noqa: PLC0415
    from ..core.metrics import compile_listener, compile_state  # noqa: PLC0415
    from ..frontend.protocol import TokenEvent  # noqa: PLC0415

    try:
        config = parse_config(config)
        # An emulated core computes on every CPU the process may use (XLA:CPU's own pool), beside the replica's
        # HTTP work: on a real model the split pays (SmolLM2-135M served on 2 vCPUs: a token every 45.6 ms at one
        # stream against 61.0 on one thread, 94 tok/s at 16 streams against 74); a small model whose calls take
        # a few ms may gain from one per core (docs/guides/benchmarks.md): $NEURON_SERVE_EMULATED_CORE_THREADS.
        # A tensor-parallel group's process has the group's cores only (process.group_env).
        cores = group[1] if group is not None else config.cores_per_replica
        per_core = emulated_core_threads()
        if per_core is not None and start_emulated_cores_on_threads(per_core * cores):
            logger.info("emulated NeuronCores: XLA:CPU computes on %d thread(s), %d per core (%s)", per_core * cores,
                        per_core, THREADS_ENV)
        background = config.background_compile
        engines = build_engines(config, base_dir, replica=replica, cores=cores, background=background)
    except BaseException as exc:  # noqa: BLE001 - the replica raises it in its constructor
        conn.send(Failed(_portable(exc)))
        return 1
    build = engines.build
    state = compile_state(build, background) if build is not None else None
    conn.send(Ready(engines.info, engines.engines[0].tokenizer, state))
    usage = engines.engines[0].usage  # the replica's engines share one
    from ..compiling.rebucket import describe  # noqa: PLC0415 - as build_engines

    def padded() -> Usage:
        """What the buckets padded so far and where the auto buckets stand (the metadata's)."""
        return Usage(usage.summary(), describe(engines.engines[0].rebucketings))

    outbox = Outbox(conn, padded)
    post = outbox.post  # a request's event to the replica
    from ... import metrics  # noqa: PLC0415

    def tell_memory(_: object = None) -> None:
        """The process's host memory now, as a metric here and to the replica (its model metadata)."""
        report = engines.host_memory
        metrics.set_host_memory(config.name, replica, report)
        outbox.tell(HostMemory(report))

    tell_memory()
    if build is not None:  # each later compile that ends: its metrics here, its state to the replica
        build.compiles.subscribe(compile_listener(config.name, replica, build, background,
                                                  lambda now: outbox.tell(Compiled(now))))
        build.compiles.subscribe(lambda job: tell_memory() if job.done else None)

    def submit(message: Submit) -> None:
        request = message.request
        try:
            engines.submit(request, post)
        except Exception as exc:  # noqa: BLE001 - said as its end (a grammar the engine cannot read, ...)
            post(TokenEvent(request.request_id, None, finish_reason="error", error=str(exc),
                            error_status=getattr(exc, "http_status", 500)))

    def abort(message: Abort) -> None:
        engines.abort(message.request_id, message.reason)

    def adapter(message: LoadAdapter | UnloadAdapter) -> None:
        # Reading an adapter takes a moment: on a thread of its own, so requests keep arriving.
        threading.Thread(target=_adapter_call, args=(engines, outbox, message), name="adapter-load",
                         daemon=True).start()

    # Each handler returns whether the process stops.
    handle: Dispatch[bool | None] = Dispatch("the engine process", {
        Submit: submit, Abort: abort, LoadAdapter: adapter, UnloadAdapter: adapter, Close: lambda _: True})
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        try:
            if handle(message):
                break
        except UnknownMessage:  # the replica's mistake: said, and the engines go on serving
            logger.exception("a message from the replica was not understood")
    from ..core.group import COMPILE_WAIT_S  # noqa: PLC0415

    engines.close(compile_wait=COMPILE_WAIT_S)  # the replica waits 60 s for this process to end
    outbox.close()
    # A compile still running ends before the process does: torch-xla aborts an exit under a compiling thread.
    from ...assembly.queue import compile_queue  # noqa: PLC0415

    compile_queue().close(timeout=COMPILE_WAIT_S)
    return 0


def main(argv: list[str]) -> int:
    return serve(Connection(int(argv[1])))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
