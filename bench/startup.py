"""Serving start-up, from ``neuron-serve deploy``'s launch: the first correct answer when replicas are
ready on their first compiled models (model.yaml's ``background_compile``, the default) against
waiting for the whole compile; and a load step under autoscaling from one replica to two: seconds
until Serve starts the new replica, and until it answers (it finds the first replica's compile
cache warm).

Each deploy runs alone (bench/servers.py starts and stops it as a process group). ``measure(config)``
takes any model.yaml: a ``task: infer`` model's first answer is a one-row request equal to eager
PyTorch, a ``task: generate`` model's a greedy completion equal to transformers' greedy generation
(the LLM example: ``make llm-example`` writes its model first).

Usage: ``python -m bench.startup [--models mlp encoder llm] [--autoscale mlp] [--out DIR] [--quick]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
import yaml

from neuron_serve.config.factory import build_model
from neuron_serve.config.schema import load_deployment
from neuron_serve.serve.ports import free_port

from . import servers

ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENTS = ROOT / "deployments"
TOLERANCE = 1e-3


def _variant(model: str, work: Path, **changes) -> Path:
    """deployments/<model>.yaml with ``changes``, beside the example models its factory names."""
    doc = yaml.safe_load((DEPLOYMENTS / f"{model}.yaml").read_text())
    for key, value in changes.items():
        if value is None:
            doc.pop(key, None)
        else:
            doc[key] = value
    folder = work / f"{model}-{len(list(work.iterdir()))}"
    folder.mkdir(parents=True)
    (folder / "example_models").symlink_to(DEPLOYMENTS / "example_models")
    if (DEPLOYMENTS / "llm").is_dir():  # the LLM example's model directory (make llm-example)
        (folder / "llm").symlink_to(DEPLOYMENTS / "llm")
    (folder / f"{model}.yaml").write_text(yaml.safe_dump(doc))
    return folder / f"{model}.yaml"


class Deploy:
    """``neuron-serve deploy config`` on free ports, with its compile cache in ``cache``."""

    def __init__(self, config: Path, cache: Path, log_dir: Path, extra: tuple[str, ...] = ()) -> None:
        self.port, self.grpc_port = free_port("127.0.0.1"), None
        self.grpc_port = free_port("127.0.0.1", avoid=(self.port,))
        cli = str(Path(sys.executable).with_name("neuron-serve"))
        self.name = load_deployment(config)[0].name
        spec = servers.ServerSpec(f"startup-{config.parent.name}-{config.stem}", self.name,
                                  [cli, "deploy", str(config), "--port", str(self.port), "--grpc-port",
                                   str(self.grpc_port), *extra], self.port, replica_marker="ray::ServeReplica:",
                                  env={"NEURON_SERVE_CACHE_DIR": str(cache)}, ready_line=servers.READY_LINE)
        self.server = servers.Server(spec, log_dir)

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.server.started

    def post(self, body: bytes, timeout: float = 30) -> dict | None:
        generate = json.loads(body).get("prompt") is not None
        url = f"http://127.0.0.1:{self.port}/v1/completions" if generate else self.server.url(self.name)
        request = urllib.request.Request(url, data=body,
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return json.load(answer) if answer.status == 200 else None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return None

    def get(self, path: str) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as answer:
                return json.load(answer)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
            return None

    def log(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.server.log_path.read_text(errors="replace"))

    def replica_pids(self) -> list[int]:
        found = []
        for pid in servers._pids(self.server.proc.pid):  # noqa: SLF001 - the deploy's own process tree
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(f"ray::ServeReplica:{self.name}:".encode()):
                    found.append(pid)
            except OSError:
                pass
        return found

    def stop(self) -> None:
        self.server.stop()


PROMPT, NEW_TOKENS = "neuron-serve compiles", 8


def _request(config: Path) -> tuple[bytes, Any]:
    """A one-row request (the first example row, float inputs) and eager PyTorch's answer to it; for a generate
    model, a greedy completion and transformers' greedy text."""
    parsed, base = load_deployment(config)
    if parsed.task == "generate":
        import transformers  # noqa: PLC0415

        folder = Path(base) / parsed.model.pretrained
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        lm = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        ids = tokenizer(PROMPT, return_tensors="pt").input_ids
        with torch.no_grad():
            out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        body = {"model": parsed.name, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True}
        return json.dumps(body).encode(), tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    rows = [t[:1] for t in parsed.example_inputs()]
    with torch.no_grad():
        expected = [t for t in pytree.tree_leaves(build_model(parsed, base)(*rows)) if isinstance(t, torch.Tensor)]
    inputs = [{"name": spec.name, "shape": list(t.shape), "datatype": "FP32" if t.is_floating_point() else "INT64",
               "data": t.flatten().tolist()} for spec, t in zip(parsed.inputs, rows)]
    return json.dumps({"inputs": inputs}).encode(), expected


def _correct(answer: dict | None, expected: Any) -> bool:
    if answer is None:
        return False
    if isinstance(expected, str):  # a completion
        return answer["choices"][0]["text"] == expected
    first = answer["outputs"][0]
    got = torch.tensor(first["data"]).reshape(first["shape"])
    return torch.allclose(got, expected[0].to(got.dtype), atol=TOLERANCE, rtol=TOLERANCE)


def _compiled(deploy: Deploy, name: str) -> bool:
    """No replica of ``name`` has a compile pending (four metadata answers in a row say so)."""
    for _ in range(4):
        meta = deploy.get(f"/v2/models/{name}")
        if meta is None or meta["parameters"]["compile"]["pending"]:
            return False
    return True


def first_answer(config: Path, cache: Path, log_dir: Path, timeout_s: float = 900) -> dict:
    """From deploy's launch: the first correct answer, deploy's ready line, every model compiled."""
    body, expected = _request(config)
    deploy = Deploy(config, cache, log_dir)
    found: dict[str, float] = {}
    try:
        while "compiled_s" not in found:
            if deploy.server.proc.poll() is not None or deploy.seconds > timeout_s:
                raise RuntimeError(f"deploy of {config} failed or hung; see {deploy.server.log_path}")
            if "first_answer_s" not in found and _correct(deploy.post(body, timeout=10), expected):
                found["first_answer_s"] = deploy.seconds
            if "ready_line_s" not in found and servers.READY_LINE in deploy.log():
                found["ready_line_s"] = deploy.seconds
            if "first_answer_s" in found and "ready_line_s" in found and _compiled(deploy, deploy.name):
                found["compiled_s"] = deploy.seconds
            time.sleep(0.05 if "first_answer_s" not in found else 0.5)
        built = re.findall(r"model \S+ built in ([\d.]+)s", deploy.log())
        found["replica_ready_s"] = float(built[0]) if built else float("nan")  # from the replica's build beginning
    finally:
        deploy.stop()
    return found


def autoscale_step(config: Path, cache: Path, log_dir: Path, concurrency: int = 8, timeout_s: float = 600) -> dict:
    """One replica under a load step with autoscaling 1 to 2: seconds from the step until Serve starts
    a second replica, and until that replica has answered a request."""
    body, _ = _request(config)
    deploy = Deploy(config, cache, log_dir)
    stop = threading.Event()
    try:
        while not (servers.READY_LINE in deploy.log() and _compiled(deploy, deploy.name)):
            if deploy.server.proc.poll() is not None or deploy.seconds > timeout_s:
                raise RuntimeError(f"deploy of {config} failed or hung; see {deploy.server.log_path}")
            time.sleep(0.5)
        first = set(deploy.replica_pids())
        step = time.monotonic()
        found: dict[str, float] = {}

        def load() -> None:
            while not stop.is_set():
                deploy.post(body)

        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            for _ in range(concurrency):
                pool.submit(load)
            while "answered_s" not in found and time.monotonic() - step < timeout_s:
                new = set(deploy.replica_pids()) - first
                if new and "started_s" not in found:
                    found["started_s"] = time.monotonic() - step
                replicas = {labels["replica"] for labels, value in _requests(deploy) if value > 0}
                if len(replicas) > 1:
                    found["answered_s"] = time.monotonic() - step
                time.sleep(0.1)
            stop.set()
        built = re.findall(r"model \S+ built in ([\d.]+)s", deploy.log())
        found["new_replica_ready_s"] = float(built[-1]) if len(built) > 1 else float("nan")
        found["first_replica_ready_s"] = float(built[0]) if built else float("nan")
    finally:
        stop.set()
        deploy.stop()
    return found


def _requests(deploy: Deploy) -> list[tuple[dict, float]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{deploy.port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
    except (urllib.error.URLError, OSError):
        return []
    found = []
    for labels, value in re.findall(r"^neuron_serve_requests_total\{([^}]*)\} (\S+)$", text, re.MULTILINE):
        parsed = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if parsed.get("model") == deploy.name and parsed.get("code") == "200":
            found.append((parsed, float(value)))
    return found


def measure(config: Path, work: Path, logs: Path) -> dict:
    """One model.yaml from deploy's launch: with background compile (as written) and without."""
    whole = yaml.safe_load(config.read_text())
    whole["background_compile"] = False
    whole_config = config.with_name(f"{config.stem}-whole.yaml")
    whole_config.write_text(yaml.safe_dump(whole))
    name = load_deployment(config)[0].name
    row = {"model": name}
    for mode, path in (("background", config), ("whole", whole_config)):
        for key, value in first_answer(path, work / f"cache-{name}-{mode}", logs).items():
            row[f"{mode}_{key}"] = value
    row["first_answer_ratio"] = row["background_first_answer_s"] / row["whole_first_answer_s"]
    return row


def table(rows: list[dict], scaled: list[dict]) -> str:
    lines = ["Seconds from `neuron-serve deploy`'s launch (Ray's start-up included), each deploy alone with an empty "
             "compile cache. First answer: a one-row request equal to eager PyTorch, polled every 50 ms.", "",
             "| model | first answer, background | first answer, whole | background / whole | ready line, background "
             "| ready line, whole | all compiled, background | replica ready after its build began, background "
             "/ whole |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['background_first_answer_s']:.1f} | {r['whole_first_answer_s']:.1f} | "
                     f"{r['first_answer_ratio']:.2f} | {r['background_ready_line_s']:.1f} | "
                     f"{r['whole_ready_line_s']:.1f} | {r['background_compiled_s']:.1f} | "
                     f"{r['background_replica_ready_s']:.1f} / {r['whole_replica_ready_s']:.1f} |")
    if scaled:
        lines += ["", "Autoscaling from 1 to 2 replicas (`target_ongoing_requests: 1`, 8 concurrent clients from t = 0): "
                  "seconds until Serve starts the second replica (its upscale delay), until that replica answers, and "
                  "each replica's ready time after its build began (the second finds the first's compile cache warm).",
                  "", "| model | new replica started | new replica answered | first replica ready | new replica ready |",
                  "|---|---|---|---|---|"]
        for r in scaled:
            lines.append(f"| {r['model']} | {r.get('started_s', float('nan')):.1f} | "
                         f"{r.get('answered_s', float('nan')):.1f} | {r['first_replica_ready_s']:.1f} | "
                         f"{r['new_replica_ready_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "encoder", "llm"], help="deployments/<name>.yaml")
    parser.add_argument("--autoscale", nargs="*", default=["mlp"], help="models whose autoscaling step is measured")
    parser.add_argument("--quick", action="store_true", help="the MLP only")
    parser.add_argument("--out", type=Path, help="write startup.md and startup.json here")
    args = parser.parse_args(argv)
    models = ["mlp"] if args.quick else args.models
    with tempfile.TemporaryDirectory(prefix="neuron-serve-startup-") as tmp:
        work = Path(tmp)
        logs = args.out / "logs" if args.out else work / "logs"  # each deploy's output, kept with the results
        rows = [measure(_variant(m, work), work, logs) for m in models]
        scaled = []
        for model in args.autoscale:
            config = _variant(model, work, replicas=None,
                              autoscaling={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1})
            scaled.append({"model": model, **autoscale_step(config, work / f"cache-{model}-autoscale", logs)})
    text = table(rows, scaled)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "startup.md").write_text("## Start-up from deploy's launch (bench/startup.py)\n\n" + text + "\n")
        (args.out / "startup.json").write_text(json.dumps({"deploys": rows, "autoscaling": scaled}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
