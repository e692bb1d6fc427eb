"""How `neuron-serve deploy` serves until it is stopped, and how it stops quickly.

The process that started the embedded Ray owns it, so it watches two things while it
serves: SIGINT/SIGTERM, which drain the models and stop Ray in order, each step logged
with what it waits for; and the Ray head's own processes (GCS and raylet), whose death
leaves nothing to serve with, so it exits at once with a message and a non-zero code.
Every graceful step is bounded: past the drain time plus a grace period, or on a
second signal, Ray's processes are killed and the process exits. Nothing here talks to
the GCS after it is gone: Ray's client would wait 60 s for it to come back.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import ModuleType
from typing import NoReturn

# Past the drain, the few steps left (Serve's controller, Ray) get this long.
GRACE_S = 15.0
HEAD_POLL_S = 0.5
HEAD_EXIT_S = 5.0  # how long a failed stopping step waits to learn whether the head is exiting
EXIT_HEAD_LOST = 1
EXIT_STOP_TIMEOUT = 1


class Interrupted(Exception):
    """A stop signal arrived while the models were still starting."""


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Lifecycle:
    """Signals and head watching for one `deploy` process; see the module docstring.

    ``deploy`` is `neuron_serve.serve.ray.deploy` and ``cluster``
    `neuron_serve.serve.ray.cluster` (passed in, so that this module never imports Ray). Install it before deploying, so a signal during start-up stops
    the start-up too (`Interrupted`).
    """

    def __init__(self, deploy: ModuleType, cluster: ModuleType, drain_s: float) -> None:
        self.deploy = deploy
        self.cluster = cluster
        self.drain_s = drain_s
        self.stop = threading.Event()
        self.signal_name: str | None = None
        self.head_lost: str | None = None
        self.serving = False
        self.step = "in-flight requests"
        self.started_stopping: float | None = None
        self.stopping_ray = False

    def install(self) -> None:
        """Handle SIGINT and SIGTERM from now on."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            _say(f"{name} again: stopping Ray now without waiting for {self.step}")
            self._abort(128 + signum)
        self.signal_name = name
        self.stop.set()
        if not self.serving:
            raise Interrupted(name)

    def serve_forever(self) -> NoReturn:
        """Serve until a signal or the head's death; then stop and exit the process."""
        self.serving = True
        watcher = threading.Thread(target=self._watch_head, name="ray-head-watch", daemon=True)
        watcher.start()
        self.stop.wait()
        if self.head_lost is not None and self.signal_name is None:
            _say(f"error: {self.head_lost}; the models cannot be served without it. Stopping.")
            self._abort(EXIT_HEAD_LOST)
        return self.shutdown(f"{self.signal_name}")

    def shutdown(self, why: str) -> NoReturn:
        """Drain and stop, logging each step, within the drain time plus GRACE_S; then exit 0."""
        self.started_stopping = time.monotonic()
        limit = self.drain_s + GRACE_S
        timer = threading.Timer(limit, self._overdue, args=(limit,))
        timer.daemon = True
        timer.start()
        self.stop.set()  # the head watcher keeps watching: a head that dies now ends the wait
        _say(f"shutting down ({why}): draining in-flight requests, then stopping Ray Serve and Ray "
             f"(at most {limit:.0f} s)")
        heads = self.cluster.head_processes()  # kept: Ray forgets them once it stops
        try:
            self.deploy.shutdown(progress=self._progress)
            self._progress("stopping Ray")
            self.stopping_ray = True  # its processes end now, as they should
            self.cluster.stop_ray()
        except Exception as exc:
            # Raised out of here, the error would reach Ray's excepthook, which reports it
            # to the GCS: a GCS that a supervisor's signal to the whole group just ended
            # turns that report into a crash of this process.
            self._stop_failed(exc, heads)
        timer.cancel()
        _say(f"stopped in {time.monotonic() - self.started_stopping:.1f} s")
        # Ray is stopped; the interpreter's own teardown (Ray's and torch's atexit hooks,
        # their threads) took seconds more on a busy machine and has nothing left to do.
        sys.stdout.flush()
        os._exit(0)

    def _progress(self, step: str) -> None:
        self.step = step
        elapsed = time.monotonic() - (self.started_stopping or time.monotonic())
        _say(f"shutting down [{elapsed:.1f} s]: {step}")

    def _stop_failed(self, exc: Exception, heads: list) -> NoReturn:
        """A stopping step raised: because the head died meanwhile (exit 0), or not (exit 1)."""
        deadline = time.monotonic() + HEAD_EXIT_S  # a signalled head may still be exiting
        while time.monotonic() < deadline:
            for kind, process in heads:
                code = process.poll()
                if code is not None and self.signal_name is not None:
                    self._head_died(kind, process.pid, code)  # says so and exits 0
            time.sleep(HEAD_POLL_S / 5)
        _say(f"error while stopping ({self.step}): {type(exc).__name__}: {exc}. Stopping Ray now.")
        self._abort(EXIT_STOP_TIMEOUT)

    def _overdue(self, limit: float) -> None:
        _say(f"error: still stopping after {limit:.0f} s, waiting for: {self.step}. Stopping Ray now.")
        self._abort(EXIT_STOP_TIMEOUT)

    def _watch_head(self) -> None:
        processes = self.cluster.head_processes()
        while not self.stopping_ray:
            for kind, process in processes:
                code = process.poll()
                if code is not None and not self.stopping_ray:
                    self._head_died(kind, process.pid, code)
                    return
            time.sleep(HEAD_POLL_S)

    def _head_died(self, kind: str, pid: int, code: int) -> None:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        self.head_lost = f"Ray's {kind} (pid {pid}) {how}"
        if self.signal_name is None:
            self.stop.set()  # serve_forever reports it and exits
            return
        # Stopping already (a supervisor signalled the whole process group, Ray too):
        # whatever is left to drain is gone with the head, and waiting on it would hang.
        elapsed = time.monotonic() - (self.started_stopping or time.monotonic())
        _say(f"shutting down [{elapsed:.1f} s]: {self.head_lost} meanwhile, so there is nothing left to drain; "
             f"stopping without waiting for {self.step}")
        self._abort(0)

    def _abort(self, code: int) -> NoReturn:
        try:
            self.cluster.kill_head()
        finally:
            sys.stderr.flush()
            # os._exit: Ray's atexit hook would wait for the GCS that is gone.
            os._exit(code)
