"""Host memory as the compile queue's budget: each job's peak and kept memory measured, a job that would not fit
put off with a log line, run once there is room, skipped (HostMemoryExceeded) when there never is; the others run.

The jobs are real allocations (bytes touched page by page), so the resident set the queue reads is real."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_serve.assembly import host_memory
from neuron_serve.assembly.queue import BACKGROUND, COMPILED, FAILED, CompileQueue
from neuron_serve.errors import HostMemoryExceeded

MIB = 1 << 20


def allocate(peak_mib: int, keep_mib: int, kept: list):
    """A job that touches ``peak_mib`` MiB at once, then lets all go but ``keep_mib``."""
    def job():
        block = bytearray(peak_mib * MIB)
        block[::4096] = b"\x01" * len(block[::4096])  # every page resident
        kept.append(bytearray(b"\x01" * (keep_mib * MIB)))
        del block
        return peak_mib
    return job


@pytest.fixture
def queue(monkeypatch):
    monkeypatch.delenv(host_memory.BUDGET_ENV, raising=False)
    q = CompileQueue("memory-queue")
    yield q
    q.close(timeout=30)


# Run in a process of its own: the resident set is the process's, and a test worker that ran other tests (servers,
# compiles) frees their memory at any moment, which a 40 MiB measurement cannot tell from the job's own.
MEASURE_ALONE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from test_host_memory import allocate
from neuron_serve.assembly.queue import COMPILED, CompileQueue
queue = CompileQueue("memory-queue")
kept = []
job = queue.submit("big 1", allocate(300, 40, kept), family="big")
done = queue.wait([job], timeout=60) and job.state == COMPILED
print(json.dumps({"done": done, "peak": job.peak_bytes, "kept": job.kept_bytes,
                  "big": queue.budget.need("big"), "other": queue.budget.need("another family")}))
queue.close(timeout=30)
"""


def test_a_job_s_peak_and_what_it_keeps_are_measured(monkeypatch):
    monkeypatch.delenv(host_memory.BUDGET_ENV, raising=False)
    here = str(Path(__file__).resolve().parent)
    child = subprocess.run([sys.executable, "-c", MEASURE_ALONE, here], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    job = json.loads(child.stdout.strip().splitlines()[-1])
    assert job["done"]
    assert 280 * MIB <= job["peak"] <= 420 * MIB
    assert 30 * MIB <= job["kept"] <= 80 * MIB
    assert job["big"] == job["peak"]
    assert job["other"] == job["peak"]  # the most any family took, until measured


def test_a_job_that_would_not_fit_waits_then_is_skipped_and_the_rest_run(queue, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="neuron_serve")
    kept: list = []
    small = queue.submit("small 1", allocate(1, 0, kept), family="small")
    big = queue.submit("big 1", allocate(300, 0, kept), family="big")
    assert queue.wait([small, big], timeout=60)
    # Room for small jobs only, from now on.
    monkeypatch.setenv(host_memory.BUDGET_ENV, str(host_memory.resident_bytes() + 100 * MIB))
    monkeypatch.setenv(host_memory.WAIT_ENV, "1")
    refused = queue.submit("big 2", allocate(300, 0, kept), priority=BACKGROUND, family="big")
    after = queue.submit("small 2", allocate(1, 0, kept), priority=BACKGROUND, family="small")
    assert queue.wait([refused, after], timeout=60)
    assert after.state == COMPILED  # queued behind the big one, ran while it waited
    assert refused.state == FAILED
    with pytest.raises(HostMemoryExceeded, match=r"^compile of big 2 skipped: it needs about 0\.\d\d GiB of host "
                                                 r"memory and 0\.\d\d GiB is left \(NEURON_SERVE_HOST_MEMORY_BYTES="):
        refused.future.result()
    said = [r.getMessage() for r in caplog.records]
    deferred = [m for m in said if m.startswith("compile of big 2 deferred: it needs about ")]
    assert len(deferred) == 1 and "(measured on big)" in deferred[0] and "it waits up to 1 s" in deferred[0]
    assert any(m.startswith("compile of big 2 skipped: ") and m.endswith("; the replica serves on the models it has")
               for m in said)


def test_a_deferred_job_runs_once_there_is_room(queue, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="neuron_serve")
    kept: list = []
    big = queue.submit("big 1", allocate(200, 0, kept), family="big")
    assert queue.wait([big], timeout=60)
    monkeypatch.setenv(host_memory.BUDGET_ENV, str(host_memory.resident_bytes() + 50 * MIB))
    monkeypatch.setenv(host_memory.WAIT_ENV, "60")
    waiting = queue.submit("big 2", allocate(200, 0, kept), family="big")
    assert not queue.wait([waiting], timeout=1) and waiting.deferred is not None
    monkeypatch.delenv(host_memory.BUDGET_ENV)  # memory freed (here: the budget lifted)
    assert queue.wait([waiting], timeout=30) and waiting.state == COMPILED
    assert "compile of big 2: host memory is free for it now; queued again" in [r.getMessage() for r in caplog.records]
