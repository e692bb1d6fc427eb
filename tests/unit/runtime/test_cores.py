"""CorePool: one device and one driving thread per core, handed out round-robin."""

import threading

import pytest

from neuron_serve.errors import ConfigError
from neuron_serve.runtime.cores import CorePool
from neuron_serve.targets.pjrt import xla


def test_cores_are_handed_out_round_robin_each_driving_its_own_thread():
    pool = CorePool(1)  # a unit-test process sees one emulated core
    try:
        assert len(pool) == 1
        assert [pool.next().index for _ in range(3)] == [0, 0, 0]
        core = pool.cores[0]
        assert str(core.device) == str(xla().device(0))
        thread = core.submit(lambda: threading.current_thread().name).result()
        assert thread.startswith("core0") and thread != threading.current_thread().name
    finally:
        pool.shutdown()


@pytest.mark.parametrize("count", [0, 2])
def test_more_cores_than_the_process_sees_are_refused_with_the_environment(count):
    with pytest.raises(ConfigError, match=rf"cores_per_replica is {count} but this process sees 1 core\(s\) "
                                          r"\(PJRT_DEVICE=CPU, CPU_NUM_DEVICES=1\)"):
        CorePool(count)


TAKE = """
from neuron_serve.runtime.cores import CorePool
pool = CorePool(2)
a = pool.take(); pool.give_back(a)
b = pool.take(); pool.give_back(b)                   # idle: the core that ran last, warm
c = pool.take(); d = pool.take(); e = pool.take()    # busy: the least busy, in turn
for core in (c, d, e):
    pool.give_back(core)
print([x.index for x in (a, b, c, d, e)])
pool.shutdown()
"""


def test_a_busy_pool_spreads_chunks_in_turn_and_an_idle_one_keeps_to_the_core_that_ran_last():
    import os
    import subprocess
    import sys

    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-c", TAKE], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[0, 0, 0, 1, 0]"
