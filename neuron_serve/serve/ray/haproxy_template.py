"""Ray Serve's HAProxy template, changed in the processes that render it.

The template is rendered inside Serve's HAProxyManager actor, so the changes are made
there: :func:`patch` runs as the ``worker_process_setup_hook`` of every Ray worker that
`neuron-serve deploy` starts (it only edits a string, and imports nothing heavy).

1. **HAProxy's own default server-connection reuse, ``http-reuse safe``.** Serve's
   template sets ``http-reuse always``: the first request of a new client connection may
   go out over an idle connection to a replica that another client opened. When that
   replica dies with the request in flight, HAProxy cannot tell a dead server from an
   idle connection the server had just closed, so it does what HTTP prescribes for a
   reused connection: it closes the client's connection with no answer and logs nothing,
   and the client is left to decide whether to send again. With ``safe`` the first request
   of a client connection always goes over a connection of its own, so a replica dying
   under it ends in a retry on a live replica (``retry-on empty-response``) or in the JSON
   503 error page, never in silence; later requests of a keep-alive client connection
   still share server connections.
2. **OpenAI's routes straight to the one model that serves them.** ``/v1/...`` belongs to
   the server app, which reads the request's ``model`` and forwards the call to that model's
   replica through a Serve handle. With one ``task: generate`` model served (its
   application's ingress deployment is "generate"), HAProxy rewrites the completion routes
   to that application's own OpenAI routes (``/v2/models/{name}/v1/...``) and sends them to
   its replicas directly: every streamed chunk then skips two process hops (measured: 2.7x
   the tokens per second at 32 concurrent streams). With one pooling model (deployment
   "pooling"), its routes (``/v1/embeddings``, ``/v1/rerank``, ...) go straight to it alike.
   ``/v1/models`` goes to the one such model when it is the only generate or pooling model.
   With several of a kind, the body decides, so the server app forwards.
3. **The gRPC port** (when ``deploy`` sets ``NEURON_SERVE_GRPC_FRONT`` to its host:port):
   HAProxy speaks HTTP/2 to gRPC clients and passes each call to a replica's gRPC-over-
   HTTP/1.1 listener (``grpc_h1``), so the HTTP/2 work is HAProxy's C, not grpcio's
   Python. The model is the first field of every per-model OIP message (``model_name``,
   ``name``), so the start of the body picks the model's replicas, as a path picks them for
   HTTP; any other call (server health and metadata, a model with no listener) goes to the
   server app. The listeners' ports are read from Ray's KV store (``grpc_port``) as the
   configuration is rendered, for the replicas Serve lists.
"""

from __future__ import annotations

import os
import sys
from typing import Any

RENDERER = "ray.serve._private.haproxy"  # imports the template by name
ALWAYS = "http-reuse always"
SAFE = "http-reuse safe"
GENERATE_DEPLOYMENT = "generate"  # generate_deployment.DEPLOYMENT (not imported: it imports Ray Serve)
ROUTES_ANCHOR = "    # Per-backend path ACLs"
# ACLs are evaluated where they are used, so the backend rules below see the rewritten path.
POOLING_DEPLOYMENT = "pooling"  # applications.POOLING (not imported: it imports Ray Serve)
# serve/protocols/openai_pooling.py's ROUTES (not imported: this module is loaded by every Ray worker; a test
# keeps the two equal).
POOLING_ROUTES = ("/v1/embeddings", "/rerank", "/v1/rerank", "/v2/rerank", "/score", "/v1/score", "/classify",
                  "/v1/classify")
OPENAI_ROUTES = (
    "{%- set generating = backends | selectattr('ingress_deployment_name', 'equalto', '" + GENERATE_DEPLOYMENT
    + "') | list %}\n"
    "{%- set pooling = backends | selectattr('ingress_deployment_name', 'equalto', '" + POOLING_DEPLOYMENT
    + "') | list %}\n"
    "{%- if generating | length == 1 %}\n"
    "    # neuron-serve: OpenAI's completion routes go straight to the one task: generate model's replicas\n"
    "    http-request set-path {{ generating[0].path_prefix }}%[path] if { path_beg /v1/completions "
    "/v1/chat/completions }\n"
    "{%- endif %}\n"
    "{%- if pooling | length == 1 %}\n"
    "    # neuron-serve: the pooling routes go straight to the one pooling model's replicas\n"
    "    http-request set-path {{ pooling[0].path_prefix }}%[path] if { path " + " ".join(POOLING_ROUTES) + " }\n"
    "{%- endif %}\n"
    "{%- set listed = generating + pooling %}\n"
    "{%- if listed | length == 1 %}\n"
    "    http-request set-path {{ listed[0].path_prefix }}%[path] if { path_beg /v1/models }\n"
    "{%- endif %}\n"
)
HOOK = f"{__name__}.patch"
GRPC_FRONT_ENV = "NEURON_SERVE_GRPC_FRONT"
SERVER_APP = "neuron-serve"  # grpc_port.NAMESPACE (not imported: it imports Ray)
STATS_ANCHOR = "listen stats\n"
GRPC_FRONT = (
    "{%- set grpc = config.neuron_serve_grpc %}\n"
    "{%- if grpc %}\n"
    "frontend neuron_serve_grpc\n"
    "    # neuron-serve: OIP v2 over gRPC, to the replicas' HTTP/1.1 listeners, by the model the body names\n"
    "    bind {{ grpc.host }}:{{ grpc.port }} proto h2\n"
    "    mode http\n"
    "    log global\n"
    "    option http-buffer-request\n"
    "{%- for route in grpc.routes(backends) %}\n"
    "    use_backend neuron_serve_grpc_{{ loop.index }} if { req.body,bytes(5,{{ route.length }}),hex -m str "
    "{{ route.prefix }} }\n"
    "{%- endfor %}\n"
    "    default_backend neuron_serve_grpc_server\n"
    "{%- for route in grpc.routes(backends) %}\n"
    "backend neuron_serve_grpc_{{ loop.index }}\n"
    "    mode http\n"
    "{%- for server in route.servers %}\n"
    "    server {{ server.name }} {{ server.host }}:{{ server.port }} check\n"
    "{%- endfor %}\n"
    "{%- endfor %}\n"
    "backend neuron_serve_grpc_server\n"
    "    mode http\n"
    "    http-request return status 200 hdr content-type application/grpc hdr grpc-status 14 hdr grpc-message "
    "\"the server is starting: no replica answers gRPC yet; retry shortly\" if { nbsrv(neuron_serve_grpc_server) "
    "eq 0 }\n"
    "{%- for server in grpc.server_app(backends) %}\n"
    "    server {{ server.name }} {{ server.host }}:{{ server.port }} check\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
)


class GrpcFront:
    """What the gRPC section reads as the configuration is rendered: where HAProxy listens,
    and the port of each replica's gRPC listener (by actor name, as Serve names its servers)."""

    def __init__(self, host: str, port: int, listeners: dict[str, int]) -> None:
        self.host = host
        self.port = port
        self.listeners = listeners

    def _servers(self, backend: Any) -> list[dict]:
        return [{"name": f"{server.name}-grpc", "host": server.host, "port": self.listeners[server.replica_id]}
                for server in backend.servers if server.replica_id in self.listeners]

    def routes(self, backends: list) -> list[dict]:
        """One route per model with a listener: the body prefix that names it (hex), and its servers."""
        found = []
        for backend in backends:
            servers = self._servers(backend)
            if servers and backend.app_name != SERVER_APP:
                prefix = model_prefix(backend.app_name)
                found.append({"prefix": prefix.hex().upper(), "length": len(prefix), "servers": servers})
        return found

    def server_app(self, backends: list) -> list[dict]:
        return [s for b in backends if b.app_name == SERVER_APP for s in self._servers(b)]


def model_prefix(name: str) -> bytes:
    """How a message whose field 1 is the string ``name`` starts: its tag, its length (a varint), the name."""
    data = name.encode()
    length, varint = len(data), bytearray()
    while True:
        byte, length = length & 0x7F, length >> 7
        varint.append(byte | (0x80 if length else 0))
        if not length:
            return b"\x0a" + bytes(varint) + data


def _grpc_front(_config: Any) -> GrpcFront | None:
    """The HAProxy config's ``neuron_serve_grpc``: None unless ``deploy`` asked for the gRPC front."""
    where = os.environ.get(GRPC_FRONT_ENV)
    if not where:
        return None
    from . import grpc_port  # noqa: PLC0415 - Ray is loaded in the process that renders

    host, _, port = where.rpartition(":")
    return GrpcFront(host, int(port), grpc_port.h1_ports())


def patched(template: str) -> str:
    """Serve's template with the three changes (each made once)."""
    template = template.replace(ALWAYS, SAFE)
    for section, anchor, what in ((OPENAI_ROUTES, ROUTES_ANCHOR, "per-backend path ACLs to route OpenAI's /v1 "
                                                                 "before"),
                                  (GRPC_FRONT, STATS_ANCHOR, "stats section to add the gRPC front before")):
        if section not in template:
            if anchor not in template:
                raise RuntimeError(f"Ray Serve's HAProxy template has changed: no {what}; update "
                                   f"neuron_serve/serve/ray/haproxy_template.py")
            template = template.replace(anchor, section + anchor, 1)
    return template


def patch() -> None:
    """Make Serve render the patched template in this process."""
    from ray.serve._private import haproxy, haproxy_templates  # noqa: PLC0415

    haproxy.HAProxyConfig.neuron_serve_grpc = property(_grpc_front)
    template = patched(haproxy_templates.HAPROXY_CONFIG_TEMPLATE)
    haproxy_templates.HAPROXY_CONFIG_TEMPLATE = template
    renderer = sys.modules.get(RENDERER)
    if renderer is not None:
        renderer.HAPROXY_CONFIG_TEMPLATE = template
