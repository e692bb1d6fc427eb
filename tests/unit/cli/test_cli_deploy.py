"""`neuron-serve deploy`'s own arguments, refused before Ray starts."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_no_ray_dashboard_with_a_joined_cluster_is_refused_by_name():
    done = subprocess.run([sys.executable, "-m", "neuron_serve.cli", "deploy", "deployments/mlp.yaml", "--address",
                           "127.0.0.1:6379", "--no-ray-dashboard"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 2
    assert done.stderr.strip().endswith("error: --no-ray-dashboard applies to a Ray started here; a joined cluster "
                                        "keeps its own dashboard")
