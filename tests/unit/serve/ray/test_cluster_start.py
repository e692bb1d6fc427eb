"""Starting the embedded Ray: a node start that times out on a busy machine is tried again, nothing else is.

Ray itself stands in for a machine too busy for its raylet to register in 30 s (which cannot be made to
happen on demand): its ``init`` raises Ray's own exception text the first time."""

import pytest

from neuron_serve.serve.ray import cluster

TIMED_OUT = ("The current node timed out during startup. This could happen because some of the raylet failed to "
             "startup or the GCS has become overloaded.")


def test_a_node_start_that_timed_out_is_tried_again(monkeypatch, caplog):
    calls, stopped = [], []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            raise Exception(TIMED_OUT)  # noqa: TRY002 - Ray's own type for it

    monkeypatch.setattr(cluster.ray, "init", init)
    monkeypatch.setattr(cluster.ray, "shutdown", lambda: stopped.append(True))
    cluster._start_ray({"env_vars": {}}, dashboard=False)
    assert len(calls) == 2 and stopped == [True]
    assert calls[1]["include_dashboard"] is False
    assert "Ray's node did not register within Ray's 30 s (the CPUs are busy); starting it again (attempt 2 of 3)" \
        in caplog.text


def test_other_start_failures_and_the_last_timeout_are_raised(monkeypatch):
    monkeypatch.setattr(cluster.ray, "shutdown", lambda: None)

    def refused(**kwargs):
        raise ValueError("bad runtime_env")

    monkeypatch.setattr(cluster.ray, "init", refused)
    with pytest.raises(ValueError, match="bad runtime_env"):
        cluster._start_ray({}, dashboard=True)
    attempts = []

    def always(**kwargs):
        attempts.append(1)
        raise Exception(TIMED_OUT)  # noqa: TRY002

    monkeypatch.setattr(cluster.ray, "init", always)
    with pytest.raises(Exception, match="timed out during startup"):
        cluster._start_ray({}, dashboard=True)
    assert len(attempts) == cluster.RAY_START_ATTEMPTS
