"""The model's own error out of Ray Serve's failure messages (neuron_serve.serve.failure)."""

from neuron_serve.serve.failure import exit_code, model_error

SERVE_MESSAGE = (
    "The deployment failed to start 2 times in a row. This may be due to a problem with its constructor "
    "or initial health check failing. See controller logs for details. Error:\n"
    "\x1b[36mray::ServeReplica:m:model.initialize_and_get_metadata()\x1b[39m (pid=1, ip=10.0.0.1)\n"
    "ray.exceptions.RayTaskError: wrapped\n"
    "Traceback (most recent call last):\n"
    '  File "/x/api.py", line 102, in trace\n'
    "    raise _unsupported_error(analysis)\n"
    "neuron_serve.errors.UnsupportedModelError: The model has 1 operator(s) that target 'neuron' cannot run:\n"
    "  tests_faulty::gate at faulty.py(46): no lowering\n"
    "Pass partitioner_config=neuron_serve.PartitionerConfig() to run them on CPU.\n"
)


def test_the_last_exception_with_its_whole_message():
    error = model_error(["Failed to update the deployments ['model'].", SERVE_MESSAGE])
    assert error == (
        "UnsupportedModelError: The model has 1 operator(s) that target 'neuron' cannot run:\n"
        "  tests_faulty::gate at faulty.py(46): no lowering\n"
        "Pass partitioner_config=neuron_serve.PartitionerConfig() to run them on CPU."
    )
    assert exit_code(error) == 3


def test_a_builtin_error_exits_1():
    error = model_error(["Error:\nTraceback (most recent call last):\nFileNotFoundError: weights missing"])
    assert error == "FileNotFoundError: weights missing"
    assert exit_code(error) == 1


def test_without_a_traceback_the_messages_are_kept():
    assert model_error(["Failed to update.", "", "Replica died."]) == "Failed to update. Replica died."
