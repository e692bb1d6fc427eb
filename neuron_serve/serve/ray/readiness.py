"""What "ready" means: every port the server opens answers for every model.

Serve calls an application RUNNING once its replicas are constructed, but the ports
clients use are routed to them later: HAProxy is reconfigured a moment after (its gRPC
front, by the listeners registered in Ray's KV store, can lag behind its HTTP routes), and
without HAProxy the server app still holds the shared gRPC port until it hands it over.
So ``deploy`` makes real calls through the public ports, as a client connecting then
would, until each answers: over HTTP each model's ``/v2/models/{name}/ready`` and
``/metrics``; over gRPC ServerReady and each model's ModelReady (`grpc_port.answers`).
It then records the models it checked in Ray's KV store, and the server app's
``/v2/health/ready`` (and ``/health``) answer 200 only once every model is recorded
(`unchecked`), so a probe's 200 promises what deploy's ready line does. Only then
does deploy print that line.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

from ray.experimental import internal_kv

from . import grpc_port
from ..http.app import HEALTH_READY, METRICS_PATH
from .cluster import head_processes

NAMESPACE = grpc_port.NAMESPACE
CHECKED_KEY = "ports-answer"  # JSON list: the models whose ports deploy saw answer
FRONT_KEY = "grpc-front-address"  # JSON {"host", "port"}: where the HAProxy of the deploy that started Ray binds gRPC
POLL_S = 0.2
CHECKED_TTL_S = 1.0
HTTP_TIMEOUT_S = 5.0


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _http_problem(url: str, token: str | None) -> str | None:
    """None when ``url`` answers 200, else what it answered."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=HTTP_TIMEOUT_S) as answer:
            return None if answer.status == 200 else f"HTTP {url}: {answer.status}"
    except urllib.error.HTTPError as err:
        body = err.read()[:200].decode(errors="replace")
        return f"HTTP {url}: {err.code} {body}"
    except OSError as exc:
        return f"HTTP {url}: {exc}"


def _front(grpc: dict) -> dict:
    """``grpc`` with where HAProxy's gRPC front listens: these options when this deploy started
    the Ray (recorded for the deploys that join it), else what that deploy recorded."""
    if head_processes():
        where = {"host": grpc["host"], "port": grpc["port"]}
        internal_kv._internal_kv_put(FRONT_KEY, json.dumps(where), namespace=NAMESPACE)  # noqa: SLF001
        return grpc
    recorded = internal_kv._internal_kv_get(FRONT_KEY, namespace=NAMESPACE)  # noqa: SLF001
    return {**grpc, **json.loads(recorded)} if recorded else grpc


def wait(models: list[str], infer: list[str], host: str, port: int, grpc: dict | None, token: str | None,
         deadline: float) -> str | None:
    """Wait until every port answers for each of ``models`` (``infer``: those served over gRPC
    too) at HTTP ``host:port`` (Serve's) and where ``grpc`` says, record them, and wait for the
    server app's readiness to say so; None then, else what still did not answer at ``deadline``."""
    base = f"http://{_local(host)}:{port}"
    urls = [f"{base}/v2/models/{name}/ready" for name in models] + [base + METRICS_PATH]
    front = bool(grpc and grpc.get("front"))
    if front:
        grpc = _front(grpc)
    if grpc and infer and not front:
        grpc_port.wait_for_hand_over()  # the server app leaves the shared port to the models' replicas
    while True:
        problem = next(filter(None, (_http_problem(url, token) for url in urls)), None)
        if problem is None and grpc:
            # Behind HAProxy an infer model's calls must reach its own replicas; a generate
            # model's replicas serve no gRPC (the server app answers for them).
            problem = grpc_port.answers(grpc, models, infer if front else [], token)
        if problem is None:
            break
        if time.monotonic() > deadline:
            return problem
        time.sleep(POLL_S)
    record(models)
    while (problem := _http_problem(base + HEALTH_READY, None)) is not None:
        if time.monotonic() > deadline:
            return problem
        time.sleep(POLL_S)
    return None


def _read() -> set[str]:
    value = internal_kv._internal_kv_get(CHECKED_KEY, namespace=NAMESPACE)  # noqa: SLF001
    return set(json.loads(value)) if value else set()


def _write(models: set[str]) -> None:
    internal_kv._internal_kv_put(CHECKED_KEY, json.dumps(sorted(models)), namespace=NAMESPACE)  # noqa: SLF001


def record(models: list[str]) -> None:
    """Add ``models`` to those whose ports answered (deploy, once they all did)."""
    _write(_read() | set(models))


def forget(models: list[str] | None = None) -> None:
    """Drop ``models`` (or every model) from the record: they are being stopped, and a model
    deployed again under the same name is checked again."""
    if models is None:
        internal_kv._internal_kv_del(CHECKED_KEY, namespace=NAMESPACE)  # noqa: SLF001
    else:
        _write(_read() - set(models))


_checking = False  # this process's server app answers ready only for models whose ports deploy saw answer


def check_ports(on: bool) -> None:
    """Make this process's readiness wait for deploy's record (the server app of a ``deploy``).

    Set here, from the server app's constructor, not as a global of the deployment's module:
    Serve's decorators replace the class in its module, so the replica gets the class pickled
    by value, and a ``global`` assigned in its methods lands in a copy of the module's globals
    that the readiness route never reads. (It did: /v2/health/ready then answered 200 as soon as
    Serve ran every application, before HAProxy routed gRPC to the server app, and a client
    starting on that 200 got UNAVAILABLE "the server is starting" for its first calls.)
    """
    global _checking
    _checking = on


def checks_ports() -> bool:
    """Whether readiness waits for deploy's record of the ports (see :func:`check_ports`)."""
    return _checking


_checked_cache: tuple[float, set[str]] = (float("-inf"), set())


async def unchecked(models: list[str]) -> set[str]:
    """Those of ``models`` whose ports deploy has not seen answer (the record in Ray's KV store,
    read again after CHECKED_TTL_S, or after POLL_S while it lacks one of them)."""
    global _checked_cache
    stamp, checked = _checked_cache
    missing = set(models) - checked
    if time.monotonic() - stamp >= (POLL_S if missing else CHECKED_TTL_S):
        checked = await asyncio.get_running_loop().run_in_executor(None, _read)
        _checked_cache = (time.monotonic(), checked)
        missing = set(models) - checked
    return missing
