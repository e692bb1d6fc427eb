"""Processes sharing one compile cache compute each entry once: a lease per entry, waited on by
the others, dropped when its holder dies."""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from neuron_serve.compile.cache import CompileCache

ROOT = Path(__file__).resolve().parents[3]

HOLDER = """
import sys, time
from pathlib import Path
from neuron_serve.compile.cache import CompileCache

def compute():
    Path(sys.argv[2]).write_text("computing")
    time.sleep(float(sys.argv[3]))
    return {"computed_by": "holder"}

print(CompileCache(Path(sys.argv[1])).get_or_compute("support", ["aten::sort", [4, 10]], compute))
"""


def _holder(cache: Path, signal_file: Path, seconds: float) -> subprocess.Popen:
    """Another process that misses the entry, takes its lease and computes for ``seconds``."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(cache), str(signal_file), str(seconds)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not signal_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
        time.sleep(0.02)
    return proc


def test_a_process_missing_an_entry_another_computes_waits_and_reads_it(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="neuron_serve")
    holder = _holder(tmp_path / "cache", tmp_path / "computing", 2.0)
    store = CompileCache(tmp_path / "cache")
    started = time.monotonic()
    value = store.get_or_compute("support", ["aten::sort", [4, 10]], lambda: {"computed_by": "waiter"})
    assert value == {"computed_by": "holder"} and time.monotonic() - started > 0.5
    assert (store.stats["support"].hits, store.stats["support"].misses, store.stats["support"].waited) == (1, 0, 1)
    out, err = holder.communicate(timeout=30)
    assert holder.returncode == 0, err
    assert out.strip() == "{'computed_by': 'holder'}"
    waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compile cache: waiting for")]
    assert waiting == [f"compile cache: waiting for pid {holder.pid} on {os.uname().nodename}, which computes "
                       f"support entry {waiting[0].rsplit(' ', 1)[1]}"]


def test_a_holder_killed_mid_compute_does_not_block_the_next(tmp_path):
    holder = _holder(tmp_path / "cache", tmp_path / "computing", 600.0)
    store = CompileCache(tmp_path / "cache")
    found = {}
    waiter = threading.Thread(target=lambda: found.update(value=store.get_or_compute(
        "support", ["aten::sort", [4, 10]], lambda: {"computed_by": "waiter"})))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive()  # waiting for the holder's lease
    os.kill(holder.pid, signal.SIGKILL)
    holder.communicate()
    waiter.join(10)
    assert not waiter.is_alive() and found["value"] == {"computed_by": "waiter"}
    assert CompileCache(tmp_path / "cache").get("support", ["aten::sort", [4, 10]]) == {"computed_by": "waiter"}


START = """
import json, sys
import torch, neuron_serve
from neuron_serve.analysis import placement
from neuron_serve.compile import cache

store = cache.configure(sys.argv[1])
print("started", flush=True)
sys.stdin.readline()  # both processes start compiling at once
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4), torch.nn.Softmax(-1))
neuron_serve.trace(model.eval(), torch.rand(4, 8), partitioner_config=neuron_serve.PartitionerConfig())
oracle = placement.oracle_for(neuron_serve.api.get_target("neuron"))
stats = store.stats["support"]
print(json.dumps({"compiles": oracle.stats.compiles, "hits": stats.hits, "waited": stats.waited}))
"""


def test_two_replicas_starting_together_decide_each_operator_once(tmp_path):
    """Two processes trace the same model against one empty cache at the same moment: each
    operator-support decision (a real torch-xla compile) is made by one of them only."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, "-c", START, str(tmp_path / "cache")], cwd=ROOT, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for proc in procs:
        assert proc.stdout.readline().strip() == "started", proc.stderr.read()
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    entries = len(list((tmp_path / "cache" / "support").rglob("*.json")))
    assert entries > 0
    assert sum(o["compiles"] for o in outs) == entries  # each decision compiled once, by one of the two
    assert all(o["compiles"] + o["hits"] == entries for o in outs)  # and known to both
