"""save() and load(): a traced model as a self-contained directory.

Layout::

    manifest.json        format, versions, target, partition plan, buckets, the top
                         graph of each bucket, each accelerator partition's
                         compiler_args (with "no effect in emulation" or what
                         emulation does), and the SHA-256 of every other file
    manifest.sha256      the SHA-256 of manifest.json
    model.yaml           the deployment it was built from (when built from one)
    bucket_N/<part>.pt2  each partition (accelerator and CPU) as a torch.export
                         ExportedProgram: ATen graph plus its weights
    bucket_N/<part>.hlo.txt
                         each accelerator partition lowered by torch-xla (the HLO
                         that neuronx-cc or XLA:CPU compiles), for inspection
    bucket_N_batch_B/    bucket N at each smaller compiled batch size B (bucket_N holds
                         the largest), laid out as bucket_N
    bucket_kernel.pt     a torch.jit.script bucket kernel, when the model has one
    weights.pt           weight-separated models (inline_weights_to_neff=False) only:
                         every weight by state-dict name (torch.save of a dict of
                         tensors, read back with weights_only=True); their accelerator
                         partitions' programs take the weights as inputs and hold none
    states.pt            stateful models (input_output_aliases) only: each state's
                         values when saved (a dict of tensors, as weights.pt)

Loading reads only JSON, ExportedPrograms, TorchScript and a state dict of plain
tensors: no pickle of arbitrary objects and no original model class. Accelerator partitions are compiled again on
load (through the compile cache where the runtime can reuse executables).
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..buckets.shape import BucketSpec
from ..config.compiler_args import parse_compiler_args
from ..compile.subgraph import CompiledSubgraph
from ..errors import ArtifactError, ConfigError
from ..model import Bucket, CompiledModel, Partition
from ..model.state import Alias, DeviceState
from ..targets.pjrt import emulated, versions, xla

logger = logging.getLogger("neuron_serve")

FORMAT = "neuron-serve-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MANIFEST_HASH = "manifest.sha256"
KERNEL_FILE = "bucket_kernel.pt"
WEIGHTS_FILE = "weights.pt"
STATES_FILE = "states.pt"  # input_output_aliases: each state's values when saved


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _rebuild_hint(manifest: dict | None, path: Path) -> str:
    source = (manifest or {}).get("source") or "model.yaml"
    return f"Rebuild it: neuron-serve build {source} -o {path}"


# --- the top graph: placeholders, partition calls, getitem and output only ---------


def _encode(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if isinstance(value, (tuple, list)):
        return {"tuple" if isinstance(value, tuple) else "list": [_encode(v) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ArtifactError(f"save: the top graph passes a {type(value).__name__} between partitions; only tensors "
                        "and tuples of them can be saved.")


def _decode(value: Any, env: dict[str, torch.fx.Node]) -> Any:
    if isinstance(value, dict):
        if "node" in value:
            return env[value["node"]]
        if "tuple" in value:
            return tuple(_decode(v, env) for v in value["tuple"])
        return [_decode(v, env) for v in value["list"]]
    return value


def _graph_to_json(gm: torch.fx.GraphModule) -> list[dict]:
    nodes = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            target = "getitem"
        elif node.op in ("placeholder", "call_module", "output"):
            target = str(node.target)
        else:
            raise ArtifactError(f"save: the top graph has a {node.op} node ({node.name}); expected only partition calls.")
        nodes.append({"op": node.op, "name": node.name, "target": target, "args": _encode(node.args)})
    return nodes


def _graph_from_json(nodes: list[dict], modules: dict[str, torch.nn.Module]) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for spec in nodes:
        args = _decode(spec["args"], env)
        if spec["op"] == "placeholder":
            node = graph.placeholder(spec["target"])
        elif spec["op"] == "call_module":
            node = graph.call_module(spec["target"], tuple(args))
        elif spec["op"] == "call_function":
            node = graph.call_function(operator.getitem, tuple(args))
        else:
            node = graph.output(args[0])
        node.name = spec["name"]
        env[spec["name"]] = node
    return torch.fx.GraphModule(torch.nn.ModuleDict(modules), graph)


# --- save ---------------------------------------------------------------------------


def _example_args(specs: list) -> tuple:
    # Values do not matter for export or compile, only shapes and dtypes.
    return tuple(torch.zeros(shape, dtype=dtype) for shape, dtype in specs)


def _save_bucket(traced: Bucket, folder: Path, root: Path, separated: bool) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    parts = {}
    for partition in traced.partitions:
        module = traced.graph_module.get_submodule(partition.name)
        specs = traced.stage_inputs.get(partition.name)
        if specs is None or any(s is None for s in specs):
            raise ArtifactError(f"save: partition {partition.name} was not traced with tensor inputs; trace the model "
                                "with neuron_serve.trace() before saving it.")
        compiled = isinstance(module, CompiledSubgraph)
        graph = module.source if compiled else module
        args = _example_args(specs)
        if compiled and separated:
            # The lifted graph takes its weights after the activations; they go to weights.pt.
            args += _example_args([(w.shape, w.dtype) for w in module.weights.values()])
        with torch.no_grad():
            program = torch.export.export(graph, args, strict=False)
        program.example_inputs = None  # else saved as a pickle, which load() refuses to read
        file = folder / f"{partition.name}.pt2"
        torch.export.save(program, file)
        entry = {"file": str(file.relative_to(root)), "compiled": compiled,
                 "tuple_out": module._tuple_out if compiled else None,
                 "inputs": [[list(shape), str(dtype).removeprefix("torch.")] for shape, dtype in specs]}
        if compiled:
            # The graph saved already holds --auto-cast's casts; the rest is what neuronx-cc gets.
            entry["compiler_args"] = module.compiler_args.describe()
            hlo = folder / f"{partition.name}.hlo.txt"
            hlo.write_text(module.hlo_text())
            entry["hlo"] = str(hlo.relative_to(root))
            if separated:
                entry["weights"] = list(module.weights)  # state-dict names, in input order
            # input_output_aliases: state inputs the executable updates in place, outputs left on the core.
            entry["donate"] = list(module.donate)
            entry["keep_on_device"] = sorted(module.keep_on_device)
        parts[partition.name] = entry
    return {
        "graph": _graph_to_json(traced.graph_module),
        "partitions": [_partition_entry(p) for p in traced.partitions],
        "modules": parts,
        "in_spec": pytree.treespec_dumps(traced.in_spec),
        "out_spec": pytree.treespec_dumps(traced.out_spec),
        "out_spec_portable": pytree.treespec_dumps(_portable(traced.out_spec)),
        "input_shapes": [None if s is None else [list(s), str(d).removeprefix("torch.")] for s, d in traced.input_shapes],
        "output_shapes": [None if s is None else list(s) for s in traced.output_shapes],
        "output_dtypes": [None if d is None else str(d).removeprefix("torch.") for d in traced.output_dtypes],
        "dynamic_batch": traced.dynamic_batch_enabled,
        "batch_size": traced.batch_size,
        "report": traced.report,
        "target": traced.target,
        "aliases": [[a.slot, a.output] for a in traced.aliases],
    }


def _partition_entry(partition: Partition) -> dict:
    # A replicated model's manifest stays as before pipeline stages existed; stages add their core and sizes.
    entry = dict(vars(partition))
    if not partition.is_stage:
        for name in ("core", "memory_bytes", "bytes_in"):
            entry.pop(name)
    return entry


def save(module: CompiledModel, path: str | Path, *, config: dict | None = None, source: str | None = None,
         extra: dict | None = None, add_files: Callable[[Path], None] | None = None) -> Path:
    """Write ``module`` (from trace, trace_buckets or bucket_model_trace) to directory ``path``.

    ``config`` (a model.yaml as a dict) and ``source`` (its path) are recorded so the
    artifact can be deployed directly and rebuilt when it is out of date. ``extra`` is kept
    in the manifest and ``add_files(root)`` writes further files into it, both covered by
    its hashes (a generation model's buckets and tokenizer). State tensors
    (input_output_aliases) are saved with their current values.
    """
    if not isinstance(module, CompiledModel):
        raise ArtifactError("save() takes the module returned by neuron_serve.trace(), trace_buckets() or "
                            f"bucket_model_trace(), not a {type(module).__name__}.")
    from .weights import is_weight_separated, weight_specs  # noqa: PLC0415

    separated = is_weight_separated(module)
    root = Path(path)
    if root.exists():
        if not (root / MANIFEST).exists() and any(root.iterdir()):
            raise ArtifactError(f"save: {root} exists and is not a neuron-serve artifact; choose an empty directory.")
        shutil.rmtree(root)
    root.mkdir(parents=True)
    manifest: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION, "versions": versions(),
                                "emulated": emulated(), "source": source}
    buckets = list(module.buckets)
    manifest["kind"] = "traced" if module.kernel is None else "bucketed"
    if module.kernel is not None:
        manifest["bucket_spec"] = _spec_to_json(module, root)
    manifest["target"] = module.target
    manifest["buckets"] = [_save_bucket(b, root / f"bucket_{i}", root, separated) for i, b in enumerate(buckets)]
    # Each shape bucket at its smaller compiled batch sizes (the bucket itself holds the largest).
    manifest["smaller"] = [[_save_bucket(b, root / f"bucket_{i}_batch_{b.batch_size}", root, separated)
                            for b in smaller] for i, smaller in enumerate(module.smaller)]
    if module.stateful:
        _save_states(module, root, manifest)
    if extra is not None:
        manifest["extra"] = extra
    if add_files is not None:
        add_files(root)
    if separated:
        # Once for every bucket and batch size (they share the weights), cloned so that
        # tied weights are stored as separate tensors of the state dict.
        torch.save({name: w.detach().cpu().clone() for name, w in weight_specs(module).items()}, root / WEIGHTS_FILE)
        manifest["weights"] = WEIGHTS_FILE
    if config is not None:
        import yaml  # noqa: PLC0415

        (root / "model.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    manifest["files"] = {str(f.relative_to(root)): _sha256(f) for f in sorted(root.rglob("*")) if f.is_file()}
    text = json.dumps(manifest, indent=1, sort_keys=True)
    (root / MANIFEST).write_text(text)
    (root / MANIFEST_HASH).write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")
    logger.info("saved %s model to %s (%d bucket(s), batch sizes %s)", manifest["target"], root, len(buckets),
                module.batch_sizes)
    return root


def _save_states(module: CompiledModel, root: Path, manifest: dict) -> None:
    """Each distinct state (a shared_state_buffer once) to states.pt; each bucket names its own."""
    if any(len(s) for s in module.smaller):
        raise ArtifactError("save: a stateful model compiled at several batch sizes cannot be saved.")
    states = module._device_states()
    values, groups = {}, []
    for k, state in enumerate(states):
        keys = [f"state_{k}.{i}" for i in range(len(state))]
        values.update(zip(keys, state.cpu()))
        groups.append({"names": state.names, "keys": keys})
    torch.save(values, root / STATES_FILE)
    manifest["states"] = {"file": STATES_FILE, "groups": groups,
                          "bucket_state": [next((k for k, s in enumerate(states) if s is b.state), None)
                                           for b in module.buckets]}


def _load_states(manifest: dict, root: Path, buckets: list[Bucket]) -> None:
    entry = manifest["states"]
    values = read_weights(root / entry["file"], f"artifact {root}")
    states = [DeviceState(g["names"], [values[key] for key in g["keys"]]) for g in entry["groups"]]
    for bucket, k in zip(buckets, entry["bucket_state"]):
        if k is not None:
            bucket.state = states[k]


def _spec_to_json(module: CompiledModel, root: Path) -> dict:
    if module.spec is not None:
        spec = module.spec
        return {"declarative": {"sizes": spec.sizes, "inputs": {str(k): v for k, v in spec.inputs.items()},
                                "pad_values": {str(k): v for k, v in spec.pad_values.items()},
                                "outputs": {str(k): v for k, v in spec.outputs.items()}}}
    if isinstance(module.kernel, (torch.jit.ScriptFunction, torch.jit.ScriptModule)):
        torch.jit.save(module.kernel, str(root / KERNEL_FILE))
        return {"script_kernel": KERNEL_FILE}
    raise ArtifactError("save: this model's bucket kernel is a plain Python function, which cannot be saved without "
                        "pickling code. Use declarative buckets (neuron_serve.BucketSpec / model.yaml 'buckets') or "
                        "a torch.jit.script kernel.")


# --- load ---------------------------------------------------------------------------


def read_manifest(path: str | Path) -> dict:
    """The verified manifest of the artifact at ``path``; raises ArtifactError if unusable."""
    root = Path(path)
    manifest_file = root / MANIFEST
    if not manifest_file.is_file():
        raise ArtifactError(f"{root} is not a neuron-serve artifact: it has no {MANIFEST}. "
                            "Build one with: neuron-serve build model.yaml -o DIR")
    text = manifest_file.read_text()
    expected = (root / MANIFEST_HASH).read_text().strip() if (root / MANIFEST_HASH).is_file() else None
    try:
        manifest = json.loads(text)
    except ValueError:
        manifest = None
    if manifest is None or expected != hashlib.sha256(text.encode()).hexdigest():
        raise ArtifactError(f"artifact {root}: {MANIFEST} is corrupt or was edited (SHA-256 check failed). "
                            + _rebuild_hint(manifest, root))
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"artifact {root} has format {manifest.get('format')} v{manifest.get('format_version')}; "
                            f"this neuron-serve reads {FORMAT} v{FORMAT_VERSION}. " + _rebuild_hint(manifest, root))
    here = versions()
    stale = [f"{k.removesuffix('_version')} {v} (this is {here.get(k)})"
             for k, v in manifest["versions"].items() if here.get(k) != v]
    if stale:
        raise ArtifactError(f"artifact {root} was built with {', '.join(stale)}; compiled models do not carry over "
                            "between versions. " + _rebuild_hint(manifest, root))
    for name, digest in manifest["files"].items():
        file = root / name
        found = _sha256(file) if file.is_file() else "missing"
        if found != digest:
            raise ArtifactError(f"artifact {root}: {name} is corrupt ({'missing' if found == 'missing' else 'SHA-256 mismatch'})"
                                f". " + _rebuild_hint(manifest, root))
    return manifest


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ArtifactError(f"artifact names an unknown dtype {name!r}")
    return dtype


def _uses_pickle(config: Any) -> bool:
    if isinstance(config, dict):
        return config.get("use_pickle") is True or any(_uses_pickle(v) for v in config.values())
    return False


def _check_no_pickle(file: Path) -> None:
    """Refuse a .pt2 whose payloads would be unpickled (only raw tensor bytes are read)."""
    with zipfile.ZipFile(file) as archive:
        for member in archive.namelist():
            if "/sample_inputs/" in member and archive.getinfo(member).file_size:
                raise ArtifactError(f"artifact file {file} holds pickled sample inputs; neuron-serve does not unpickle.")
            if member.endswith("_config.json") and _uses_pickle(json.loads(archive.read(member))):
                raise ArtifactError(f"artifact file {file} stores tensors as pickles; neuron-serve does not unpickle.")


_BUILTIN_CONTAINERS = (tuple, list, dict)


def _portable(spec: pytree.TreeSpec) -> pytree.TreeSpec:
    """The same structure with library output classes (e.g. transformers' ModelOutput) as dicts."""
    children = [_portable(c) for c in spec.children_specs]
    if spec.type is None or spec.type in _BUILTIN_CONTAINERS:
        return pytree.TreeSpec(spec.type, spec.context, children) if children else spec
    if isinstance(spec.context, (list, tuple)) and all(isinstance(k, str) for k in spec.context):
        return pytree.TreeSpec(dict, list(spec.context), children)
    return pytree.TreeSpec(tuple, None, children)


def _load_out_spec(entry: dict) -> pytree.TreeSpec:
    try:
        return pytree.treespec_loads(entry["out_spec"])
    except NotImplementedError as exc:
        # The model returned a library's output class that this process has not imported.
        logger.info("outputs come back as dicts and tuples: %s (import the library to get its classes)", exc)
        return pytree.treespec_loads(entry["out_spec_portable"])


def _drop_device_asserts(gm: torch.fx.GraphModule) -> None:
    # Re-export records "this input is on CPU" checks; the compiled copy runs on the device.
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    gm.recompile()


def read_weights(file: str | Path, field: str) -> dict[str, torch.Tensor]:
    """A state dict saved with ``torch.save`` (tensors only; nothing else is unpickled).

    ``field`` names what pointed at the file, for the error.
    """
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"{field}: no such file {file}; give the path of a state dict saved with "
                          "torch.save(model.state_dict(), path).") from None
    except Exception as exc:  # noqa: BLE001  # torch.load raises many types; all mean "not a state dict"
        raise ConfigError(f"{field}: {file} is not a state dict saved with torch.save(model.state_dict(), path) "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}).") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ConfigError(f"{field}: {file} holds a {type(state).__name__}, not a dict of tensors; save it with "
                          "torch.save(model.state_dict(), path).")
    return state


def _load_bucket(entry: dict, root: Path, weights: dict[str, torch.Tensor] | None) -> Bucket:
    modules: dict[str, torch.nn.Module] = {}
    for name, part in entry["modules"].items():
        _check_no_pickle(root / part["file"])
        with warnings.catch_warnings():  # the archive's bytes are copied into tensors we own
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            program = torch.export.load(str(root / part["file"]))
        graph = program.module()
        if part["compiled"]:
            _drop_device_asserts(graph)
            example = _example_args([(tuple(s), _dtype(d)) for s, d in part["inputs"]])
            args = parse_compiler_args(part.get("compiler_args", {}).get("argv") or None, f"{name} compiler_args")
            separated = {n: weights[n] for n in part["weights"]} if "weights" in part else None
            compiled = CompiledSubgraph(graph, example, name=name, compiler_args=args,
                                        inline_weights=separated is None, weights=separated,
                                        donate=part.get("donate", ()))
            compiled._tuple_out = part["tuple_out"]
            compiled.keep_on_device = set(part.get("keep_on_device", ()))
            modules[name] = compiled
        else:
            if weights is not None:  # weights.pt is the model's one copy of record
                with torch.no_grad():
                    for key, tensor in [*graph.named_parameters(), *graph.named_buffers()]:
                        tensor.copy_(weights[key])
            modules[name] = graph
    output_dtypes = entry.get("output_dtypes") or [None] * len(entry["output_shapes"])
    traced = Bucket(
        _graph_from_json(entry["graph"], modules),
        in_spec=pytree.treespec_loads(entry["in_spec"]),
        out_spec=_load_out_spec(entry),
        input_shapes=[(None, None) if s is None else (torch.Size(s[0]), _dtype(s[1])) for s in entry["input_shapes"]],
        output_shapes=[None if s is None else torch.Size(s) for s in entry["output_shapes"]],
        output_dtypes=[None if d is None else _dtype(d) for d in output_dtypes],
        partitions=[Partition(**p) for p in entry["partitions"]],
        report=entry["report"],
        target=entry["target"],
        stage_inputs={n: [(tuple(s), _dtype(d)) for s, d in p["inputs"]] for n, p in entry["modules"].items()},
        batch_size=entry["batch_size"],
    )
    traced.dynamic_batch_enabled = entry["dynamic_batch"]
    traced.aliases = [Alias(slot, output) for slot, output in entry.get("aliases", [])]
    return traced


def load(path: str | Path) -> CompiledModel:
    """Load an artifact written by :func:`save`; its outputs equal the saved module's.

    Refuses (ArtifactError) an artifact that is corrupt, edited, or built with other
    torch / torch-xla / neuron-serve versions, saying how to rebuild it.
    """
    root = Path(path)
    manifest = read_manifest(root)
    xla()
    weights = read_weights(root / manifest["weights"], f"artifact {root}") if manifest.get("weights") else None
    buckets = [_load_bucket(entry, root, weights) for entry in manifest["buckets"]]
    smaller = [[_load_bucket(entry, root, weights) for entry in entries]
               for entries in manifest.get("smaller", [[] for _ in buckets])]
    if "states" in manifest:
        _load_states(manifest, root, buckets)
    spec_json = manifest.get("bucket_spec")
    if spec_json is None:
        return CompiledModel(buckets, smaller=smaller)
    if "declarative" in spec_json:
        d = spec_json["declarative"]
        spec = BucketSpec(sizes=d["sizes"], inputs={int(k): v for k, v in d["inputs"].items()},
                          pad_values={int(k): v for k, v in d["pad_values"].items()},
                          outputs={int(k): v for k, v in d["outputs"].items()})
        return CompiledModel(buckets, smaller=smaller, spec=spec)
    return CompiledModel(buckets, smaller=smaller, kernel=torch.jit.load(str(root / spec_json["script_kernel"])))
