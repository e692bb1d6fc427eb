"""The persistent compile cache: what a second start of the same model reuses.

One directory (``NEURON_SERVE_CACHE_DIR``, else the user's cache dir) holds:

- ``support/``: operator-support decisions, keyed by operator, argument shapes and
  dtypes, target, versions and the ``compiler_args`` (on Neuron the compiler frontend
  decides, under the flags it is given). Each decision costs a real torch-xla compile of a
  one-op graph, so a warm start skips all of them.
- ``neuronx-cc/``: on Neuron, the Neuron compiler's own cache of NEFFs, keyed by the
  HLO graph hash and compiler version and flags (``NEURON_COMPILE_CACHE_URL``; the
  ``compiler_args`` reach it as ``NEURON_CC_FLAGS``), so a warm start loads NEFFs
  instead of running neuronx-cc. In emulation ``--auto-cast`` changes the graph itself
  (casts inserted before compile), so it changes the compiled executable too.

torch-xla's own persistent cache is not used: in torch-xla 2.9 no PJRT client here
can load the executables it writes ("Deserializing serialized executable not
supported", pytorch/xla#9094). So in emulation each accelerator subgraph is compiled
by XLA:CPU again on every start; the cache skips everything else.

Every entry carries the SHA-256 of its key and payload; an entry that is truncated,
edited or unreadable is logged, removed and recomputed, never used.

Replicas that start together against one cache (the Helm chart's compile-cache volume,
several replicas on a node, a replica added by autoscaling while another builds) compute
each entry once: the process that misses an entry takes its lease (:meth:`CompileCache.lease`:
an ``flock`` on ``leases/<kind>/<digest>.lock``), computes and writes it; the others wait on
the lease, then read what it wrote. The kernel releases a lock when its holder dies (killed
mid-compile, say), so a dead holder never blocks the next; on NFS (EFS) the server does, once
the holder's NFS lease expires. neuronx-cc's NEFF cache (``neuronx-cc/``) is libneuronxla's,
which locks each of its entries itself (``model.hlo.pb.lock`` beside each ``model.hlo.pb``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

logger = logging.getLogger("neuron_serve")

CACHE_ENV = "NEURON_SERVE_CACHE_DIR"
LEASE_POLL_S = 0.02  # how often a process waiting for an entry's lease tries it again
LEASE_NOTICE_S = 1.0  # a wait longer than this is logged at INFO
DISABLE_VALUES = {"off", "none", "0", "false", "disabled"}
APP_NAME = "neuron-serve"


def default_dir() -> Path | None:
    """``NEURON_SERVE_CACHE_DIR`` (``off`` disables the cache), else the user cache dir."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return None if configured.strip().lower() in DISABLE_VALUES else Path(configured).expanduser()
    import platformdirs  # noqa: PLC0415

    return Path(platformdirs.user_cache_dir(APP_NAME))


def key_digest(fields: Any) -> str:
    """The SHA-256 of a JSON-able key (sorted, so equal keys hash equally)."""
    return hashlib.sha256(_canonical(fields)).hexdigest()


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    waited: int = 0  # misses another process was computing: this one waited and read its entry


@dataclass
class CompileCache:
    """A directory of hash-checked JSON entries, grouped by kind."""

    root: Path
    stats: dict[str, CacheStats] = field(default_factory=dict)

    def _path(self, kind: str, digest: str) -> Path:
        return self.root / kind / digest[:2] / f"{digest}.json"

    def _stats(self, kind: str) -> CacheStats:
        return self.stats.setdefault(kind, CacheStats())

    def get(self, kind: str, key: Any) -> Any | None:
        """The payload stored under ``key``, or None (missing or corrupt)."""
        digest = key_digest(key)
        path = self._path(kind, digest)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            self._stats(kind).misses += 1
            return None
        try:
            entry = json.loads(raw)
            intact = entry["sha256"] == hashlib.sha256(_canonical([entry["key"], entry["payload"]])).hexdigest()
            intact = intact and key_digest(entry["key"]) == digest
        except (ValueError, KeyError, TypeError):
            intact = False
        if not intact:
            self._stats(kind).corrupt += 1
            self._stats(kind).misses += 1
            logger.warning("compile cache: %s is corrupt (hash check failed); removing it and recomputing", path)
            path.unlink(missing_ok=True)
            return None
        self._stats(kind).hits += 1
        return entry["payload"]

    def put(self, kind: str, key: Any, payload: Any) -> None:
        """Store ``payload`` under ``key``; atomic, so readers never see half an entry."""
        key = json.loads(_canonical(key))  # the form a reader will hash
        entry = {"key": key, "payload": payload,
                 "sha256": hashlib.sha256(_canonical([key, payload])).hexdigest()}
        path = self._path(kind, key_digest(key))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as handle:
                handle.write(_canonical(entry))
            os.replace(tmp, path)
        except OSError as exc:  # a read-only or full cache must not stop a build
            logger.warning("compile cache: cannot write %s (%s); continuing without caching it", path, exc)


    @contextlib.contextmanager
    def lease(self, kind: str, key: Any) -> Iterator[None]:
        """Hold the right to compute ``key``'s entry: another process (or thread) asking for the same
        key waits until the holder leaves (or dies: the kernel drops its lock). A cache that cannot
        be locked (read-only, a filesystem without locks) is used without a lease."""
        digest = key_digest(key)
        path = self.root / "leases" / kind / f"{digest}.lock"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            logger.warning("compile cache: cannot take the lease %s (%s); computing without it", path, exc)
            yield
            return
        try:
            if not _try_lock(fd):
                self._wait(fd, kind, digest)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _wait(self, fd: int, kind: str, digest: str) -> None:
        """Wait for the lease's holder; said at INFO once the wait passes ``LEASE_NOTICE_S`` (most
        entries take milliseconds, and a line each would bury the build's own)."""
        holder, started, told = _holder(fd), time.monotonic(), False
        logger.debug("compile cache: waiting for %s, which computes %s entry %s", holder, kind, digest[:12])
        while not _try_lock(fd):
            if not told and time.monotonic() - started > LEASE_NOTICE_S:
                logger.info("compile cache: waiting for %s, which computes %s entry %s", holder, kind, digest[:12])
                told = True
            time.sleep(LEASE_POLL_S)
        self._stats(kind).waited += 1
        (logger.info if told else logger.debug)("compile cache: %s entry %s was computed by %s; waited %.1f s",
                                                kind, digest[:12], holder, time.monotonic() - started)

    def get_or_compute(self, kind: str, key: Any, compute: Callable[[], Any], *, missed: bool = False) -> Any:
        """The entry under ``key``, computed by ``compute()`` (and stored) when missing; computed
        once across processes: a miss takes the key's lease and looks again before computing.
        ``missed``: the caller has just looked it up and missed (not counted twice)."""
        stored = None if missed else self.get(kind, key)
        if stored is not None:
            return stored
        with self.lease(kind, key):
            stored = self._read_after_wait(kind, key)
            if stored is not None:
                return stored
            payload = compute()
            self.put(kind, key, payload)
            return payload

    def _read_after_wait(self, kind: str, key: Any) -> Any | None:
        """The entry a holder wrote while this process waited for its lease (not a second miss)."""
        stats = self._stats(kind)
        misses = stats.misses
        stored = self.get(kind, key)
        stats.misses = misses - 1 if stored is not None else misses  # found after all, or the same miss
        return stored


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _holder(fd: int) -> str:
    """Who holds a lease, as its holder wrote it ("pid 123 on host")."""
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
    except OSError:
        return "another process"


_CACHE: CompileCache | None = None
_CONFIGURED = False


def configure(root: str | Path | None = None) -> CompileCache | None:
    """Open the process's cache at ``root`` (default: :func:`default_dir`)."""
    global _CACHE, _CONFIGURED
    path = Path(root).expanduser() if root is not None else default_dir()
    _CACHE = CompileCache(path) if path is not None else None
    _CONFIGURED = True
    if _CACHE is not None:
        _open_executable_cache(_CACHE.root)
    return _CACHE


def current() -> CompileCache | None:
    """The process's cache, opened from the environment on first use."""
    if not _CONFIGURED:
        configure()
    return _CACHE


def _open_executable_cache(root: Path) -> None:
    """On Neuron, keep neuronx-cc's NEFF cache in ``root`` (unless already configured)."""
    os.environ.setdefault("NEURON_COMPILE_CACHE_URL", str(root / "neuronx-cc"))
