"""The engine process: a replica's generation engines, run apart from its event loop.

``python -m neuron_serve.generation.worker FD`` is started by :class:`~.process.EngineProcess`
with one end of a socket pair as ``FD``. Over it (``multiprocessing.connection`` framing,
pickled messages) the replica sends ``(config, base_dir, replica, sys_path, group)``; this
process builds the engines, compiling or loading an artifact (``build_engines``): one
per core of the replica, or with ``group`` = (index, size) the one engine of that
tensor-parallel group, whose cores are all this process sees. It answers ``("ready", info)`` or ``("failed", error)``. Then it reads

- ``("submit", EngineRequest)``: a request the replica's front end admitted, for the engine group;
- ``("abort", request_id, reason)``;
- ``("adapter", call, "load", name, path)`` or ``("adapter", call, "unload", name, None)``: a LoRA
  adapter to serve or to drop, answered by an ``AdapterReply(call, error)`` among the events;
- ``("close",)``: stop; running requests end with finish_reason "abort";

and sends ``("events", [TokenEvent, ...])``: every event that arrived while the last
batch was being sent, so a step's events for all its sequences cross in one message (and,
as each compile of the models still compiling ends, a ``CompileState`` among them).
It ends with ``("closed", None)``, or when the replica's end of the socket closes (the
replica is gone: nothing is left to serve).
"""

from __future__ import annotations

import logging
import pickle
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger("neuron_serve")



class Outbox:
    """Events from the engine threads, sent in batches by a thread of their own.

    The engine's thread only appends (its sinks run while the next step computes); the
    pickling and the socket write happen here, once for everything that arrived together.
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._items: list[Any] = []
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="engine-outbox", daemon=True)
        self._thread.start()

    def post(self, event: Any) -> None:
        with self._ready:
            self._items.append(event)
            if len(self._items) == 1:
                self._ready.notify()

    def close(self) -> None:
        """Send what is left, then ``("closed", None)``."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._items and not self._closed:
                    self._ready.wait()
                items, self._items = self._items, []
                closed = self._closed
            try:
                if items:
                    self._conn.send(("events", items))
                if closed and not items:
                    self._conn.send(("closed", None))
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


def _adapter_call(engines: Any, outbox: Outbox, reply: type, call: int, op: str, name: str, path: str | None) -> None:
    try:
        engines.load_adapter(name, path) if op == "load" else engines.unload_adapter(name)
    except BaseException as exc:  # noqa: BLE001 - the replica raises it to the caller
        outbox.post(reply(call, _portable(exc)))
        return
    outbox.post(reply(call))


def serve(conn: Connection) -> int:
    config, base_dir, replica, paths, group = conn.recv()
    # Factory models import from where the replica could import (Ray's working_dir, py_modules).
    sys.path[:0] = [p for p in paths if p not in sys.path]
    from .. import logs  # noqa: PLC0415

    logs.configure()  # a progress line per compiled model; the operator lists with NEURON_SERVE_VERBOSE

    from ..config.schema import parse_config  # noqa: PLC0415 - after sys.path is set
    from ..targets.pjrt import start_emulated_cores_on_threads  # noqa: PLC0415
    from .build import build_engines  # noqa: PLC0415
    from .metrics import compile_listener, compile_state  # noqa: PLC0415
    from .protocol import AdapterReply, CompileState, HostMemoryState, TokenEvent, UsageState  # noqa: PLC0415

    try:
        config = parse_config(config)
        # An emulated core's steps compute on one host thread each, so the replica's HTTP
        # work keeps a CPU to itself, as beside a real NeuronCore. XLA:CPU's split of a
        # step over 2 vCPUs gained little and lost most of it to that work: a 32-row call
        # of 4 steps took 26.7 ms over two threads and 33.6 beside a busy CPU, against
        # 30 ms on one thread either way (docs/guides/benchmarks.md).
        # A tensor-parallel group's process has the group's cores only (process.group_env).
        cores = group[1] if group is not None else config.cores_per_replica
        if start_emulated_cores_on_threads(cores):
            logger.info("emulated NeuronCores: XLA:CPU computes on %d thread(s), one per core", cores)
        background = config.background_compile
        engines = build_engines(config, base_dir, replica=replica, cores=cores, background=background)
    except BaseException as exc:  # noqa: BLE001 - the replica raises it in its constructor
        conn.send(("failed", _portable(exc)))
        return 1
    build = engines.build
    state = compile_state(build, background) if build is not None else None
    conn.send(("ready", {**engines.info, "tokenizer": engines.engines[0].tokenizer, "compile": state}))
    outbox = Outbox(conn)
    usage = engines.engines[0].usage  # the replica's engines share one
    from .rebucket import describe  # noqa: PLC0415 - as build_engines

    def post(event: TokenEvent) -> None:
        """A request's event to the replica; after its last, what the buckets padded so far (the metadata's)."""
        outbox.post(event)
        if event.finished:
            outbox.post(UsageState(usage.summary(), describe(engines.engines[0].rebucketings)))
    from .. import metrics  # noqa: PLC0415

    def tell_memory(_: object = None) -> None:
        """The process's host memory now, as a metric here and to the replica (its model metadata)."""
        report = engines.host_memory
        metrics.set_host_memory(config.name, replica, report)
        outbox.post(HostMemoryState(report))

    tell_memory()
    if build is not None:  # each later compile that ends: its metrics here, its state to the replica
        build.compiles.subscribe(compile_listener(config.name, replica, build, background,
                                                  lambda now: outbox.post(CompileState(now))))
        build.compiles.subscribe(lambda job: tell_memory() if job.done else None)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message[0] == "submit":
            request = message[1]
            try:
                engines.submit(request, post)
            except Exception as exc:  # noqa: BLE001 - said as its end (a grammar the engine cannot read, ...)
                post(TokenEvent(request.request_id, None, finish_reason="error", error=str(exc),
                                       error_status=getattr(exc, "http_status", 500)))
        elif message[0] == "abort":
            engines.abort(message[1], message[2])
        elif message[0] == "adapter":
            # Reading an adapter takes a moment: on a thread of its own, so requests keep arriving.
            threading.Thread(target=_adapter_call, args=(engines, outbox, AdapterReply, *message[1:]),
                             name="adapter-load", daemon=True).start()
        elif message[0] == "close":
            break
    from .group import COMPILE_WAIT_S  # noqa: PLC0415

    engines.close(compile_wait=COMPILE_WAIT_S)  # the replica waits 60 s for this process to end
    outbox.close()
    # A compile still running ends before the process does: torch-xla aborts an exit under a compiling thread.
    from ..assembly.queue import compile_queue  # noqa: PLC0415

    compile_queue().close(timeout=COMPILE_WAIT_S)
    return 0


def main(argv: list[str]) -> int:
    return serve(Connection(int(argv[1])))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
