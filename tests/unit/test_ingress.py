"""Choosing the Ray Serve ingress before Ray starts (neuron_serve.serve.ingress)."""

import subprocess
import sys

import pytest

from neuron_serve.errors import ConfigError
from neuron_serve.serve import ingress

SNIPPET = """
import os
from neuron_serve.serve import ingress
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


def test_unknown_ingress_names_the_choices():
    with pytest.raises(ConfigError, match=r"ingress 'nginx' is unknown; choose one of auto, haproxy, proxy\."):
        ingress.configure("nginx")


def test_haproxy_gets_its_own_stats_and_metrics_ports():
    # Two deployments on one machine must not both bind HAProxy's default 8404 and 9101.
    snippet = ("import os\nfrom neuron_serve.serve import ingress\ningress.configure('haproxy')\n"
               "print(os.environ['RAY_SERVE_HAPROXY_STATS_PORT'], os.environ['RAY_SERVE_HAPROXY_METRICS_PORT'])")
    if not ingress.haproxy_binary():
        pytest.skip("no HAProxy binary here")
    ports = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, check=True).stdout.split()
    assert len(set(ports)) == 2 and not {"8404", "9101"} & set(ports)
