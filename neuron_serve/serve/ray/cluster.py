"""The Ray cluster `neuron-serve` starts or joins: connecting to it, its address, stopping its head.

`deploy` without an address starts a Ray here and serves until stopped; with one it
joins that cluster (its token sent, the metrics directory the first `deploy` chose read
back). Only this process's own Ray is ever stopped or killed.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile

import ray
from ray._private import ray_constants
from ray.experimental import internal_kv

from ... import metrics
from . import grpc_port
from . import ingress

logger = logging.getLogger("neuron_serve")

SERVER_APP = grpc_port.NAMESPACE
METRICS_DIR_KEY = "metrics-dir"


def _token_auth_if_available() -> None:
    """Send Ray's cluster token when joining by address, as Ray does for "auto".

    A local cluster started by ``ray.init()`` (as `neuron-serve deploy` does) requires
    Ray's token (~/.ray/auth_token) since Ray 2.5x, but Ray only sends it by itself when
    it finds the cluster with ``address="auto"``, so `status`/`shutdown --address`
    would be refused. An explicit RAY_AUTH_MODE is respected.
    """
    try:  # the function Ray itself runs for address="auto"; absent in older Rays
        from ray._private.authentication.authentication_token_setup import (  # noqa: PLC0415
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


# Ray gives its raylet 30 s to register with the GCS (node.py); on a machine whose CPUs are all busy it can
# take longer (seen with two servers compiling on 2 vCPUs): such a start is tried again, the half-started
# processes stopped first.
RAY_START_ATTEMPTS = 3
_RAY_START_TIMED_OUT = "timed out during startup"


def _start_ray(runtime_env: dict, dashboard: bool) -> None:
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(namespace=SERVER_APP, logging_level=logging.WARNING, runtime_env=runtime_env,
                     include_dashboard=dashboard)
            return
        except Exception as exc:  # Ray raises a bare Exception for this one
            if _RAY_START_TIMED_OUT not in str(exc) or attempt == RAY_START_ATTEMPTS:
                raise
            logger.warning("Ray's node did not register within Ray's 30 s (the CPUs are busy); starting it again "
                           "(attempt %d of %d)", attempt + 1, RAY_START_ATTEMPTS)
            ray.shutdown()


def connect(address: str | None, dashboard: bool = True) -> bool:
    """Join the Ray cluster at ``address`` (or RAY_ADDRESS); else start one here (with its dashboard, unless
    ``dashboard`` is False).

    Returns True when this process started Ray (and so must stay up to serve).
    """
    address = address or os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        if address:
            _token_auth_if_available()
            ray.init(address=address, namespace=SERVER_APP, logging_level=logging.WARNING)
            # A model (re)deployed into a running server writes its metrics where the
            # server app reads them: the directory the `deploy` that started it chose.
            recorded = internal_kv._internal_kv_get(METRICS_DIR_KEY, namespace=SERVER_APP)  # noqa: SLF001
            if recorded:
                os.environ[metrics.MULTIPROC_ENV] = recorded.decode()
            return False
        os.environ[metrics.MULTIPROC_ENV] = tempfile.mkdtemp(prefix="neuron-serve-metrics-")
        # Ray starts workers at niceness 15 so a laptop's other work comes first; here the
        # replicas are the work, and at 15 any other process (a load generator, a log
        # shipper) takes the CPU from requests in flight. A cluster joined with --address
        # keeps its own setting.
        os.environ.setdefault(ray_constants.RAY_WORKER_NICENESS, "0")
        # Ray starts its cluster with token authentication and warns that it chose that by
        # default; a normal start prints no warning. (Setting RAY_AUTH_MODE here instead
        # comes too late: Ray has read it at import, and its workers then fail to connect.)
        logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
            lambda record: not record.getMessage().startswith("Token authentication is enabled for this Ray cluster"))
        runtime_env = {"env_vars": {metrics.MULTIPROC_ENV: os.environ[metrics.MULTIPROC_ENV]}}
        if hook := ingress.worker_setup_hook():  # inherited by Serve's HAProxyManager actor
            runtime_env["worker_process_setup_hook"] = hook
        _start_ray(runtime_env, dashboard)
        internal_kv._internal_kv_put(METRICS_DIR_KEY, os.environ[metrics.MULTIPROC_ENV], namespace=SERVER_APP)  # noqa: SLF001
        return True
    return False


def ray_address() -> str:
    """The address of the Ray cluster this process is connected to (for --address)."""
    return ray.get_runtime_context().gcs_address


def stop_ray() -> None:
    """Stop the Ray instance this process started (or leave the one it joined)."""
    ray.shutdown()


def head_processes() -> list[tuple[str, subprocess.Popen]]:
    """The GCS and raylet of the Ray instance this process started (none when it joined one)."""
    node = ray._private.worker._global_node  # noqa: SLF001 - Ray keeps its node processes only here
    if node is None or not node.head:
        return []
    wanted = (ray_constants.PROCESS_TYPE_GCS_SERVER, ray_constants.PROCESS_TYPE_RAYLET)
    return [(kind, info.process) for kind in wanted for info in node.all_processes.get(kind, [])]


def kill_head() -> None:
    """Kill the processes of the Ray instance this process started, without asking the
    GCS anything: it may be gone, and every call to it would wait for it (60 s)."""
    node = ray._private.worker._global_node  # noqa: SLF001
    if node is not None and node.head:
        node.kill_all_processes(check_alive=False, allow_graceful=False, wait=False)
