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
2. **OpenAI's routes straight to the generate model.** ``/v1/...`` belongs to the server
   app, which reads the request's ``model`` and forwards the call to that model's replica
   through a Serve handle. With one ``task: generate`` model served (its application's
   ingress deployment is "generate"), HAProxy rewrites ``/v1/...`` to that application's
   own OpenAI routes (``/v2/models/{name}/v1/...``) and sends it to its replicas directly:
   every streamed chunk then skips two process hops (measured: 2.7x the tokens per second
   at 32 concurrent streams). With several, the body decides, so the server app forwards.
"""

from __future__ import annotations

import sys

RENDERER = "ray.serve._private.haproxy"  # imports the template by name
ALWAYS = "http-reuse always"
SAFE = "http-reuse safe"
GENERATE_DEPLOYMENT = "generate"  # generate_deployment.DEPLOYMENT (not imported: it imports Ray Serve)
ROUTES_ANCHOR = "    # Per-backend path ACLs"
# ACLs are evaluated where they are used, so the backend rules below see the rewritten path.
OPENAI_ROUTES = (
    "{%- set generating = backends | selectattr('ingress_deployment_name', 'equalto', '" + GENERATE_DEPLOYMENT
    + "') | list %}\n"
    "{%- if generating | length == 1 %}\n"
    "    # neuron-serve: OpenAI's routes go straight to the one task: generate model's replicas\n"
    "    http-request set-path {{ generating[0].path_prefix }}%[path] if { path_beg /v1/ }\n"
    "{%- endif %}\n"
)
HOOK = f"{__name__}.patch"


def patched(template: str) -> str:
    """Serve's template with both changes (each made once)."""
    template = template.replace(ALWAYS, SAFE)
    if OPENAI_ROUTES not in template:
        if ROUTES_ANCHOR not in template:
            raise RuntimeError("Ray Serve's HAProxy template has changed: no per-backend path ACLs to route "
                               "OpenAI's /v1 before; update neuron_serve/serve/haproxy_template.py")
        template = template.replace(ROUTES_ANCHOR, OPENAI_ROUTES + ROUTES_ANCHOR, 1)
    return template


def patch() -> None:
    """Make Serve render the patched template in this process."""
    from ray.serve._private import haproxy_templates  # noqa: PLC0415

    template = patched(haproxy_templates.HAPROXY_CONFIG_TEMPLATE)
    haproxy_templates.HAPROXY_CONFIG_TEMPLATE = template
    renderer = sys.modules.get(RENDERER)
    if renderer is not None:
        renderer.HAPROXY_CONFIG_TEMPLATE = template
