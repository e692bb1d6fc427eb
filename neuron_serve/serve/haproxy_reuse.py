"""Serve's HAProxy with HAProxy's own default server-connection reuse, ``http-reuse safe``.

Ray Serve's HAProxy template sets ``http-reuse always``: the first request of a new
client connection may go out over an idle connection to a replica that another client
opened. When that replica dies with the request in flight, HAProxy cannot tell a dead
server from an idle connection the server had just closed, so it does what HTTP
prescribes for a reused connection: it closes the client's connection with no answer
and logs nothing, and the client is left to decide whether to send again. A client
that opened a fresh connection for one request sees its request dropped (about one
request per replica kill under load, here).

With ``safe`` the first request of a client connection always goes over a connection
of its own, so a replica dying under it ends in a retry on a live replica
(``retry-on empty-response``) or in the JSON 503 error page, never in silence; later
requests of a keep-alive client connection still share server connections, so the
cost is one server connection per client connection.

The template is rendered inside Serve's HAProxyManager actor, so the change is made
there: :func:`use_safe_reuse` runs as the ``worker_process_setup_hook`` of every Ray
worker that `neuron-serve deploy` starts (it only edits a string, and imports nothing
heavy).
"""

from __future__ import annotations

import sys

RENDERER = "ray.serve._private.haproxy"  # imports the template by name
ALWAYS = "http-reuse always"
SAFE = "http-reuse safe"
HOOK = f"{__name__}.use_safe_reuse"


def use_safe_reuse() -> None:
    """Make Serve render ``http-reuse safe`` in this process."""
    from ray.serve._private import haproxy_templates  # noqa: PLC0415

    template = haproxy_templates.HAPROXY_CONFIG_TEMPLATE.replace(ALWAYS, SAFE)
    haproxy_templates.HAPROXY_CONFIG_TEMPLATE = template
    renderer = sys.modules.get(RENDERER)
    if renderer is not None:
        renderer.HAPROXY_CONFIG_TEMPLATE = template
