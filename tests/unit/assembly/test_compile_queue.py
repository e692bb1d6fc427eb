"""The compile queue: one worker thread, most urgent first, failures recorded and survived."""

import threading
import time

import pytest
import torch

from neuron_serve.assembly.queue import BACKGROUND, NEEDED, READY, CompileQueue, Counts


@pytest.fixture
def queue():
    q = CompileQueue("test-queue")
    yield q
    q.close(timeout=10)


def _blocked(queue: CompileQueue):
    """A running job that holds the worker until the returned event is set (so others queue up)."""
    started, release = threading.Event(), threading.Event()

    def hold():
        started.set()
        assert release.wait(10)
        return "held"
    job = queue.submit("hold", hold, priority=READY, group="m")
    assert started.wait(10)
    return job, release


def test_jobs_run_most_urgent_first_then_in_submission_order(queue):
    ran = []
    blocker, release = _blocked(queue)
    jobs = [queue.submit(label, lambda label=label: ran.append(label), priority=priority, group="m")
            for label, priority in (("a", BACKGROUND), ("b", READY), ("c", NEEDED), ("d", BACKGROUND), ("e", READY))]
    release.set()
    assert queue.wait([blocker, *jobs], timeout=10)
    assert ran == ["b", "e", "c", "a", "d"]
    assert blocker.future.result() == "held"


def test_every_job_runs_on_the_one_worker_thread_never_two_at_once(queue):
    threads, running, most = set(), [0], [0]
    lock = threading.Lock()

    def job():
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        threads.add(threading.get_ident())
        threading.Event().wait(0.01)
        with lock:
            running[0] -= 1

    jobs = []
    submitters = [threading.Thread(target=lambda: jobs.extend(queue.submit(f"j{i}", job) for i in range(5)))
                  for _ in range(4)]
    for t in submitters:
        t.start()
    for t in submitters:
        t.join()
    assert queue.wait(jobs, timeout=30)
    assert len(jobs) == 20 and len(threads) == 1 and most[0] == 1
    assert threading.get_ident() not in threads


def test_torch_export_from_many_threads_goes_through_the_one_worker(queue):
    """torch.export is not thread-safe; submitted from four threads at once, every export succeeds."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.rand(2, 8)
    jobs = []
    lock = threading.Lock()

    def submit(i):
        job = queue.submit(f"export {i}", lambda: torch.export.export(model, (x,)).module()(x))
        with lock:
            jobs.append(job)

    submitters = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    for t in submitters:
        t.start()
    for t in submitters:
        t.join()
    assert queue.wait(jobs, timeout=120)
    for job in jobs:
        torch.testing.assert_close(job.future.result(), model(x))


def test_a_failed_job_is_recorded_with_its_reason_and_the_worker_goes_on(queue, caplog):
    def fails():
        raise ValueError("no lowering for aten::sort at batch 16")

    bad = queue.submit("mlp batch 16", fails, group="mlp")
    good = queue.submit("mlp batch 4", lambda: 4, group="mlp")
    assert queue.wait([bad, good], timeout=10)
    assert (bad.state, bad.error) == ("failed", "ValueError: no lowering for aten::sort at batch 16")
    with pytest.raises(ValueError, match="no lowering"):
        bad.future.result()
    assert good.future.result() == 4 and bad.seconds is not None and good.seconds is not None
    assert queue.counts("mlp") == Counts(compiled=1, failed=1)
    assert queue.group("mlp").failures() == [("mlp batch 16", "ValueError: no lowering for aten::sort at batch 16")]
    assert any("compile of mlp batch 16 failed after" in r.getMessage() and "no lowering" in r.getMessage()
               for r in caplog.records)


def test_an_internal_failure_says_it_is_not_the_model_s_and_what_the_replica_does(queue, caplog):
    from neuron_serve.errors import InternalCompileError  # noqa: PLC0415

    def fails():
        raise InternalCompileError("torch-xla failed inside its own state compiling subgraph accel_0, twice")

    late = queue.submit("qwen prefill_64", fails, priority=BACKGROUND, group="qwen")
    first = queue.submit("qwen prefill_512", fails, priority=READY, group="qwen")
    assert queue.wait([late, first], timeout=10)
    said = {r.getMessage().split(" failed after")[0]: r.getMessage() for r in caplog.records}
    assert said["compile of qwen prefill_64"].endswith(
        "twice (an internal failure of torch-xla, not the model: the replica serves on the models it has compiled)")
    assert said["compile of qwen prefill_512"].endswith(
        "twice (an internal failure of torch-xla, not the model: the replica cannot start without this model)")
    assert "cannot run" not in said["compile of qwen prefill_64"]


def test_counts_group_by_state_and_leave_loads_out(queue):
    blocker, release = _blocked(queue)
    queue.submit("m batch 1", lambda: 1, group="m")
    queue.submit("load m", lambda: None, group="m", kind="load")
    queue.submit("other", lambda: 1, group="other")
    assert queue.counts("m") == Counts(pending=1, running=1)  # the blocker runs; the load is not counted
    assert queue.counts("m").as_dict() == {"compiled": 0, "pending": 2, "failed": 0}
    release.set()
    assert queue.wait(queue.jobs(), timeout=10)
    assert queue.counts("m") == Counts(compiled=2) and queue.counts() == Counts(compiled=3)


def test_promote_runs_a_pending_job_sooner(queue):
    ran = []
    blocker, release = _blocked(queue)
    first = queue.submit("first", lambda: ran.append("first"))
    wanted = queue.submit("wanted", lambda: ran.append("wanted"))
    queue.promote(wanted, NEEDED)
    queue.promote(first, BACKGROUND + 1)  # never demoted
    release.set()
    assert queue.wait([blocker, first, wanted], timeout=10)
    assert ran == ["wanted", "first"]


def test_cancel_drops_a_groups_pending_jobs(queue):
    blocker, release = _blocked(queue)
    dropped = [queue.submit(f"m {i}", lambda: None, group="m") for i in range(3)]
    kept = queue.submit("other", lambda: "ran", group="other")
    assert queue.cancel("m") == 3
    release.set()
    assert queue.wait([blocker, kept, *dropped], timeout=10)
    assert [j.state for j in dropped] == ["cancelled"] * 3 and all(j.future.cancelled() for j in dropped)
    assert kept.future.result() == "ran"


def test_a_job_cannot_wait_for_a_job_behind_it(queue):
    def waits():
        later = queue.submit("later", lambda: None)
        queue.wait([later])

    job = queue.submit("waits", waits)
    assert queue.wait([job], timeout=10)
    assert job.state == "failed"
    assert job.error == ("RuntimeError: test-queue: a job cannot wait for another job; the one worker would wait "
                         "for itself. Submit it and return instead.")


def test_listeners_hear_each_start_and_end_and_cannot_stop_the_worker(queue):
    heard = []
    queue.subscribe(lambda job: heard.append((job.label, job.state)))
    queue.subscribe(lambda job: 1 / 0)
    group_heard = []
    queue.group("m").subscribe(lambda job: group_heard.append(job.label))
    jobs = [queue.submit("a", lambda: 1, group="m"), queue.submit("b", lambda: 2, group="other")]
    assert queue.wait(jobs, timeout=10)
    # wait() returns once the job has ended; its listeners hear the end just after, on the worker thread.
    deadline = time.monotonic() + 10
    while (len(heard) < 6 or len(group_heard) < 3) and time.monotonic() < deadline:
        time.sleep(0.01)
    # Each job's own events in order (b may be queued while a runs); the listener that raised stopped nothing.
    assert [state for label, state in heard if label == "a"] == ["pending", "running", "compiled"]
    assert [state for label, state in heard if label == "b"] == ["pending", "running", "compiled"]
    assert group_heard == ["a", "a", "a"]


def test_submit_refuses_what_it_cannot_run(queue):
    with pytest.raises(ValueError, match=r"submit: kind must be one of \('compile', 'load'\), got 'link'"):
        queue.submit("x", lambda: None, kind="link")
    with pytest.raises(ValueError, match="submit: priority must be an int"):
        queue.submit("x", lambda: None, priority="soon")
    queue.close()
    with pytest.raises(RuntimeError, match="test-queue is closed"):
        queue.submit("x", lambda: None)
