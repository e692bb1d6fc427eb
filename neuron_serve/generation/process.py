"""A replica's engines in a process of their own (as vLLM's engine core runs apart from its API server).

In one process the engine's thread and the replica's event loop share one GIL. At 32
streams the loop holds it about 60 µs a token (the chunk's way through Serve, Starlette
and uvicorn, the OpenAI encoder), about 2 ms a step, and every time the engine thread
gives it up (each call into torch-xla) it may wait for the loop to give it back, so the
step that every stream waits for grows by the loop's work. Apart, the two run on their
own cores and the GIL of each is its own; what crosses is one message a step.

:class:`EngineProcess` is the replica's side: the same ``submit``/``abort``/``generate``
API as an engine (:class:`~.engine.Streams`). A request is checked here, with the
engine's own checks and queue bound, so its errors come back at once as they would from
an engine in process; the worker (``worker.py``) builds and runs the engines. If the
worker dies, every open request ends with an error event, and new ones are refused
with 503 until Serve replaces the replica (``alive`` is its health).
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence as Seq

from ..errors import InvalidInput, ModelNotReady, Overloaded
from .engine import Streams, TokenEvent, check_prompt
from .sampling import SamplingParams

logger = logging.getLogger("neuron_serve")

WORKER = "neuron_serve.generation.worker"
CLOSE_WAIT_S = 60.0


class EngineProcess(Streams):
    """Start the worker, build the engines of ``config`` (a model.yaml dict) in it, and wait until they serve.

    Raises what building raised (a ConfigError naming the field, a compile error, ...).
    """

    def __init__(self, config: dict, base_dir: str | None, replica: str) -> None:
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-m", WORKER, str(theirs.fileno())],
                                        pass_fds=[theirs.fileno()])
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send((config, base_dir, replica, list(sys.path)))
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            code = self.process.wait()
            self._conn.close()
            raise RuntimeError(f"the engine process exited with code {code} while building the model; its log says "
                               f"why") from None
        if kind == "failed":
            self.process.wait()
            self._conn.close()
            raise pickle.loads(payload)
        self.engines: int = payload["engines"]
        self.slots: int = payload["slots"]
        self.vocab_size: int = payload["vocab_size"]
        self.max_model_len: int = payload["max_model_len"]
        self.tokenizer: Any = payload["tokenizer"]
        # Past this many open requests an engine in process would refuse: each engine's
        # slots and its queue, the group choosing the engine with the most free slots.
        self._capacity = self.engines * (self.slots + payload["max_waiting"])
        self._sinks: dict[str, Callable[[TokenEvent], None]] = {}
        self._lock = threading.Lock()  # _sinks, the state below and every send
        self._ids = itertools.count()
        self._closing = False
        self._ended: str | None = None  # why the worker is gone, once it is
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self._reader.start()

    # -- the API --------------------------------------------------------------------------

    def submit(self, prompt: Seq[int], params: SamplingParams, sink: Callable[[TokenEvent], None],
               request_id: str | None = None) -> str:
        ids = check_prompt(prompt, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                           has_tokenizer=self.tokenizer is not None)
        with self._lock:
            if self._ended is not None:
                raise ModelNotReady(f"the generation engine process has ended ({self._ended}); the replica is being "
                                    f"replaced, retry shortly.")
            if self._closing:
                raise Overloaded("the generation engine is stopping; retry on another replica.")
            if len(self._sinks) >= self._capacity:
                waiting = len(self._sinks) - self.engines * self.slots
                raise Overloaded(f"the generation queue is full ({waiting} requests waiting); retry later.")
            rid = request_id if request_id is not None else f"gen-{next(self._ids)}"
            if rid in self._sinks:
                raise InvalidInput(f"request id {rid!r} is already running; give each request its own id.")
            self._sinks[rid] = sink
            try:
                self._conn.send(("submit", rid, ids, params))
            except OSError as exc:
                del self._sinks[rid]
                raise ModelNotReady(f"the generation engine process is not reachable ({exc}); retry shortly.") from None
        return rid

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._sinks and self._ended is None:
                try:
                    self._conn.send(("abort", request_id))
                except OSError:  # gone: the reader ends the request
                    pass

    @property
    def running(self) -> int:
        """Requests open (running or waiting for a slot)."""
        return len(self._sinks)

    @property
    def alive(self) -> bool:
        return self._ended is None and self.process.poll() is None

    def close(self) -> None:
        """Stop the worker; open requests end with finish_reason "abort" (their last events still arrive)."""
        with self._lock:
            self._closing = True
            if self._ended is None:
                try:
                    self._conn.send(("close",))
                except OSError:
                    pass
        self._reader.join(timeout=CLOSE_WAIT_S)
        try:
            self.process.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._conn.close()
        _forget_metrics(self.process.pid)

    # -- the worker's events ----------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                kind, payload = self._conn.recv()
                if kind == "closed":
                    break
                for event in payload:
                    self._deliver(event)
        except (EOFError, OSError):
            pass
        code = self.process.wait()
        with self._lock:
            self._ended = "stopped" if self._closing and code == 0 else f"exit code {code}"
            left, self._sinks = self._sinks, {}
        if left and not self._closing:
            logger.error("the generation engine process exited with code %s; %d open requests end with an error",
                         code, len(left))
        for rid, sink in left.items():
            self._safely(sink, TokenEvent(rid, None, finish_reason="error",
                                          error=f"the generation engine process ended ({self._ended})"))

    def _deliver(self, event: TokenEvent) -> None:
        if event.finished:
            with self._lock:
                sink = self._sinks.pop(event.request_id, None)
        else:
            sink = self._sinks.get(event.request_id)
        if sink is not None:
            self._safely(sink, event)

    def _safely(self, sink: Callable[[TokenEvent], None], event: TokenEvent) -> None:
        try:
            sink(event)
        except Exception:  # noqa: BLE001 - the sink is the caller's code
            logger.exception("generate request %s: its event sink failed; aborting it", event.request_id)
            if not event.finished:
                self.abort(event.request_id)


def _forget_metrics(pid: int) -> None:
    """Drop the worker's live gauges (running, waiting, KV slots) from the replica's metrics."""
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        from prometheus_client import multiprocess  # noqa: PLC0415

        multiprocess.mark_process_dead(pid)
