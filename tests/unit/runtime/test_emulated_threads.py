"""An emulated core computes on as many host threads as it is given (the engine's process gives one).

Each case runs in a new Python: XLA:CPU's pools are made when its client starts, once a process.
"""

import json
import os
import subprocess
import sys

import pytest

# Counts the threads that burn CPU while XLA:CPU runs a large product: with a pool of N
# threads, N do the work (the calling thread waits on the result).
SCRIPT = """
import json, os, sys, time
from neuron_serve.targets import pjrt

def cpu_by_thread():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[tid] = int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return out

threads = int(sys.argv[1])
smaller = pjrt.start_emulated_cores_on_threads(threads) if threads else False
import torch
torch_xla = pjrt.xla()
a = torch.randn(1024, 1024, device=torch_xla.device(0))
torch_xla.sync(); (a @ a).cpu()  # compiled and warm
before = cpu_by_thread()
start = time.monotonic()
while time.monotonic() - start < 2.0:
    b = a
    for _ in range(8):
        b = b @ a / 32
    b.cpu()
after = cpu_by_thread()
busy = sum(1 for tid, t in after.items() if t - before.get(tid, 0) > 0.25 * os.sysconf("SC_CLK_TCK"))
affinities = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in after if os.path.exists(f"/proc/self/task/{tid}")}
print(json.dumps({"smaller": smaller, "busy": busy, "cpus": sorted(os.sched_getaffinity(0)),
                  "affinities": sorted(set(map(tuple, affinities.values())))}))
"""


def run(threads: int) -> dict:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(threads)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs at least 2 CPUs")


@needs_two_cpus
def test_one_thread_per_core_computes_on_one_thread_and_leaves_every_cpu_to_the_process():
    default, one = run(0), run(1)
    assert default["busy"] >= 2, default  # XLA:CPU's own pool splits the product over the CPUs
    assert one["smaller"] is True
    assert one["busy"] == 1, one
    # Only the pool's size changed: every thread may still run on every CPU.
    assert one["affinities"] == [one["cpus"]], one


@needs_two_cpus
def test_as_many_threads_as_cpus_changes_nothing():
    result = run(len(os.sched_getaffinity(0)))
    assert result["smaller"] is False
    assert result["busy"] >= 2, result


def test_a_running_client_is_left_as_it_is():
    from neuron_serve.targets import pjrt  # noqa: PLC0415

    pjrt.xla().device(0)  # this process's client is started
    assert pjrt.start_emulated_cores_on_threads(1) is False


def test_the_engine_process_threads_come_from_the_environment_and_a_bad_value_is_refused(monkeypatch):
    from neuron_serve.errors import ConfigError  # noqa: PLC0415
    from neuron_serve.targets import pjrt  # noqa: PLC0415

    monkeypatch.delenv(pjrt.THREADS_ENV, raising=False)
    assert pjrt.emulated_core_threads() is None  # XLA:CPU's own pool: a thread per CPU
    monkeypatch.setenv(pjrt.THREADS_ENV, "1")
    assert pjrt.emulated_core_threads() == 1
    monkeypatch.setenv(pjrt.THREADS_ENV, "two")
    with pytest.raises(ConfigError) as refused:
        pjrt.emulated_core_threads()
    assert str(refused.value) == ("$NEURON_SERVE_EMULATED_CORE_THREADS: give a number of threads (at least 1), or "
                                  "unset it for one per CPU; got 'two'.")
