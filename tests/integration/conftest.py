"""A real `neuron-serve deploy` on loopback, shared by the serving tests of a module."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from neuron_serve.serve import ports

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 600


def make_llm(directory: Path) -> Path:
    """A tiny Llama and its tokenizer (deployments/example_models/make_tiny_llm.py) written to ``directory``."""
    subprocess.run([sys.executable, str(ROOT / "deployments/example_models/make_tiny_llm.py"), str(directory)],
                   check=True, capture_output=True)
    return directory


def free_port(avoid: tuple[int, ...] = ()) -> int:
    return ports.free_port("127.0.0.1", avoid=avoid)


class PortTaken(RuntimeError):
    """A deploy failed because one of its ports was bound by someone else meanwhile."""


class Server:
    """`neuron-serve deploy` of ``configs`` in its own process group, ready on return.

    ``at_ready(server)`` runs the moment deploy prints its ready line, before anything here
    polls the server: what it returns is kept as ``first_calls`` (see `first_calls`).
    ``at_first_200(server)`` runs the moment ``/v2/health/ready`` first answers 200, polled every
    50 ms from deploy's launch on a thread of its own: kept as ``first_200_calls``.
    """

    def __init__(self, configs: list[str], tmp: Path, env: dict[str, str] | None = None, args: tuple = (),
                 at_ready=None, at_first_200=None, compiled: bool = True, token: str | None = None):
        self._at_ready = at_ready
        self._at_first_200 = at_first_200
        self.first_calls = self.first_200_calls = None
        # A port that was free when drawn can be bound by another process of the machine
        # before the replicas bind it; that is the machine's doing, so draw again once.
        try:
            self._start(configs, tmp, env, args)
        except PortTaken:
            self.kill_leftovers()  # Ray workers of the failed deploy's session
            self._start(configs, tmp, env, args)
        if compiled:  # ready on its first compiled models; the tests see every one (``compiled=False``: as ready)
            try:
                self.wait_compiled(token=token)
            except BaseException:
                self.stop()
                raise

    def _start(self, configs: list[str], tmp: Path, env: dict[str, str] | None, args: tuple) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # gRPC is on by default; never its fixed 8001 here, nor the HTTP port (unbound yet).
        self.grpc_port = free_port(avoid=(self.port,))
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        self.log = tmp / "deploy.log"
        env_overrides = env
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # always an embedded Ray
        env["PYTHONWARNINGS"] = "ignore"
        # The checkout's neuron_serve in deploy and in every Ray worker it starts (they inherit the environment),
        # also when the installed package is another worktree's.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        # Its own metrics directory: servers of other test runs on this machine serve
        # models of the same names, and would be merged into this one's /metrics.
        (metrics_dir := tmp / "metrics").mkdir(exist_ok=True)
        env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        env.update(env_overrides or {})
        self.proc = subprocess.Popen(
            # Without Ray's dashboard: its processes hold about 1 GB a server, and two servers run at once.
            [sys.executable, "-m", "neuron_serve.cli", "deploy", *configs, "--port", str(self.port),
             "--grpc-port", str(self.grpc_port), "--no-ray-dashboard", *args],
            cwd=ROOT, env=env, stdout=(log := self.log.open("wb")), stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()  # the child holds its own copy
        prober = None
        if self._at_first_200 is not None:
            prober = threading.Thread(target=self._probe, daemon=True)
            prober.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                error = PortTaken if "Address already in use" in self.tail() else RuntimeError
                raise error(f"neuron-serve deploy exited {self.proc.returncode}:\n{self.tail()}")
            # Ready when deploy says it serves (every app, the gRPC port too) and the
            # port answers: readiness alone was seen to answer 200 before the server app
            # and its gRPC port were up, when another server had run just before.
            if re.search(r"^serving .* on http://", self.log.read_text(errors="replace"), re.MULTILINE):
                if self._at_ready is not None and self.first_calls is None:
                    self.first_calls = self._at_ready(self)
                try:
                    with urllib.request.urlopen(self.url + "/v2/health/ready", timeout=2) as r:
                        if r.status == 200:
                            if prober is not None:
                                prober.join(60)
                            return
                except OSError:
                    pass
            time.sleep(0.05 if self._at_ready is not None else 1)  # at_ready: as soon as the line is out
        self.stop()
        raise RuntimeError(f"not ready after {READY_TIMEOUT_S}s:\n{self.tail()}")

    def _probe(self) -> None:
        """Poll readiness as a Kubernetes probe or a client script would, and call on its first 200."""
        while self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        self.first_200_calls = self._at_first_200(self)
                        return
            except OSError:
                pass
            time.sleep(0.05)

    def ray_address(self) -> str:
        """The embedded Ray's address, as `neuron-serve deploy` logs it."""
        match = re.search(r"Ray at ([\w.:-]+)\)", self.log.read_text(errors="replace"))
        assert match, self.tail()
        return match.group(1)

    def _get(self, path: str, token: str | None, settle_s: float = 30.0) -> dict:
        """GET ``path`` as JSON. A 404 or 503 is asked again for ``settle_s``: Serve's ingress takes up a new
        application's route a moment after deploy saw it answer once (a CI run had a model's metadata 404 right
        after its readiness said 200); what it answered meanwhile is printed, and raised with the body if it lasts."""
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {token}"} if token else {})
        deadline = time.monotonic() + settle_s
        while True:
            try:
                with urllib.request.urlopen(request, timeout=10) as answer:
                    return json.load(answer)
            except urllib.error.HTTPError as exc:
                body = exc.read().decode(errors="replace")
                if exc.code not in (404, 503) or time.monotonic() > deadline:
                    raise AssertionError(f"GET {path}: {exc.code} {body}\n{self.tail()}") from exc
                print(f"GET {path} answered {exc.code} {body!r}; asking again", file=sys.stderr)
                time.sleep(0.5)

    def wait_compiled(self, timeout_s: float = READY_TIMEOUT_S, token: str | None = None) -> None:
        """Wait until no replica of any infer model has a compile pending (a replica is ready on its
        first compiled models and compiles the rest in the background): each model's metadata says
        ``parameters.compile``, one replica's per answer, so several answers in a row must say none."""
        deadline = time.monotonic() + timeout_s
        for model in self._get("/v2", token)["models"]:
            quiet = 0
            while quiet < 4:
                state = self._get(f"/v2/models/{model}", token)["parameters"].get("compile")
                if state is None:  # a task: generate model: compiled before ready
                    break
                quiet = quiet + 1 if state["pending"] == 0 else 0
                assert time.monotonic() < deadline, f"{model} still compiling: {state}\n{self.tail()}"
                if quiet == 0:
                    time.sleep(0.5)

    def output(self, *patterns: str, timeout_s: float = 30) -> str:
        """deploy's output (colours taken out) once every one of ``patterns`` (regular expressions, per
        line) is in it, or after ``timeout_s``: Ray forwards a replica's lines a few seconds late, holding
        back and folding alike lines of several replicas ("[repeated 2x across cluster]")."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace"))
            if all(re.search(p, text, re.MULTILINE) for p in patterns) or time.monotonic() > deadline:
                return text
            time.sleep(0.5)

    def tail(self) -> str:
        return self.log.read_bytes()[-4000:].decode(errors="replace")

    def session_pids(self) -> list[int]:
        """Every live process of this server: Ray gives its workers their own process
        groups, but they stay in the session `deploy` was started in."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                fields = stat.rsplit(")", 1)[1].split()
                if int(fields[3]) == self.proc.pid and fields[0] != "Z":  # session id, state
                    pids.append(int(entry.name))
        return pids

    def replica_pids(self, model: str) -> list[int]:
        """PIDs of the Ray Serve replicas of ``model``."""
        found = []
        for pid in self.session_pids():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if cmdline.startswith(f"ray::ServeReplica:{model}:".encode()):
                found.append(pid)
        return found

    def kill_pid(self, pid: int) -> None:
        """SIGKILL one process of this server (a replica, to test recovery)."""
        assert pid in self.session_pids(), f"{pid} is not a process of this server"
        os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()  # reaped, so no "subprocess is still running" warning
        self.kill_leftovers()

    def kill_leftovers(self) -> None:
        """SIGKILL whatever of this server outlived `deploy` (Ray workers in other groups)."""
        for pid in self.session_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def first_calls(models: list[str], infer: tuple[str, str, list[int]], token: str | None = None):
    """An ``at_ready`` (or ``at_first_200``) for `Server`: what a client that starts on deploy's
    ready line (or on readiness' first 200) gets, each call made once, with no retry: over gRPC
    (tritonclient.grpc) server liveness and readiness, each model's readiness, an unknown model's
    (NOT_FOUND) and one inference (``infer``: model, its FP32 input, shape), over HTTP readiness,
    the model's metadata and /metrics. Each outcome is the call's answer or the error it raised."""
    def calls(server: "Server") -> dict:
        import numpy as np  # noqa: PLC0415
        import tritonclient.grpc as tgrpc  # noqa: PLC0415

        headers = {"authorization": f"Bearer {token}"} if token else None
        client = tgrpc.InferenceServerClient(server.grpc_url)
        model, name, shape = infer

        def one_inference():
            x = tgrpc.InferInput(name, shape, "FP32")
            x.set_data_from_numpy(np.full(shape, 0.5, dtype="float32"))
            return list(client.infer(model, [x], headers=headers).as_numpy("output_0").shape)

        def http(path: str) -> int:
            request = urllib.request.Request(server.url + path, headers=headers or {})
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status

        def unknown_model():
            try:
                return client.is_model_ready("nope", headers=headers)
            except tgrpc.InferenceServerException as exc:
                return f"{exc.status()}: {exc.message()}"

        steps = {"grpc server live": lambda: client.is_server_live(headers=headers),
                 "grpc server ready": lambda: client.is_server_ready(headers=headers),
                 **{f"grpc {m} ready": lambda m=m: client.is_model_ready(m, headers=headers) for m in models},
                 "grpc nope ready": unknown_model,
                 f"grpc {model} infer": one_inference,
                 "http /v2/health/ready": lambda: http("/v2/health/ready"),
                 f"http /v2/models/{model}": lambda: http(f"/v2/models/{model}"),
                 "http /metrics": lambda: http("/metrics")}
        found = {}
        try:
            for step, call in steps.items():
                try:
                    found[step] = call()
                except Exception as exc:  # noqa: BLE001 - the outcome the test asserts on
                    found[step] = f"{type(exc).__name__}: {exc}"
        finally:
            client.close()
        return found
    return calls


@pytest.fixture(scope="session")
def examples_llm_server(tmp_path_factory):
    """`neuron-serve deploy deployments/llm.yaml deployments/embedder.yaml`, as the README serves them: SmolLM2-135M-
    Instruct and all-MiniLM-L6-v2 (tests/real_models.py makes them when `make test` has not). Ready on the first
    compiled models (the rest compile behind, as a reader's first requests meet them); kept to the session's end,
    for the real-model tests and the documentation's examples, which run in the same (serial) process."""
    import real_models  # noqa: PLC0415

    import yaml  # noqa: PLC0415

    real_models.smollm2()
    real_models.all_minilm_l6_v2()
    tmp = tmp_path_factory.mktemp("examples-llm")
    # The examples' model.yaml files with the fewest compiled models that answer the README's requests (CI's time
    # and memory: every compiled model holds its weights on its core): one prefill and one decode bucket, and
    # the embedder's two lengths at two batch sizes on one core.
    llm = yaml.safe_load((ROOT / "deployments" / "llm.yaml").read_text())
    llm["model"]["pretrained"] = str(real_models.smollm2())
    llm["generation"].update(max_num_seqs=8, max_model_len=256, prefill_buckets=[256], prefill_batch_buckets=[1],
                             decode_batch_buckets=[8], decode_context_buckets=[256])
    embedder = yaml.safe_load((ROOT / "deployments" / "embedder.yaml").read_text())
    embedder["model"]["pretrained"] = str(real_models.all_minilm_l6_v2())
    embedder.update(cores_per_replica=1, batching={"max_batch_size": 4}, pooling={"length_buckets": [64, 256]})
    for name, config in (("llm", llm), ("embedder", embedder)):
        (tmp / f"{name}.yaml").write_text(yaml.safe_dump(config))
    srv = Server([str(tmp / "llm.yaml"), str(tmp / "embedder.yaml")], tmp, compiled=False)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def examples_server(tmp_path_factory):
    """`neuron-serve deploy deployments/mlp.yaml deployments/encoder.yaml`, as the README serves them, for the serial
    run: the documentation's examples, and the calls made the moment it is ready (see `first_calls`). Not the
    shared ``server``: that one serves the parallel tests and stops after its own. Returned on the ready line, as a
    reader's client starts (the rest compile behind); kept to the session's end."""
    calls = first_calls(["mlp", "encoder"], ("mlp", "x", [1, 784]))
    srv = Server(["deployments/mlp.yaml", "deployments/encoder.yaml"], tmp_path_factory.mktemp("examples"),
                 at_ready=calls, at_first_200=calls, compiled=False)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def server_factory():
    """Start another real server: ``server_factory([model.yaml or artifact dir, ...], tmp_dir)``."""
    return Server


# The session's shared servers, each a whole Ray cluster. Idle, one still takes about a quarter
# of a core (Serve's controller, Ray's dashboard and monitors, the replicas' loops), which every
# other test on a 2-core machine pays for; so the tests using one run together and the server
# stops after the last of them, not at the end of the session. Only the fixtures a test names
# are seen here: a test that asks for one with request.getfixturevalue would get it stopped, so
# it starts its own (as the doc examples do).
SHARED_SERVERS = ("guarded", "server", "llm")
_started: dict[str, Server] = {}
_last_user: dict[int, list[str]] = {}  # id() of a test item -> the shared servers it is the last user of
# (by the item, not its nodeid: pytest-xdist adds its group to the nodeid after collection)


def _shared_servers_of(item) -> list[str]:
    """The shared server fixtures ``item`` uses (not a module's own fixtures of the same names)."""
    names = []
    for name in SHARED_SERVERS:
        definitions = item._fixtureinfo.name2fixturedefs.get(name, ())
        if definitions and definitions[-1].func.__module__ == __name__:
            names.append(name)
    return names


@pytest.hookimpl(tryfirst=True)  # before the root conftest's, which puts the doc examples last
def pytest_collection_modifyitems(config, items):
    """The test files of each shared server moved up to the first of them, order otherwise kept."""
    files: dict[Path, set[str]] = {}  # in collection order: the shared servers a file's tests use
    for item in items:
        files.setdefault(item.path, set()).update(_shared_servers_of(item))
    first: dict[str, int] = {}
    position = {}
    for index, (path, names) in enumerate(files.items()):
        for name in names:
            first.setdefault(name, index)
        position[path] = min((first[name] for name in names), default=index)
    items.sort(key=lambda item: position[item.path])  # stable: a file's tests keep their order
    if getattr(config.option, "loadgroup", False):  # pytest-xdist's --dist loadgroup (make test)
        _group_for_xdist(files, items)
        # Handed out in this order (--no-loadscope-reorder), a group at a time to whichever process is free: the
        # shared servers' groups first (the longest), then the other served tests, then the unit tests.
        items.sort(key=lambda item: 0 if files[item.path] else 1 if ROOT / "tests" / "integration" in item.path.parents
                   else 2)
    last = {name: id(item) for item in items for name in _shared_servers_of(item)}
    _last_user.clear()
    for name, item_id in last.items():
        _last_user.setdefault(item_id, []).append(name)


def _group_for_xdist(files: dict[Path, set[str]], items) -> None:
    """Mark each test with the pytest-xdist group it runs in (``-n 2 --dist loadgroup``, make test): a
    file's tests together, and every file of a shared server with it, so that each server starts once."""
    owner: dict[Path, Path] = {path: path for path in files}  # union-find over files sharing a server

    def root(path: Path) -> Path:
        while owner[path] != path:
            path = owner[path]
        return path

    users: dict[str, Path] = {}
    for path, names in files.items():
        for name in names:
            if name in users:
                owner[root(path)] = root(users[name])
            else:
                users[name] = path
    for item in items:
        group = root(item.path)
        name = str(group.relative_to(ROOT) if group.is_relative_to(ROOT) else group)
        item.add_marker(pytest.mark.xdist_group(name))


def pytest_runtest_teardown(item, nextitem):
    """Stop the shared servers whose last test this was (its fixture's own stop then does nothing)."""
    for name in _last_user.get(id(item), ()):
        if name in _started:
            _started.pop(name).stop()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """mlp (sort on CPU, 2 cores) and encoder (sequence buckets) served side by side."""
    calls = first_calls(["mlp", "encoder"], ("mlp", "x", [1, 784]))
    srv = _started["server"] = Server(["deployments/mlp.yaml", "deployments/encoder.yaml"],
                                      tmp_path_factory.mktemp("serve"), at_ready=calls, at_first_200=calls)
    yield srv
    srv.stop()


GUARDED_TOKEN = "guarded-test-token-0123456789"


@pytest.fixture(scope="session")
def guarded(tmp_path_factory):
    """tests/integration/models/guarded.yaml: the faulty test model behind a bearer token."""
    calls = first_calls(["guarded"], ("guarded", "x", [1, 8]), GUARDED_TOKEN)
    srv = Server(["tests/integration/models/guarded.yaml"], tmp_path_factory.mktemp("guarded"),
                 env={"GUARDED_TOKEN": GUARDED_TOKEN}, at_ready=calls, at_first_200=calls, token=GUARDED_TOKEN)
    srv.token = GUARDED_TOKEN
    _started["guarded"] = srv
    yield srv
    srv.stop()


LLM_MAX_MODEL_LEN = 256
LLM_CONFIG = f"""
name: llm
task: generate
replicas: 2
model:
  pretrained: llm
generation:
  max_num_seqs: 8
  max_model_len: {LLM_MAX_MODEL_LEN}
  decode_steps: 4
  on_device_sampling: false        # on-core sampling is tested in process
  # 6 models a replica, not the default 16: two prefill lengths, decode of one row and of every row
  # (each by 1 and by 4 steps); the bucket choice itself is tested in process.
  prefill_buckets: [32, 256]
  prefill_batch_buckets: [1]       # a prompt a call (batched prefill is tested in process)
  decode_batch_buckets: [1, 8]
  decode_context_buckets: [256]
"""


@pytest.fixture(scope="session")
def llm(tmp_path_factory):
    """A tiny Llama (deployments/example_models/make_tiny_llm.py) served as model "llm" with
    task: generate, two replicas; with its directory, and transformers' model and tokenizer
    read from it (the reference every generated text is compared with)."""
    import transformers  # noqa: PLC0415

    tmp = tmp_path_factory.mktemp("generate")
    make_llm(tmp / "llm")
    (tmp / "llm.yaml").write_text(LLM_CONFIG)
    srv = _started["llm"] = Server([str(tmp / "llm.yaml")], tmp)
    srv.model_dir = tmp / "llm"
    srv.tokenizer = transformers.AutoTokenizer.from_pretrained(srv.model_dir)
    srv.eager = transformers.AutoModelForCausalLM.from_pretrained(srv.model_dir, attn_implementation="eager").eval()
    yield srv
    srv.stop()
