"""Deploying and stopping: the models' and the server app's Serve applications, from `neuron-serve`.

`deploy` runs each model as its own application (the replicas are in `deployment`) and
the server app, waits until Serve runs them all and every port answers (`readiness`), and
`shutdown` drains and stops them: the models first, then HAProxy's front, then Serve.
"""

from __future__ import annotations

import logging
import time

import ray
from ray import serve
from ray.experimental import internal_kv

from ...buckets import usage as bucket_usage
from ...config.schema import ModelConfig
from ..http import auth
from .. import failure
from . import compile_state, ingress, padding_state, readiness
from .cluster import head_processes
from .deployment import DRAIN_S, SERVER_APP, model_application, server_application

logger = logging.getLogger("neuron_serve")

HAPROXY_ADMIN_KEY = "haproxy-admin-socket"
# How long deploy waits, once Serve runs every application, for every port to answer (readiness).
PORTS_WAIT_S = 120.0


def _not_reconnecting(record: logging.LogRecord) -> bool:
    """False for Serve's line that ``serve.run`` connects to the running Serve instance.

    serve.run says so for every application, adding "New http_options/controller_options will
    not be applied": none are given past ``serve.start``, so nothing is lost, yet on a normal
    start-up the line reads like a warning that settings were ignored.
    """
    return not record.getMessage().startswith("Connecting to existing Serve app")


def deploy(configs: list[tuple[ModelConfig, str | None]], host: str, port: int, timeout_s: float = 1800,
           grpc: dict | None = None) -> dict[str, str]:
    """Deploy every model and the server app (with the gRPC service when ``grpc`` says
    where); wait until all are ready or one fails.

    A model already served (`deploy --address` into a running server) is redeployed in
    place: Ray Serve starts the new replicas, routes to them once they are built, and
    only then drains and stops the old ones, so the model keeps answering throughout. A
    server app already running is kept as it is (it holds the gRPC port, and serves
    health and metrics for every model, whatever their config).
    """
    # Refuses bad auth before starting anything.
    server = server_application([c for c, _ in configs], grpc, ports_checked=True)
    serve.start(http_options={"host": host, "port": port})
    logging.getLogger("ray.serve").addFilter(_not_reconnecting)
    try:
        running = serve.status().applications
    except serve.exceptions.RayServeException:
        running = {}
    keep_server = SERVER_APP in running and "RUNNING" in str(running[SERVER_APP].status)
    if head_processes() and ingress.json_error_page():  # only the HAProxy of a Ray started here
        logger.debug("HAProxy's error page is JSON")
        # For `neuron-serve shutdown` (another process) to drain HAProxy as deploy does.
        if ingress.admin_location():
            internal_kv._internal_kv_put(HAPROXY_ADMIN_KEY, ingress.admin_location(), namespace=SERVER_APP)  # noqa: SLF001
    # Every application at once, the wait below: serve.run waits for each application in turn, so the models'
    # replicas started one model after another and the server app's after them all (7 s of a one-model start).
    targets = [serve.RunTarget(model_application(config, base_dir, grpc), name=config.name,
                               route_prefix=f"/v2/models/{config.name}") for config, base_dir in configs]
    if not keep_server:
        targets.append(serve.RunTarget(server, name=SERVER_APP, route_prefix="/"))
    serve.run_many(targets, wait_for_applications_running=False)
    deadline = time.monotonic() + timeout_s
    names = {c.name for c, _ in configs}
    while True:
        apps = serve.status().applications
        states = {n: str(apps[n].status) if n in apps else "MISSING" for n in names | {SERVER_APP}}
        failed = [n for n, s in states.items() if "DEPLOY_FAILED" in s]
        if failed:  # the replicas' own error (the model's), not Serve's generic message
            return {n: f"failed: {build_failure(n)}" for n in failed}
        if all("RUNNING" in s for s in states.values()):
            # Running is not yet answering: wait until every port does, for every model.
            infer = [c.name for c, _ in configs if c.task != "generate"]  # generate replicas serve no gRPC
            http = serve.context._get_global_client().http_config  # noqa: SLF001 - a joined cluster's own port
            silent = readiness.wait(sorted(names), infer, http.host or host, http.port or port, grpc,
                                    auth.resolve_token(configs[0][0]), min(deadline, time.monotonic() + PORTS_WAIT_S))
            if silent:
                return {n: f"running, but its ports do not all answer: {silent}" for n in names}
            return {n: "ready" for n in names}
        if time.monotonic() > deadline:
            return {n: s for n, s in states.items()}
        time.sleep(1)


def build_failure(name: str) -> str:
    """Why application ``name`` failed to start: the model's own error when a replica
    raised it, else Serve's messages."""
    app = serve.status().applications.get(name)
    if app is None:
        return "the application is gone"
    messages = [app.message, *(d.message for d in app.deployments.values())]
    logger.debug("%s failed to start: %s", name, messages)
    return failure.model_error(messages)


def status() -> dict[str, dict]:
    """Every application's state and message; for a model, its replicas' compiled models by state
    (``compile``: summed over its replicas, then each replica's), while some compile in the background, and what
    its buckets padded (``padding``: its replicas' counts added up, as a model's metadata says of one replica)."""
    apps = serve.status().applications
    compiling = compile_state.read()
    padded = padding_state.read()
    found = {}
    for name, app in apps.items():
        found[name] = {"status": str(app.status), "message": app.message}
        replicas = compiling.get(name)
        if replicas:
            found[name]["compile"] = {state: sum(r.get(state, 0) for r in replicas.values())
                                      for state in ("compiled", "pending", "failed")}
            found[name]["compile"]["replicas"] = replicas
        if any(padded.get(name, {}).values()):
            found[name]["padding"] = bucket_usage.merged_summaries(list(padded[name].values()))
            found[name]["padding_replicas"] = len(padded[name])
    return found


def shutdown(names: list[str] | None = None, progress=lambda message: None) -> None:
    """Stop the named models, or every model and then the server.

    Models go first, one ``serve.delete`` each: Serve stops routing to their replicas
    and waits for the requests they hold to finish (graceful_shutdown_timeout_s), while
    new requests get a JSON 404/503 from the server app. Only then does
    ``serve.shutdown`` stop the ingress. When `deploy` started this Ray with HAProxy in
    front (on this machine; it records where in Ray's KV store), HAProxy answers new
    requests itself (JSON 503, Retry-After) from the start and closes its port before
    Serve stops it (`ingress.close_http`), so no connection it accepted is dropped.
    ``progress`` is told what each step waits for.
    """
    if names:
        readiness.forget(names)  # deployed again, a model is checked again before it is called ready
        compile_state.forget(names)
        padding_state.forget(names)
        for name in names:
            progress(f"stopping model {name!r}: waiting for its in-flight requests (at most {DRAIN_S} s)")
            serve.delete(name)
        return
    try:
        apps = [name for name in serve.status().applications if name != SERVER_APP]
    except (serve.exceptions.RayServeException, ray.exceptions.RayActorError):
        # RayActorError: its controller was stopped (`neuron-serve shutdown`) or killed
        # (a signal to the whole process group) after this process last reached it.
        progress("Ray Serve is not running (already shut down)")
        return
    haproxy = _haproxy_admin()
    if haproxy and _haproxy(lambda: ingress.refuse_new_requests(haproxy), progress):
        progress(f"new requests are answered 503 with Retry-After: {ingress.RETRY_AFTER_S}")
    if apps:
        # All at once: each drains on its own replicas, so the wait is the longest drain.
        progress(f"stopping {', '.join(map(repr, apps))}: waiting for in-flight requests (at most {DRAIN_S} s)")
        for name in apps:
            serve.delete(name, _blocking=False)
        while set(apps) & set(serve.status().applications):
            time.sleep(0.2)
    if haproxy:
        _haproxy(lambda: ingress.close_http(haproxy, progress), progress)
    progress("stopping Ray Serve (its controller and HTTP ingress)")
    readiness.forget()
    compile_state.forget()
    padding_state.forget()
    _stop_serve(progress)


def _stop_serve(progress, timeout_s: float = 30.0) -> None:
    """``serve.shutdown()``, without the alarming line Ray prints for it on a normal stop.

    Serve's controller stops by killing itself while the ``graceful_shutdown`` call that asked
    it to is still running. Its methods are retried without limit (the controller's
    max_task_retries is -1), so the caller's Ray reports that call's end as a failure to retry:
    ``(raylet) Task ServeController.graceful_shutdown failed. There are infinite retries
    remaining, so the task will be retried. Error: The actor is dead because it was killed by
    `ray.kill`.`` The same call made without retries ends in the RayActorError that a stopped
    controller means, and nothing is printed.
    """
    from ray.serve import context  # noqa: PLC0415

    client = context._get_global_client(raise_if_no_controller_running=False)  # noqa: SLF001
    if client is None:
        return
    client.shutdown_cached_handles()
    try:
        ray.get(client._controller.graceful_shutdown.options(max_task_retries=0).remote(),  # noqa: SLF001
                timeout=timeout_s)
    except ray.exceptions.RayActorError:
        pass  # the controller has stopped, as asked
    except ray.exceptions.GetTimeoutError:
        progress(f"Ray Serve's controller did not stop within {timeout_s:.0f} s; stopping Ray anyway")
    context._disconnect()  # noqa: SLF001


def _haproxy_admin() -> str | None:
    """The HAProxy admin socket location that `deploy` recorded in Ray, if any."""
    value = internal_kv._internal_kv_get(HAPROXY_ADMIN_KEY, namespace=SERVER_APP)  # noqa: SLF001
    return value.decode() if value else None


def _haproxy(step, progress) -> bool:
    try:
        return step()
    except OSError as exc:  # HAProxy is gone already: nothing to drain there
        progress(f"HAProxy's admin socket did not answer ({exc})")
        return False
