"""CorePool: one device and one driving thread per core (which core a chunk takes: test_core_choice.py)."""

import threading

import pytest

from neuron_serve.errors import ConfigError
from neuron_serve.runtime.cores import CorePool
from neuron_serve.targets.pjrt import xla


def test_one_core_is_handed_out_every_time_and_drives_its_own_thread():
    pool = CorePool(1)  # a unit-test process sees one emulated core
    try:
        assert len(pool) == 1
        handed = [pool.next() for _ in range(3)]  # none given back: the only core, busy or not
        assert [core.index for core in handed] == [0, 0, 0]
        for core in handed:
            pool.release(core)
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
