"""The README's examples on real models: SmolLM2-135M-Instruct (deployments/llm.yaml) and all-MiniLM-L6-v2
(deployments/embedder.yaml), served together as `neuron-serve deploy` serves them, checked against transformers'
and sentence-transformers' own eager answers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import numpy as np
import openai
import pytest
import torch
import transformers

import real_models

pytestmark = pytest.mark.serial  # shares the documentation examples' server (conftest.examples_llm_server)

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["The three primary colours are", "def fibonacci(n):", "Once upon a time, in a small village,"]
SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A cheetah is running behind its prey."]


@pytest.fixture(scope="module")
def client(examples_llm_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{examples_llm_server.url}/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def eager():
    """transformers' SmolLM2 from the same directory: the reference of every greedy answer."""
    folder = real_models.smollm2()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, tokenizer


def _greedy(eager, ids: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``ids``, ended by the checkpoint's EOS as a server ends it."""
    model, tokenizer = eager
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new_tokens, do_sample=False)
    tokens = out[0, len(ids):].tolist()
    return tokens[:tokens.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in tokens else tokens


def test_a_chat_answer_is_the_readme_s_and_ends_at_the_model_s_own_stop_token(client, eager):
    answer = client.chat.completions.create(model="llm", messages=CAPITAL, temperature=0)  # no max_tokens
    [choice] = answer.choices
    assert choice.message.content == "The capital of France is Paris."
    assert choice.finish_reason == "stop"  # <|im_end|>, the checkpoint's EOS, not a length
    _, tokenizer = eager
    prompt = tokenizer.apply_chat_template(CAPITAL, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert answer.usage.prompt_tokens == len(prompt)  # the checkpoint's template, its default system turn included
    assert tokenizer.decode(_greedy(eager, prompt, 40)) == choice.message.content


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completions_equal_transformers_token_for_token(client, eager, prompt):
    _, tokenizer = eager
    ids = tokenizer(prompt)["input_ids"]
    answer = client.completions.create(model="llm", prompt=prompt, max_tokens=32, temperature=0, logprobs=0)
    [choice] = answer.choices
    expected = _greedy(eager, ids, 32)
    assert answer.usage.completion_tokens == len(expected)
    assert choice.text == tokenizer.decode(expected)
    # Token for token: each of the choice's tokens is the text of transformers' token at that position.
    assert choice.logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=True) for t in expected]


def test_a_system_message_n_choices_and_a_stream_with_usage(client):
    messages = [{"role": "system", "content": "You are a geography teacher. Answer in one sentence."}, *CAPITAL]
    stream = client.chat.completions.create(model="llm", messages=messages, temperature=0.8, seed=7, n=2,
                                            max_tokens=40, stream=True, stream_options={"include_usage": True})
    texts, finished, usage = ["", ""], {}, None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert set(finished) == {0, 1} and all(reason in ("stop", "length") for reason in finished.values())
    assert all(text.strip() for text in texts), texts
    assert usage is not None and usage.completion_tokens > 0 and usage.prompt_tokens > len(CAPITAL[0]["content"]) // 8


def test_tools_are_refused_for_a_model_whose_chat_template_has_none(client):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="llm", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=[weather], tool_choice="required")
    assert "model 'llm''s chat template does not show tools to the model, so it cannot call them" in \
        refused.value.body["message"]
    # tool_choice "none": the tools are not called, and the request is answered.
    answer = client.chat.completions.create(model="llm", messages=CAPITAL, tools=[weather], tool_choice="none",
                                            temperature=0, max_tokens=12)
    assert answer.choices[0].message.content.startswith("The capital of France")


def test_the_llm_s_metadata_counts_what_its_prefill_and_decode_buckets_padded(client, eager, examples_llm_server):
    """One greedy completion alone: its prompt's tokens on one prefill bucket (the smallest compiled that holds it),
    each of its decode calls one row on the decode rows bucket that ran it."""
    _, tokenizer = eager
    ids = tokenizer(PROMPTS[0])["input_ids"]

    def padding() -> dict:
        return metadata(examples_llm_server, "llm")["parameters"]["padding"]

    before = padding()
    client.completions.create(model="llm", prompt=PROMPTS[0], max_tokens=6, temperature=0)
    deadline = time.monotonic() + 10  # the engine process sends its counts as the request ends, beside the answer
    while (grown := _grown(before, padding())).get("prefill") is None and time.monotonic() < deadline:
        time.sleep(0.1)
    [(bucket, prefill)] = grown["prefill"].items()
    assert int(bucket) >= len(ids) and prefill == {"calls": 1, "real": len(ids), "padded": int(bucket) - len(ids)}
    assert grown["decode_rows"] and all(
        counted["real"] == counted["calls"] and counted["padded"] == counted["calls"] * (int(rows) - 1)
        for rows, counted in grown["decode_rows"].items()), grown
    assert 1 <= sum(counted["calls"] for counted in grown["decode_rows"].values()) <= 5  # 6 tokens, 1 from prefill


def _grown(before: dict, after: dict) -> dict:
    """Per family and bucket, what the counts grew by (buckets that did not grow left out)."""
    found = {}
    for family, entry in after.items():
        old = before.get(family, {}).get("buckets", {})
        for bucket, counted in entry["buckets"].items():
            delta = {k: v - old.get(bucket, {}).get(k, 0) for k, v in counted.items()}
            if delta["calls"]:
                found.setdefault(family, {})[bucket] = delta
    return found


def metadata(server, name: str = "embedder") -> dict:
    with urllib.request.urlopen(f"{server.url}/v2/models/{name}", timeout=30) as answer:
        return json.load(answer)


def test_embeddings_equal_sentence_transformers_and_rank_a_paraphrase_first(client, examples_llm_server):
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415

    padding = lambda: metadata(examples_llm_server)["parameters"]["padding"].get("length", {}).get("buckets", {})  # noqa: E731
    before = padding()
    answer = client.embeddings.create(model="embedder", input=SENTENCES)
    served = np.array([item.embedding for item in answer.data])
    model = SentenceTransformer(str(real_models.all_minilm_l6_v2()), device="cpu")
    reference = model.encode(SENTENCES)
    assert served.shape == (4, 384)
    assert np.abs(served - reference).max() < 1e-5
    similarity = served @ served.T
    # "eating food" is nearest "eating a piece of bread", far from the baby and the cheetah.
    assert similarity[0, 1] > 0.7 and similarity[0, 1] > 3 * max(similarity[0, 2], similarity[0, 3])
    # The model's metadata counts what the length buckets (64, 256) padded: these four ran packed in one row of 64,
    # their own tokens (the tokenizer's, special tokens included) and the rest of the row.
    tokens = sum(len(ids) for ids in model.tokenizer(SENTENCES)["input_ids"])
    assert tokens <= 64
    after = padding()
    grown = {b: {k: after[b][k] - before.get(b, {}).get(k, 0) for k in after[b]} for b in after}
    assert {b: g for b, g in grown.items() if g["calls"]} == {"64": {"calls": 4, "real": tokens,
                                                                      "padded": 64 - tokens}}


def test_status_buckets_adds_up_what_each_model_s_buckets_padded(client, examples_llm_server):
    """`neuron-serve status --buckets` says per model, family and bucket what the metadata says (one replica each
    here), as the replicas publish it every few seconds."""
    client.embeddings.create(model="embedder", input=SENTENCES[:2])
    client.completions.create(model="llm", prompt=PROMPTS[0], max_tokens=2, temperature=0)
    deadline = time.monotonic() + 30
    while True:
        status = subprocess.run([sys.executable, "-m", "neuron_serve.cli", "status", "--buckets", "--address",
                                 examples_llm_server.ray_address()], capture_output=True, text=True, timeout=120,
                                cwd=real_models.ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        assert status.returncode == 0, status.stderr[-2000:]
        length = metadata(examples_llm_server)["parameters"]["padding"]["length"]
        rows = [(bucket, c["calls"], c["real"], c["padded"]) for bucket, c in length["buckets"].items()]
        wanted = [f"  length: {length['padded_fraction']:.1%} of the work padded"] + [
            f"    {b:>8} {calls:>9} {real:>11} {padded:>11} {padded / (real + padded):>9.1%}"
            for b, calls, real, padded in sorted(rows, key=lambda row: int(row[0]))]
        embedder = status.stdout.split("embedder:\n", 1)[-1].splitlines()
        llm = status.stdout.split("llm:\n", 1)[-1].split("embedder:")[0]
        llm_counted = "\n  prefill: " in llm and "  decode_rows: " in llm  # families in name order
        if (llm_counted and all(line in embedder for line in wanted)) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert "embedder:\n" in status.stdout and all(line in embedder for line in wanted), (wanted, status.stdout)
    assert llm_counted, status.stdout


def test_the_embedder_is_ready_on_its_first_compiled_model(examples_llm_server):
    log = examples_llm_server.log.read_text()
    ready = re.search(r"model embedder built in [\d.]+s; ready on 1 of (\d+) compiled models, the other (\d+) "
                      r"compile in the background", log)
    assert ready, log[-3000:]
    assert int(ready.group(1)) == 4 and int(ready.group(2)) == 3  # lengths 64 and 256 x batch sizes 1 and 4
