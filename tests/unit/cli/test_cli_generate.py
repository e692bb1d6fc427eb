"""The CLI on a task: generate model.yaml: analyze reports every compiled model, build writes an artifact the engine
serves."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers

import generation_models as gm
from example_models import tiny_llama
from neuron_serve.buckets.generation import GenerationBuckets
from neuron_serve.compile import cache as compile_cache
from neuron_serve.config.schema import load_deployment
from neuron_serve.errors import ArtifactError
from neuron_serve.generation import SamplingParams
from neuron_serve.generation.compiling.compile import compile_generation
from neuron_serve.generation.compiling.build import build_engine

ROOT = Path(__file__).resolve().parents[3]
LLM_YAML = """\
name: tiny-llm
task: generate
model:
  factory: example_models.tiny_llama:build
generation:
  max_num_seqs: 4
  max_model_len: 64
  on_device_sampling: false
"""


@pytest.fixture
def llm_yaml(tmp_path):
    path = tmp_path / "llm.yaml"
    path.write_text(LLM_YAML)
    return path


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "neuron_serve.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore",
                                            "PYTHONPATH": str(ROOT / "deployments")})


# What LLM_YAML's buckets compile: each decode bucket by argmax (on_device_sampling: false; the families test below
# has the sampled ones).
COMPILED = ["prefill_32", "prefill_64", "decode_1x64", "decode_4x64"]


def test_analyze_reports_every_compiled_model(llm_yaml, tmp_path):
    done = _cli("analyze", llm_yaml, "--html", tmp_path / "report.html", "--report-json", tmp_path / "report.json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert list(report) == COMPILED
    for form in report.values():
        assert form["support_percentage"] == "100.00%" and form["emulated"] is True
        assert form["supported_operators"]["aten"]["aten::index_put"] == 4  # keys and values of 2 layers
        assert form["unsupported_operators"] == {"aten": []}
    # The partition report: one page per compiled model, and their data in one JSON file.
    pages = json.loads((tmp_path / "report.json").read_text())
    assert list(pages) == COMPILED
    for label, data in pages.items():
        assert data["model"] == f"tiny-llm ({label})"
        assert [(s["name"], s["device"]) for s in data["subgraphs"]] == [("accel_0", "neuron")]  # all on the core
        assert data["accepted"] is True
        page = (tmp_path / f"report-{label}.html").read_text()
        assert f"<title>Partition report: tiny-llm ({label})</title>" in page
        assert f"analyzed {label} ({COMPILED.index(label) + 1}/{len(COMPILED)})" in done.stderr


def test_analyze_of_a_lora_model_shows_the_adapter_buffers_per_core(tmp_path):
    (path := tmp_path / "lora.yaml").write_text(
        LLM_YAML + "  prefill_buckets: [64]\n  decode_batch_buckets: [4]\n  decode_context_buckets: [64]\n"
                   "  lora: {max_loras: 2, max_lora_rank: 8}\n")
    done = _cli("analyze", path, "--html", tmp_path / "report.html")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert list(report) == ["prefill_64", "decode_4x64"]
    # Every attention and MLP projection of the 2 layers (hidden 64, MLP 128, key/value 32 wide), an A of
    # (3 slots, in, 8) and a B of (3, 8, out) each, float32: 24,576 values a layer.
    expected = {"max_loras": 2, "max_lora_rank": 8, "bytes_per_core": 2 * 24576 * 4,
                "projections": ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj",
                                "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]}
    for form in report.values():
        assert form["lora"] == expected
        assert form["support_percentage"] == "100.00%"  # the adapters' gathers and matmuls run on the core
    assert "<p>LoRA adapter buffers: <b>192.0 KiB per core</b> (2 adapters at rank 8, and the base's zeros" in \
        (tmp_path / "report-decode_4x64.html").read_text()


def test_analyze_refuses_what_applies_to_infer_models_only(llm_yaml):
    done = _cli("analyze", llm_yaml, "--pipeline-cores", "2")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "error: --pipeline-cores and --profile apply to task: infer models; a task: generate model runs each compiled "
        "model on one core, and its times are the engine's step metrics")


def test_a_built_artifact_generates_as_the_model_does(llm_yaml, tmp_path):
    out = tmp_path / "built"
    built = _cli("build", llm_yaml, "-o", out)
    assert built.returncode == 0, built.stderr
    # The longest prefill and the largest decode first (what answers every request), then the rest.
    assert "neuron_serve: compiled tiny-llm prefill_64 (1 of 4) in " in built.stderr
    assert "neuron_serve: compiled tiny-llm decode_1x64 (4 of 4) in " in built.stderr
    assert "neuron_serve: placement of tiny-llm (4 compiled models): 4 accelerator subgraphs, 0 CPU subgraphs;" \
        in built.stderr
    assert "Num Partitions" not in built.stderr
    assert sorted(p.name for p in out.iterdir()) == [*(f"bucket_{i}" for i in range(4)), "manifest.json",
                                                    "manifest.sha256", "model.yaml", "states.pt", "weights.pt"]
    # The weights once, in weights.pt; the compiled models' programs take them as inputs and hold none.
    lm = tiny_llama.build()
    stored = torch.load(out / "weights.pt", weights_only=True)
    assert sum(t.numel() for t in stored.values()) >= sum(p.numel() for p in lm.parameters())
    for program in out.glob("bucket_*/*.pt2"):
        with warnings.catch_warnings():  # the archive's bytes are read-only; nothing is written to them
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            held = torch.export.load(str(program)).state_dict
        assert sum(t.numel() for t in held.values()) < 1000, program  # none of the weights
    # analyze says what the build took of host memory for each compiled model, beside the weights and cache
    analyzed = _cli("analyze", llm_yaml)
    assert analyzed.returncode == 0, analyzed.stderr
    for label, form in json.loads(analyzed.stdout).items():
        host = form["memory"]["host_bytes"]
        assert host["weights"] == form["memory"]["bytes_per_core"]["weights"] == host["weights_on_cores"]
        assert host["cores_in_host_memory"] is True
        assert host["compiled_model"] is not None and host["compile_peak"] > 0 and host["compile_seconds"] > 0, label
    config, folder = load_deployment(out)
    assert config.model.artifact == "." and config.generation.max_num_seqs == 4
    engine = build_engine(config, folder)  # compiles the saved programs; no transformers model is built
    try:
        prompts = [[5, 9, 200, 17], list(range(40, 70))]
        done = engine.generate_batch(prompts, SamplingParams(max_tokens=8, temperature=0), timeout=120)
        assert [d.tokens for d in done] == [gm.eager_greedy(lm, p, 8) for p in prompts]
    finally:
        engine.close()
    # Another model.yaml serving the artifact with other buckets is refused, naming the field.
    other = tmp_path / "other.yaml"
    other.write_text("name: tiny-llm\ntask: generate\nmodel:\n  artifact: built\ngeneration:\n  max_num_seqs: 8\n")
    changed, folder = load_deployment(other)
    with pytest.raises(ArtifactError, match=rf"^generation\.max_num_seqs: {out} was built with max_num_seqs 4, but "
                                            r"this model.yaml asks for 8; rebuild the artifact from this model.yaml "
                                            r"or remove generation\.max_num_seqs\.$"):
        build_engine(changed, folder)


def test_a_warm_start_takes_every_support_decision_from_the_compile_cache(fresh_cache):
    buckets = GenerationBuckets.build(2, 32, prefill=[32], decode_rows=[2], decode_context=[32])
    compile_generation(gm.build("gpt2"), buckets)
    cold = fresh_cache.stats["support"].misses
    assert cold > 0
    compile_cache.configure(fresh_cache.root)  # a new process on the same cache
    from neuron_serve.analysis import placement  # noqa: PLC0415

    placement._ORACLES.clear()
    warm = compile_cache.current()
    compile_generation(gm.build("gpt2"), buckets)
    assert warm.stats["support"].misses == 0 and warm.stats["support"].hits >= cold


def test_the_tiny_llm_is_made_locally_and_generates_as_transformers_does(tmp_path):
    made = subprocess.run([sys.executable, str(ROOT / "deployments" / "example_models" / "make_tiny_llm.py"),
                           str(tmp_path / "llm")], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    (tmp_path / "llm.yaml").write_text("name: llm\ntask: generate\nmodel:\n  pretrained: llm\ngeneration:\n"
                                       "  max_num_seqs: 8\n  max_model_len: 256\n  decode_steps: 4\n")
    config, folder = load_deployment(tmp_path / "llm.yaml")
    group = build_engine(config, folder, background=True)  # served as it is: on its first models
    try:
        [engine] = group.engines.engines
        tokenizer = engine.tokenizer
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What does neuron-serve compile?"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
        assert prompt[0] == tokenizer.bos_token_id and prompt[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
        [done] = group.generate_batch([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                      timeout=120)
        lm = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llm", local_files_only=True,
                                                               attn_implementation="eager")
        lm.generation_config.eos_token_id = None
        assert done.tokens == gm.eager_greedy(lm, prompt, 12)
    finally:
        group.close()


TP_YAML = LLM_YAML + "  tensor_parallel_size: 2\ncores_per_replica: 2\n"


def test_analyze_of_a_tensor_parallel_model_shows_each_weights_split_and_the_bytes_per_core(tmp_path):
    path = tmp_path / "tp.yaml"
    path.write_text(TP_YAML)
    done = _cli("analyze", path, "--html", tmp_path / "report.html")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert list(report) == COMPILED
    split = report["prefill_32"]["tensor_parallel"]
    assert split["tensor_parallel_size"] == 2 and split["state"] == "(-, tp, -, -)"
    assert split["weights"]["lm.model.layers.0.self_attn.q_proj.weight"] == "(tp, -)"
    assert split["weights"]["lm.model.layers.0.mlp.down_proj.weight"] == "(-, tp)"
    assert split["bytes_per_core"]["kv_cache"] * 2 == split["bytes_whole"]["kv_cache"]
    assert split["bytes_per_core"]["weights"] < split["bytes_whole"]["weights"]
    page = (tmp_path / "report-decode_4x64.html").read_text()
    assert "Tensor parallelism: <b>2 cores</b>" in page and "<code>(-, tp)</code>" in page


def test_build_of_a_tensor_parallel_model_records_its_split(tmp_path):
    path = tmp_path / "tp.yaml"
    path.write_text(TP_YAML)
    done = _cli("build", path, "-o", tmp_path / "built")
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "built" / "manifest.json").read_text())
    split = manifest["extra"]["generation"]["sharding"]
    assert split["devices"] == 2 and split["state"] == [None, "tp", None, None]
    assert split["weights"]["lm.model.layers.0.self_attn.o_proj.weight"] == [None, "tp"]
    served = (tmp_path / "built" / "model.yaml").read_text()
    assert "tensor_parallel_size: 2" in served and "cores_per_replica: 2" in served


SPECULATIVE_YAML = """\
name: spec-llm
task: generate
model:
  pretrained: target
generation:
  max_num_seqs: 2
  max_model_len: 32
  prefill_buckets: [32]
  decode_batch_buckets: [2]
  decode_context_buckets: [32]
  decode_steps: 2
  speculative_config:
    model: draft-lm
    num_speculative_tokens: 2
"""


def test_analyze_and_build_carry_every_model_family_and_the_draft(tmp_path):
    from prometheus_client import REGISTRY  # noqa: PLC0415

    target = gm.build("llama")
    target.save_pretrained(tmp_path / "target")
    target.save_pretrained(tmp_path / "draft-lm")  # a draft that agrees: every proposal is accepted
    (tmp_path / "spec.yaml").write_text(SPECULATIVE_YAML)
    done = _cli("analyze", tmp_path / "spec.yaml")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    # The verify model, the multi-step decode, each greedy and sampled, and the draft's own (greedy only: its
    # decode runs k + 1 steps a call).
    assert list(report) == ["prefill_32", "decode_2x32", "decode_2x32_steps2", "decode_2x32_sampled",
                            "decode_2x32_steps2_sampled", "verify_2x32_tokens3", "verify_2x32_tokens3_sampled",
                            "draft_prefill_32", "draft_decode_2x32", "draft_decode_2x32_steps3"]
    writes = {label: form["supported_operators"]["aten"]["aten::index_put"] for label, form in report.items()}
    assert writes["decode_2x32"] == 4 and writes["decode_2x32_steps2"] == 8 and writes["draft_decode_2x32_steps3"] == 12

    out = tmp_path / "built"
    built = _cli("build", tmp_path / "spec.yaml", "-o", out)
    assert built.returncode == 0, built.stderr
    assert (out / "draft" / "manifest.json").is_file()
    config, folder = load_deployment(out)
    assert config.generation.speculative_config.model == "draft"
    engine = build_engine(config, folder)
    try:
        prompt = [5, 9, 200, 17, 3]
        done = engine.generate_batch([prompt], SamplingParams(max_tokens=10, temperature=0), timeout=120)
        assert done[0].tokens == gm.eager_greedy(target, prompt, 10)
        drafted = REGISTRY.get_sample_value("neuron_serve_spec_decode_num_draft_tokens_total",
                                            {"model_name": "spec-llm", "replica": "0"})
        assert drafted > 0
    finally:
        engine.close()
    # The artifact's draft is its own: another folder, or none asked for, is refused by field.
    for generation, message in [
            ("  speculative_config: {model: draft-lm, num_speculative_tokens: 2}\n",
             rf"^generation\.speculative_config\.model: {out} carries its draft, compiled, in {out / 'draft'}; name "
             rf"that folder, not {tmp_path / 'draft-lm'} \(or rebuild the artifact with this draft\)\.$"),
            ("  max_num_seqs: 2\n",
             rf"^generation\.speculative_config: {out} was built with a draft model; serve it with the "
             r"speculative_config it was built with \(the artifact's own model.yaml\), or rebuild it\.$")]:
        other = tmp_path / "other.yaml"
        other.write_text(f"name: spec-llm\ntask: generate\nmodel:\n  artifact: built\ngeneration:\n{generation}")
        changed, folder = load_deployment(other)
        with pytest.raises(ArtifactError, match=message):
            build_engine(changed, folder)
