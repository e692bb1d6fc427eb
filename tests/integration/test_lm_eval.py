"""EleutherAI's lm-evaluation-harness pointed at the served LLM example, as a user points it at
any OpenAI server.

``local-completions`` scores a small multiple-choice task by loglikelihood (each choice's
context and continuation sent as one prompt with ``echo``, ``logprobs`` and ``max_tokens: 1``),
once with token-id prompts (its default) and once with text prompts four to a request;
``local-chat-completions`` answers a small generate_until task through the chat template. Every
loglikelihood is compared with transformers' eager model on the same weights, and every answer
with transformers' greedy generation of the chat-templated prompt cut at the first stop string.

The tasks are local files written here (nothing is downloaded); lm-eval runs through its Python
API in a process of its own (lm_eval_run.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import LLM_MAX_MODEL_LEN

RUNNER = Path(__file__).with_name("lm_eval_run.py")
MODEL = "llm"
# A loglikelihood is a sum of the continuation tokens' logprobs; each token's logprob is within
# 1e-4 of eager float32 (XLA:CPU's fused kernels round differently, as test_generate_serving.py
# asserts), and the continuations here are at most a few tokens long.
LOGLIKELIHOOD_TOLERANCE = 1e-3
MAX_GEN_TOKS = 16

MULTIPLE_CHOICE = [
    {"question": "What compiles each accelerator subgraph?", "choices": ["torch-xla", "a spreadsheet", "gcc -O0"],
     "answer": 0},
    {"question": "Which API does the server speak for LLMs?", "choices": ["FTP", "OpenAI's"], "answer": 1},
    {"question": "Where does a greedy choice run?", "choices": ["on the core", "on a remote GPU", "in the browser",
                                                                 "nowhere"], "answer": 0},
    {"question": "What keeps a sequence's keys and values?", "choices": ["the KV cache", "the log file"],
     "answer": 0},
    {"question": "How many tokens does one decode step add to a sequence?", "choices": ["ten", "one", "none"],
     "answer": 1},
    {"question": "What serves the model over HTTP?", "choices": ["Ray Serve", "a fax machine", "cron"], "answer": 0},
    {"question": "Which file describes a deployment?", "choices": ["model.yaml", "/etc/passwd"], "answer": 0},
    {"question": "What is emulated on a laptop?", "choices": ["the keyboard", "the screen", "the NeuronCores"],
     "answer": 2},
]
CHAT_PROMPTS = ["Say hello", "Name a core", "What is XLA?", "Count to three", "Describe the cache"]
MEAN = {"aggregation": "mean", "higher_is_better": True}  # a metric's defaults, said (lm-eval warns otherwise)


def write_task(directory: Path, name: str, docs: list[dict], config: dict) -> None:
    """A task of lm-eval over ``docs``, a local JSON-lines file read by datasets' json builder."""
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", **config}
    (directory / f"{name}.yaml").write_text(yaml.safe_dump(task, sort_keys=False))


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation ids as lm-eval makes them for a causal model (TemplateLM._encode_pair):
    the context's trailing spaces moved to the continuation, the whole tokenized without special
    tokens, the continuation being what follows the context's own token count."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    return context_ids, whole[len(context_ids):]


def eager_loglikelihood(llm, context: str, continuation: str) -> float:
    """The continuation's log-probability given the context under transformers' eager model."""
    context_ids, continuation_ids = encode_pair(llm.tokenizer, context, continuation)
    ids = context_ids + continuation_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(llm.eager(torch.tensor([ids])).logits[0], dim=-1)
    return sum(logprobs[i - 1, ids[i]].item() for i in range(len(context_ids), len(ids)))


def eager_chat_answer(llm, prompt: str) -> str:
    """transformers' greedy answer to ``prompt`` as the one user message of the chat template."""
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
    ids = torch.tensor([llm.tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = llm.eager.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_GEN_TOKS,
                                 do_sample=False, pad_token_id=llm.tokenizer.eos_token_id)
    return llm.tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


def cut_at_stops(text: str, stops: list[str]) -> str:
    return text[:min((text.find(s) for s in stops if s in text), default=len(text))]


def stop_inside(answer: str) -> str:
    """Two ASCII letters or digits from the second half of ``answer`` whose first occurrence is not
    at its start: a stop string that cuts this answer and leaves some of it."""
    for start in [*range(len(answer) // 2, len(answer) - 1), *range(1, len(answer) // 2)]:
        stop = answer[start:start + 2]
        if stop.isascii() and stop.isalnum() and answer.find(stop) > 0:
            return stop
    raise AssertionError(f"no stop string to take from {answer!r}")


@pytest.fixture(scope="module")
def evaluated(llm, tmp_path_factory):
    """lm-eval's three runs against the server, their samples keyed by run; with the stop strings
    and the eager answers the chat run is compared with."""
    tmp = tmp_path_factory.mktemp("lm_eval")
    write_task(tmp, "neuron_mc", MULTIPLE_CHOICE, {
        "output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc", **MEAN}]})
    answers = {prompt: eager_chat_answer(llm, prompt) for prompt in CHAT_PROMPTS}
    # The model has random weights and its tokenizer is trained from the docs, so no fixed string is
    # sure to occur in an answer: one is taken from the first answer, so that `until` really cuts it.
    stops = ["\n", stop_inside(answers[CHAT_PROMPTS[0]])]
    write_task(tmp, "neuron_chat", [{"prompt": p, "target": "hello"} for p in CHAT_PROMPTS], {
        "output_type": "generate_until", "doc_to_text": "{{prompt}}", "doc_to_target": "{{target}}",
        "generation_kwargs": {"until": stops, "max_gen_toks": MAX_GEN_TOKS, "temperature": 0, "do_sample": False},
        "metric_list": [{"metric": "exact_match", **MEAN}]})
    completions = {"base_url": f"{llm.url}/v1/completions", "model": MODEL, "tokenizer_backend": "huggingface",
                   "tokenizer": str(llm.model_dir), "max_length": LLM_MAX_MODEL_LEN, "num_concurrent": 2,
                   "max_retries": 1}  # one attempt: a request the server fails fails the run
    runs = {
        "token ids": {"model": "local-completions", "tasks": ["neuron_mc"],
                      "model_args": {**completions, "tokenized_requests": True}},
        "text, batched": {"model": "local-completions", "tasks": ["neuron_mc"],
                          "model_args": {**completions, "tokenized_requests": False, "batch_size": 4}},
        "chat": {"model": "local-chat-completions", "tasks": ["neuron_chat"], "apply_chat_template": True,
                 "model_args": {"base_url": f"{llm.url}/v1/chat/completions", "model": MODEL,
                                "num_concurrent": 2, "max_retries": 1}},
    }
    (tmp / "runs.json").write_text(json.dumps({"include_path": str(tmp), "runs": list(runs.values())}))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf"),
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(RUNNER), str(tmp / "runs.json"), str(tmp / "out.json")], cwd=tmp,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = dict(zip(runs, json.loads((tmp / "out.json").read_text())))
    return {"results": results, "stops": stops, "answers": answers}


@pytest.mark.parametrize("run", ["token ids", "text, batched"])
def test_multiple_choice_loglikelihoods_and_accuracy_equal_eager(llm, evaluated, run):
    result = evaluated["results"][run]
    samples = sorted(result["samples"]["neuron_mc"], key=lambda s: s["doc_id"])
    assert [s["doc"] for s in samples] == MULTIPLE_CHOICE
    eager_acc = []
    for sample, doc in zip(samples, MULTIPLE_CHOICE):
        # One request a choice: (context, continuation) in, [(loglikelihood, is_greedy)] back.
        assert [continuation for _, continuation in sample["arguments"]] == [" " + c for c in doc["choices"]]
        served = [resp[0][0] for resp in sample["resps"]]
        eager = [eager_loglikelihood(llm, context, continuation) for context, continuation in sample["arguments"]]
        assert served == pytest.approx(eager, abs=LOGLIKELIHOOD_TOLERANCE), doc["question"]
        eager_acc.append(float(max(range(len(eager)), key=eager.__getitem__) == doc["answer"]))
        assert sample["acc"] == eager_acc[-1], (doc["question"], served, eager)
    assert result["results"]["neuron_mc"]["acc,none"] == sum(eager_acc) / len(eager_acc)


def test_chat_generate_until_answers_as_transformers_greedy(evaluated):
    result, stops, answers = evaluated["results"]["chat"], evaluated["stops"], evaluated["answers"]
    samples = sorted(result["samples"]["neuron_chat"], key=lambda s: s["doc_id"])
    assert [s["doc"]["prompt"] for s in samples] == CHAT_PROMPTS
    for sample in samples:
        prompt = sample["doc"]["prompt"]
        # The request lm-eval sent: the chat (a JSON string) as one user message, stops and max tokens
        # from the task.
        [[[messages], gen_kwargs]] = sample["arguments"]
        assert json.loads(messages) == [{"role": "user", "content": prompt}]
        assert gen_kwargs["until"] == stops and gen_kwargs["max_gen_toks"] == MAX_GEN_TOKS
        [[text]] = sample["resps"]
        assert text == cut_at_stops(answers[prompt], stops), prompt
    first = answers[CHAT_PROMPTS[0]]
    assert 0 < len(samples[0]["resps"][0][0]) < len(first)  # the stop string cut it, leaving some
    assert result["results"]["neuron_chat"]["exact_match,none"] == sum(
        cut_at_stops(answers[p], stops) == "hello" for p in CHAT_PROMPTS) / len(CHAT_PROMPTS)
