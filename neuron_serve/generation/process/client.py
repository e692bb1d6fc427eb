"""A replica's engines in a process of their own (as vLLM's engine core runs apart from its API server).

In one process the engine's thread and the replica's event loop share one GIL. At 32
streams the loop holds it about 60 µs a token (the chunk's way through Serve, Starlette
and uvicorn, the OpenAI encoder), about 2 ms a step, and every time the engine thread
gives it up (each call into torch-xla) it may wait for the loop to give it back, so the
step that every stream waits for grows by the loop's work. Apart, the two run on their
own cores and the GIL of each is its own; what crosses is one message a step (``messages.py``
holds every message either way).

:class:`EngineProcess` is the replica's side: engines (:class:`~.protocol.Engines`) that
take the requests the replica's front end admitted and send them on; the worker
(``worker.py``) builds and runs the engines. If the worker dies, every open request ends
with an error event, and new ones are refused with 503 until Serve replaces the replica
(``alive`` is its health).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence as Seq

from ...buckets import usage as bucket_usage
from ...assembly import host_memory
from ...errors import ModelNotReady
from ...targets.pjrt import neuron_devices_present
from .messages import (
    Abort, AdapterReply, Batch, Close, Closed, Compiled, Dispatch, Failed, HostMemory, LoadAdapter, Ready, Start,
    Submit, UnknownMessage, UnloadAdapter
)
from ..frontend.protocol import Dispatcher, EngineRequest, Engines, TokenEvent

logger = logging.getLogger("neuron_serve")

WORKER = "neuron_serve.generation.process.worker"
CLOSE_WAIT_S = 60.0
ADAPTER_WAIT_S = 120.0  # reading and checking a LoRA adapter's files


class EngineProcess(Engines):
    """Start the worker, build the engines of ``config`` (a model.yaml dict) in it, and wait until they serve.

    Raises what building raised (a ConfigError naming the field, a compile error, ...).
    """

    def __init__(self, config: dict, base_dir: str | None, replica: str, group: tuple[int, int] | None = None) -> None:
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-m", WORKER, str(theirs.fileno())],
                                        pass_fds=[theirs.fileno()], env=group_env(group))
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send(Start(config, base_dir, replica, list(sys.path), group))
        try:
            reply = self._conn.recv()
        except (EOFError, OSError):
            code = self.process.wait()
            self._conn.close()
            raise RuntimeError(f"the engine process exited with code {code} while building the model; its log says "
                               f"why") from None
        match reply:
            case Ready():
                pass
            case Failed(error=error):
                self.process.wait()
                self._conn.close()
                raise pickle.loads(error)
            case _:
                self.process.kill()
                self.process.wait()
                self._conn.close()
                raise UnknownMessage(f"the replica got a message it does not take in answer to its Start: "
                                     f"{reply!r:.80}")
        self.tokenizer: Any = reply.tokenizer
        # Where the engines' compiles stand (None: nothing compiles after start, an artifact), kept up to date
        # by the worker; listeners hear of each change (serve/ray/compile_state.py records it for status).
        self.compile_state: dict | None = reply.compile
        self.padding: dict = {}  # what the engines' buckets padded so far (buckets/usage.py), as requests end
        self.rebucketing: dict = {}  # where their auto buckets stand (rebucket.describe), as requests end
        self.host_memory: dict = {}  # what the process holds of host memory (host_memory.report), as compiles end
        self._compile_listeners: list[Callable[[Any], None]] = []
        self.info: dict = reply.info
        self._sinks: dict[str, Callable[[TokenEvent], None]] = {}  # open requests' sinks
        self._lock = threading.Lock()  # orders every send, and the sinks' records
        self._ended: str | None = None  # why the worker is gone, once it is
        self._calls: dict[int, list] = {}  # adapter calls awaiting their reply: [event, error]
        self._next_call = 0
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self._reader.start()

    # -- the API --------------------------------------------------------------------------

    def submit(self, request: EngineRequest, sink: Callable[[TokenEvent], None]) -> None:
        with self._lock:
            if self._ended is not None:
                raise ModelNotReady(f"the generation engine process has ended ({self._ended}); the replica is being "
                                    f"replaced, retry shortly.")
            # The sink first: the worker's first token can arrive (on the reader's thread, which looks sinks up
            # without this lock) before send returns here.
            self._sinks[request.request_id] = sink
            try:
                self._conn.send(Submit(request))
            except OSError as exc:
                self._sinks.pop(request.request_id, None)
                raise ModelNotReady(f"the generation engine process is not reachable ({exc}); retry shortly.") from None

    def abort(self, request_id: str, reason: str = "abort") -> None:
        with self._lock:
            if request_id in self._sinks and self._ended is None:
                try:
                    self._conn.send(Abort(request_id, reason))
                except OSError:  # gone: the reader ends the request
                    pass

    def load_adapter(self, name: str, path: str) -> None:
        self._adapter_call("load", name, path)

    def unload_adapter(self, name: str) -> None:
        self._adapter_call("unload", name, None)

    def _adapter_call(self, op: str, name: str, path: str | None) -> None:
        """Ask the worker's engines to load or unload an adapter; raise what they raised."""
        done = [threading.Event(), None]
        with self._lock:
            if self._ended is not None:
                raise ModelNotReady(f"the generation engine process has ended ({self._ended}); retry shortly.")
            self._next_call += 1
            call = self._next_call
            self._calls[call] = done
            self._conn.send(LoadAdapter(call, name, path) if op == "load" else UnloadAdapter(call, name))
        if not done[0].wait(ADAPTER_WAIT_S):
            with self._lock:
                self._calls.pop(call, None)
            raise ModelNotReady(f"adapter {name!r}: the engine process did not answer its {op} in {ADAPTER_WAIT_S:.0f} s")
        if done[1] is not None:
            raise done[1]

    @property
    def free(self) -> int:
        """Requests this process takes before its engines' slots and queues are full, less what is open."""
        return self.info["engines"] * (self.info["slots"] + self.info["max_waiting"]) - len(self._sinks)

    @property
    def alive(self) -> bool:
        return self._ended is None and self.process.poll() is None

    def close(self) -> None:
        """Stop the worker; open requests end with finish_reason "abort" (their last events still arrive)."""
        with self._lock:
            if self._ended is None:
                try:
                    self._conn.send(Close())
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
        # Each handler returns whether the worker is done (its last message).
        handle: Dispatch[bool | None] = Dispatch("the replica", {
            Batch: self._batch, Compiled: lambda message: self._compiled(message.state),
            HostMemory: self._held, AdapterReply: self._replied, Closed: lambda _: True})
        closing = False
        try:
            while True:
                message = self._conn.recv()
                try:
                    if handle(message):
                        closing = True
                        break
                except UnknownMessage:  # the worker's mistake: said, and the requests go on
                    logger.exception("a message from the generation engine process was not understood")
        except (EOFError, OSError):
            pass
        code = self.process.wait()
        ended = "stopped" if closing and code == 0 else f"exit code {code}"
        with self._lock:
            self._ended = ended
            left, self._sinks = self._sinks, {}
            calls, self._calls = self._calls, {}
        for done in calls.values():
            done[1] = ModelNotReady(f"the generation engine process ended ({ended})")
            done[0].set()
        if left and not closing:
            logger.error("the generation engine process exited with code %s; %d open requests end with an error",
                         code, len(left))
        for rid, sink in left.items():
            self._safely(sink, TokenEvent(rid, None, finish_reason="error",
                                          error=f"the generation engine process ended ({ended})"))

    def _batch(self, batch: Batch) -> None:
        """A step's events; the usage first, so a request's end finds its own counts in the metadata."""
        if batch.usage is not None:
            self.padding, self.rebucketing = batch.usage.padding, batch.usage.rebucketing
        for event in batch.events:
            self._deliver(event)

    def _held(self, message: HostMemory) -> None:
        self.host_memory = message.report

    def _replied(self, reply: AdapterReply) -> None:
        with self._lock:
            done = self._calls.pop(reply.call, None)
        if done is not None:
            done[1] = pickle.loads(reply.error) if reply.error is not None else None
            done[0].set()

    def subscribe(self, listener: Callable[[Any], None]) -> Callable[[], None]:
        """Call ``listener(None)`` whenever the compile state changes (on the reader's thread); returns the
        function that unsubscribes it."""
        self._compile_listeners.append(listener)
        return lambda: listener in self._compile_listeners and self._compile_listeners.remove(listener)

    def _compiled(self, state: dict) -> None:
        self.compile_state = state
        for listener in list(self._compile_listeners):
            try:
                listener(None)
            except Exception:  # noqa: BLE001 - a listener (the status record) must never stop the events
                logger.exception("a compile state listener failed")

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


def group_env(group: tuple[int, int] | None, environ: dict | None = None) -> dict[str, str]:
    """The environment of the engine process of tensor-parallel group ``(index, size)`` (None: every core).

    A group's process sees exactly the group's cores, as SPMD's mesh must cover every core
    of the process: emulated, ``size`` XLA:CPU devices; on Neuron, the group's NeuronCores
    out of the replica's ``NEURON_RT_VISIBLE_CORES``.
    """
    env = dict(os.environ if environ is None else environ)
    if group is None:
        return env
    index, size = group
    device = env.get("PJRT_DEVICE") or ("NEURON" if neuron_devices_present() else "CPU")
    if device.upper() == "CPU":
        env["CPU_NUM_DEVICES"] = str(size)
        return env
    visible = _core_list(env.get("NEURON_RT_VISIBLE_CORES"))
    cores = visible[index * size:(index + 1) * size] if visible else list(range(index * size, (index + 1) * size))
    if len(cores) != size:
        raise RuntimeError(f"tensor-parallel group {index} needs {size} NeuronCores; NEURON_RT_VISIBLE_CORES gives "
                           f"{env.get('NEURON_RT_VISIBLE_CORES')}")
    env["NEURON_RT_VISIBLE_CORES"] = ",".join(str(c) for c in cores)
    return env


def _core_list(visible: str | None) -> list[int]:
    """``"2-5"`` or ``"0,1"`` as a list of core indices (empty when unset)."""
    cores: list[int] = []
    for part in filter(None, (visible or "").split(",")):
        first, _, last = part.partition("-")
        cores += list(range(int(first), int(last or first) + 1))
    return cores


class ProcessGroup(Dispatcher):
    """A replica's tensor-parallel groups, each an :class:`EngineProcess`, behind one ``submit``/``abort``.

    A request goes to the group with the most room (slots and queue) left, as an engine
    group picks the engine with the most free slots.
    """

    def __init__(self, processes: Seq[EngineProcess]) -> None:
        super().__init__()
        self.processes = list(processes)
        first = self.processes[0]
        self.tokenizer = first.tokenizer
        self.info = {**first.info, "engines": sum(p.info["engines"] for p in self.processes)}

    def choose(self) -> EngineProcess:
        return max(self.processes, key=lambda p: p.free)

    @property
    def compile_state(self) -> dict | None:
        """The groups' compiles, summed (each group's process compiles its own program)."""
        states = [p.compile_state for p in self.processes if p.compile_state is not None]
        if not states:
            return None
        summed = {k: sum(s.get(k, 0) for s in states) for k in ("compiled", "pending", "failed")}
        failures = [f for s in states for f in s.get("failures", [])]
        return {**summed, **({"failures": failures} if failures else {}), "background": states[0]["background"]}

    @property
    def padding(self) -> dict:
        """What the groups' buckets padded so far, summed."""
        return bucket_usage.merged_summaries([p.padding for p in self.processes])

    @property
    def host_memory(self) -> dict:
        """What the groups' processes hold of host memory, summed (each compiled model's bytes over the groups)."""
        return host_memory.summed([p.host_memory for p in self.processes])

    @property
    def rebucketing(self) -> dict:
        """Where the auto buckets stand: one group's, or each group's (``groups``: each decides on its own)."""
        states = [p.rebucketing for p in self.processes]
        return states[0] if len(states) == 1 else ({"groups": states} if any(states) else {})

    def subscribe(self, listener: Callable[[Any], None]) -> Callable[[], None]:
        stops = [p.subscribe(listener) for p in self.processes]
        return lambda: [stop() for stop in stops]

    def load_adapter(self, name: str, path: str) -> None:
        """Every group's engines serve it (each holds its own buffers); one that refuses refuses it for all."""
        for i, process in enumerate(self.processes):
            try:
                process.load_adapter(name, path)
            except BaseException:
                for loaded in self.processes[:i]:
                    loaded.unload_adapter(name)
                raise

    def unload_adapter(self, name: str) -> None:
        for process in self.processes:
            process.unload_adapter(name)

    @property
    def alive(self) -> bool:
        return all(p.alive for p in self.processes)

    def close(self) -> None:
        for process in self.processes:
            process.close()


def start_engines(config: dict, base_dir: str | None, replica: str, cores: int,
                  tensor_parallel_size: int) -> EngineProcess | ProcessGroup:
    """The replica's engines: one process for all its cores, or one per tensor-parallel group of its ``cores``
    (``info`` and ``tokenizer`` describe them for the front end).

    The groups' processes build at once (each compiles its own program); if one fails, the
    others are stopped and its error is raised.
    """
    if tensor_parallel_size == 1:
        return EngineProcess(config, base_dir, replica)
    groups = cores // tensor_parallel_size
    with ThreadPoolExecutor(groups) as starting:
        futures = [starting.submit(EngineProcess, config, base_dir, replica, (i, tensor_parallel_size))
                   for i in range(groups)]
    started, failed = [], None
    for future in futures:
        try:
            started.append(future.result())
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others stop
            failed = failed or exc
    if failed is not None:
        for process in started:
            process.close()
        raise failed
    return ProcessGroup(started)


def _forget_metrics(pid: int) -> None:
    """Drop the worker's live gauges (running, waiting, KV slots) from the replica's metrics."""
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        from prometheus_client import multiprocess  # noqa: PLC0415

        multiprocess.mark_process_dead(pid)
