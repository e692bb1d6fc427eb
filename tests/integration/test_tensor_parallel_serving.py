"""Generate models served over tensor-parallel groups of two emulated cores.

The LLM example on one replica of four cores: two engines, each over a group of two
cores in a process of its own, the model's weights and KV cache split in each. The
core's memory is set below what the whole model needs, so at tensor_parallel_size 1 the
same model.yaml is refused (naming tensor_parallel_size) and at 2 it serves. Beside it,
in the same deployment, a Qwen2 with one key/value head, a Mistral and a Qwen3 (tiny,
random weights, token-id prompts) each over one group of two cores. Every greedy answer
must equal transformers' greedy generation of the same prompt ids.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
import yaml

import generation_models as gm
from conftest import Server, make_llm
from neuron_serve.config.schema import parse_config
from neuron_serve.errors import ConfigError
from neuron_serve.generation.runner import tensor_parallel
from neuron_serve.generation.compiling.build import build_engine, check_cache_fits, weight_bytes
from neuron_serve.partition.pipeline import CORE_MEMORY_ENV

GENERATION = {"max_num_seqs": 4, "max_model_len": 64, "prefill_buckets": [16, 64], "decode_batch_buckets": [4],
              "decode_context_buckets": [64], "on_device_sampling": False}  # every request here is greedy
CONFIG = {"name": "llm", "task": "generate", "model": {"pretrained": "llm"}, "cores_per_replica": 4,
          "generation": {**GENERATION, "tensor_parallel_size": 2}}
# Tiny models of the other architectures, one group of two cores each, as factories of tests/generation_models.py.
ARCHS = {"qwen2": {"num_key_value_heads": 1}, "mistral": {}, "qwen3": {}}
TINY_GENERATION = {"max_num_seqs": 4, "max_model_len": 32, "prefill_buckets": [32], "decode_batch_buckets": [4],
                   "decode_context_buckets": [32], "tensor_parallel_size": 2, "on_device_sampling": False}
ID_PROMPTS = [[5, 17, 200, 3], [9, 9, 31], [101, 7, 64, 2, 250, 12]]
PROMPTS = ["Hello world", "neuron-serve compiles", "The cores are emulated", "tensor parallel", "four cores", "two"]


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    import transformers  # noqa: PLC0415

    tmp = tmp_path_factory.mktemp("tensor-parallel")
    make_llm(tmp / "llm")
    eager = transformers.AutoModelForCausalLM.from_pretrained(tmp / "llm", attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp / "llm")
    buckets = parse_config(CONFIG).generation.to_buckets(eager.config)
    # Room for the model split in two, not for it whole: between what a core needs at TP 2 and at TP 1.
    need = {size: tensor_parallel.bytes_per_core(eager, tensor_parallel.plan(eager, size) if size > 1 else None)
            for size in (1, 2)}
    cache = check_cache_fits(eager, buckets, tensor_parallel_size=2)
    budget = need[2] + cache + (need[1] - need[2]) // 4
    (tmp / "llm.yaml").write_text(yaml.safe_dump(CONFIG))
    (tmp / "generation_models.py").write_text(Path(gm.__file__).read_text())  # the factories, beside their yaml
    gm.byte_tokenizer().save_pretrained(tmp / "bytes")  # any id decodes: answers compare as text
    for arch, overrides in ARCHS.items():
        (tmp / f"{arch}.yaml").write_text(yaml.safe_dump({
            "name": arch, "task": "generate", "cores_per_replica": 2, "generation": TINY_GENERATION,
            "tokenizer": "bytes",
            "model": {"factory": "generation_models:build", "kwargs": {"arch": arch, **overrides}}}))
    srv = Server([str(tmp / f"{name}.yaml") for name in ("llm", *ARCHS)], tmp, env={CORE_MEMORY_ENV: str(budget)})
    srv.dir, srv.eager, srv.tokenizer, srv.budget = tmp, eager, tokenizer, budget
    yield srv
    srv.stop()


def eager_text(tp, prompt: str, max_tokens: int) -> str:
    ids = tp.tokenizer(prompt)["input_ids"]
    tensor = torch.tensor([ids])
    with torch.no_grad():
        out = tp.eager.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=max_tokens,
                                do_sample=False, pad_token_id=tp.tokenizer.eos_token_id)
    return tp.tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def get(tp, path: str) -> dict:
    with urllib.request.urlopen(tp.url + path, timeout=30) as answer:
        return json.loads(answer.read())


def test_greedy_answers_equal_transformers_with_both_groups_serving(tp):
    client = openai.OpenAI(base_url=f"{tp.url}/v1", api_key="unused", max_retries=0)
    try:
        def ask(prompt: str) -> str:
            done = client.completions.create(model="llm", prompt=prompt, max_tokens=20, temperature=0)
            return done.choices[0].text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # more than one group's slots: both engines run
            answers = list(pool.map(ask, PROMPTS))
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="llm", prompt=PROMPTS[0], max_tokens=20, temperature=0, stream=True))
    finally:
        client.close()
    assert answers == [eager_text(tp, p, 20) for p in PROMPTS]
    assert streamed == answers[0]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_each_architecture_served_at_tp2_answers_as_transformers(tp, arch):
    client = openai.OpenAI(base_url=f"{tp.url}/v1", api_key="unused", max_retries=0)
    try:
        done = client.completions.create(model=arch, prompt=ID_PROMPTS, max_tokens=12, temperature=0)
    finally:
        client.close()
    lm, tokenizer = gm.build(arch, **ARCHS[arch]), gm.byte_tokenizer()
    want = [tokenizer.decode(gm.eager_greedy(lm, p, 12), skip_special_tokens=True) for p in ID_PROMPTS]
    assert [c.text for c in sorted(done.choices, key=lambda c: c.index)] == want


def test_metadata_models_and_metrics_say_how_the_model_is_split(tp):
    parameters = get(tp, "/v2/models/llm")["parameters"]
    assert (parameters["cores"], parameters["tensor_parallel_size"], parameters["engines"]) == (4, 2, 2)
    [card] = [m for m in get(tp, "/v1/models")["data"] if m["id"] == "llm"]
    assert (card["id"], card["tensor_parallel_size"], card["max_model_len"]) == ("llm", 2, 64)
    text = urllib.request.urlopen(f"{tp.url}/metrics", timeout=30).read().decode()
    weights = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("neuron_serve_core_memory_bytes{") and 'kind="weights"' in line
               and 'model_name="llm"' in line]
    # A core holds what the compiled models read: not transformers' spare copy of the rotary frequencies (kept for
    # dynamic RoPE, which this model does not use).
    unread = sum(b.numel() * b.element_size() for n, b in tp.eager.named_buffers() if n.endswith("original_inv_freq"))
    expected = tensor_parallel.bytes_per_core(tp.eager, tensor_parallel.plan(tp.eager, 2)) - unread
    assert unread > 0 and weights and set(weights) == {expected} and expected < 0.75 * weight_bytes(tp.eager)


def test_the_same_model_at_tp1_is_refused_naming_tensor_parallel_size(tp, monkeypatch):
    monkeypatch.setenv(CORE_MEMORY_ENV, str(tp.budget))
    config = parse_config({**CONFIG, "cores_per_replica": 1, "generation": GENERATION})
    with pytest.raises(ConfigError, match=r"at most \d+ slot\(s\) fit\. Lower max_num_seqs or max_model_len, or "
                                          r"split the model over 2 cores with generation.tensor_parallel_size: 2\.$"):
        build_engine(config, tp.dir)
