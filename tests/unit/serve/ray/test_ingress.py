"""Choosing the Ray Serve ingress before Ray starts (neuron_serve.serve.ray.ingress)."""

import socket
import subprocess
import sys

import pytest

from neuron_serve.errors import ConfigError
from neuron_serve.serve.ray import ingress
from neuron_serve.serve import ports

SNIPPET = """
import os
from neuron_serve.serve.ray import ingress
chosen = ingress.configure({kind!r})
print(chosen, os.environ.get("RAY_SERVE_ENABLE_HA_PROXY"), os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED"))
"""


def _configure_in_fresh_process(kind: str, env_extra: dict | None = None) -> str:
    # A fresh interpreter: Ray must not be imported yet when the ingress is chosen.
    result = subprocess.run([sys.executable, "-c", SNIPPET.format(kind=kind)], capture_output=True, text=True,
                            check=True, env={**__import__("os").environ, **(env_extra or {})})
    return result.stdout.strip()


def test_auto_picks_haproxy_when_its_binary_is_installed():
    expected = "haproxy 1 1" if ingress.haproxy_binary() else "proxy None None"
    assert _configure_in_fresh_process("auto") == expected


def test_proxy_clears_inherited_haproxy_settings():
    out = _configure_in_fresh_process("proxy", {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"})
    assert out == "proxy None None"


def test_serve_waits_30_s_for_a_starting_proxy_unless_told_otherwise():
    # Serve's 5 s killed HAProxy managers still starting on a busy machine, and failed the deploy.
    snippet = ("import os\nfrom neuron_serve.serve.ray import ingress\ningress.configure('proxy')\n"
               "print(os.environ['RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S'])")
    env = {k: v for k, v in __import__("os").environ.items() if k != "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"}
    run = lambda extra: subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, check=True,
                                       env={**env, **extra}).stdout.strip()
    assert run({}) == "30"
    assert run({"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "7"}) == "7"


def test_unknown_ingress_names_the_choices():
    with pytest.raises(ConfigError, match=r"ingress 'nginx' is unknown; choose one of auto, haproxy, proxy\."):
        ingress.configure("nginx")


def test_haproxy_gets_its_own_stats_and_metrics_ports():
    # Two deployments on one machine must not both bind HAProxy's default 8404 and 9101.
    snippet = ("import os\nfrom neuron_serve.serve.ray import ingress\ningress.configure('haproxy')\n"
               "print(os.environ['RAY_SERVE_HAPROXY_STATS_PORT'], os.environ['RAY_SERVE_HAPROXY_METRICS_PORT'])")
    if not ingress.haproxy_binary():
        pytest.skip("no HAProxy binary here")
    ports = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, check=True).stdout.split()
    assert len(set(ports)) == 2 and not {"8404", "9101"} & set(ports)


def test_haproxy_ports_avoid_the_deploys_own_ports():
    # The deploy's --port and --grpc-port are bound by replicas seconds after HAProxy's
    # ports are drawn; in a band of four ports with two reserved, HAProxy gets the other two.
    low = _free_run(4)
    band = (low, low + 4)
    snippet = ("import os\nfrom neuron_serve.serve import ports\nfrom neuron_serve.serve.ray import ingress\n"
               f"ports.BAND = {band}\ningress.configure('haproxy', reserved_ports={{{low}, {low + 1}}})\n"
               "print(os.environ['RAY_SERVE_HAPROXY_STATS_PORT'], os.environ['RAY_SERVE_HAPROXY_METRICS_PORT'])")
    if not ingress.haproxy_binary():
        pytest.skip("no HAProxy binary here")
    drawn = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, check=True).stdout.split()
    assert sorted(map(int, drawn)) == [low + 2, low + 3]


def _free_run(length: int) -> int:
    """The first of ``length`` consecutive ports that are free now."""
    while True:
        low = ports.free_port("127.0.0.1")
        if all(_bindable(port) for port in range(low, low + length)):
            return low


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def test_free_port_never_returns_an_avoided_port(monkeypatch):
    low = _free_run(2)
    monkeypatch.setattr(ports, "BAND", (low, low + 2))
    assert {ports.free_port("127.0.0.1", avoid={low}) for _ in range(20)} == {low + 1}


def _haproxy_in(files, port: int) -> subprocess.Popen:
    """A real HAProxy run from a `deploy` files directory, as Ray Serve runs it."""
    node = files / "node"
    node.mkdir()
    config = node / "haproxy.cfg"
    config.write_text(f"defaults\n    mode http\n    timeout connect 1s\n    timeout client 1s\n    timeout server 1s\n"
                      f"frontend http_frontend\n    bind 127.0.0.1:{port}\n    http-request return status 200\n")
    proc = subprocess.Popen([ingress.haproxy_binary(), "-db", "-f", str(config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import time  # noqa: PLC0415

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # listening: it answers
        try:
            import socket  # noqa: PLC0415

            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    return proc


def test_haproxy_left_by_a_gone_deploy_is_stopped_and_a_live_ones_kept(tmp_path):
    import os  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    if not ingress.haproxy_binary():
        pytest.skip("no HAProxy binary here")
    # A root of its own, so that no other deploy's HAProxy on this machine is considered.
    gone = Path(tempfile.mkdtemp(prefix=ingress.FILES_PREFIX, dir=tmp_path))
    live = Path(tempfile.mkdtemp(prefix=ingress.FILES_PREFIX, dir=tmp_path))
    # An owner that has exited: this test's own pid with another start time.
    (gone / ingress.OWNER_FILE).write_text(f"{os.getpid()}:1")
    (live / ingress.OWNER_FILE).write_text(ingress._identity(os.getpid()))  # noqa: SLF001
    orphan = _haproxy_in(gone, ingress.free_port())
    kept = _haproxy_in(live, ingress.free_port())
    try:
        reaped = ingress.reap_orphans(str(tmp_path))
        assert orphan.wait(timeout=10) == -9  # SIGKILL
        assert reaped == [orphan.pid]
        assert not gone.exists()
        assert kept.poll() is None and live.exists()
    finally:
        for proc in (orphan, kept):
            proc.kill()
            proc.wait()
        shutil.rmtree(gone, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


def test_free_ports_avoid_the_ranges_a_starting_ray_draws_from():
    """A deploy's ports are chosen before Ray starts tens of processes that bind ports of
    the kernel's ephemeral range (and replicas Serve's 30000+): ours stay clear of both."""
    ephemeral_low = int(ports.EPHEMERAL_RANGE.read_text().split()[0])
    chosen = {ports.free_port() for _ in range(50)} | {ports.free_port("127.0.0.1") for _ in range(50)}
    assert all(20000 <= port < min(30000, ephemeral_low) for port in chosen), sorted(chosen)
    assert len(chosen) > 10  # drawn at random, so two deploys started together differ


def test_the_template_hook_turns_serves_always_into_safe_and_routes_openai_and_grpc():
    """Ray Serve's template still says `http-reuse always` and has the per-backend ACLs and
    the stats section (else the hook has nothing to change and this fails, pointing here);
    the hook renders `safe` instead, the OpenAI route before the ACLs, the gRPC front
    before the stats section, and gives the template's config the front's settings."""
    code = (
        "from ray.serve._private import haproxy_templates as t\n"
        "assert 'http-reuse always' in t.HAPROXY_CONFIG_TEMPLATE\n"
        "from neuron_serve.serve.ray import haproxy_template as h\n"
        "h.patch()\n"
        "h.patch()\n"
        "from ray.serve._private import haproxy\n"
        "for text in (t.HAPROXY_CONFIG_TEMPLATE, haproxy.HAPROXY_CONFIG_TEMPLATE):\n"
        "    assert 'http-reuse always' not in text and text.count('http-reuse safe') >= 1\n"
        "    assert text.count(h.OPENAI_ROUTES) == 1 and text.index(h.OPENAI_ROUTES) < text.index(h.ROUTES_ANCHOR)\n"
        "    assert text.count(h.GRPC_FRONT) == 1 and text.index(h.GRPC_FRONT) < text.index(h.STATS_ANCHOR)\n"
        "assert haproxy.HAProxyConfig().neuron_serve_grpc is None  # deploy did not ask for it\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("deployments, rewritten", [
    # one generate model: its completion routes and the model list go to it
    (["model", "generate"], {"/v1/completions": "/v2/models/b", "/v1/models": "/v2/models/b"}),
    (["generate", "generate"], {}),  # several: the server app reads the body's model
    (["model"], {}),
    # one pooling model: its routes go to it; the model list to the server app when it lists two
    (["pooling", "generate"], {"/v1/embeddings": "/v2/models/a", "/v2/rerank": "/v2/models/a",
                               "/v1/completions": "/v2/models/b", "/v1/models": None}),
    (["pooling", "model"], {"/v1/score": "/v2/models/a", "/v1/models": "/v2/models/a"}),
    (["pooling", "pooling"], {"/v1/embeddings": None}),
])
def test_openai_routes_go_to_the_one_model_that_serves_them(deployments, rewritten):
    import re
    from types import SimpleNamespace

    from jinja2 import Environment

    from neuron_serve.serve.ray import haproxy_template

    backends = [SimpleNamespace(ingress_deployment_name=d, path_prefix=f"/v2/models/{name}")
                for d, name in zip(deployments, "ab")]
    rendered = Environment().from_string(haproxy_template.OPENAI_ROUTES).render(backends=backends)
    rules = re.findall(r"set-path (\S+)%\[path\] if \{ (path_beg|path) ([^}]+) \}", rendered)

    def routed(path: str) -> str | None:  # HAProxy's first matching rule
        for prefix, kind, paths in rules:
            if any(path.startswith(p) if kind == "path_beg" else path == p for p in paths.split()):
                return prefix
        return None

    assert {path: routed(path) for path in rewritten} == rewritten
    if not rewritten:
        assert "set-path" not in rendered


def test_the_pooling_routes_haproxy_sends_to_a_pooling_model_are_the_codec_s():
    from neuron_serve.serve.protocols.openai_pooling import ROUTES
    from neuron_serve.serve.ray import haproxy_template

    assert set(haproxy_template.POOLING_ROUTES) == set(ROUTES)