"""LoRA adapters served by `neuron-serve deploy`: a request names its adapter as its model (OpenAI's client
unchanged), /v1/models lists each adapter with its base as parent, and /v1/load_lora_adapter and
/v1/unload_lora_adapter (vLLM's routes and bodies) change them while the server runs, on every replica,
without a compile. Every answer is PEFT's own model's, token for token, logprob for logprob within 1e-4."""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
import yaml

import generation_models as gm
from generation_models import ATTENTION, MLP, make_adapter

MODEL = "lora"
TOKEN = "lora-test-token-0123456789"  # the server's bearer token: the load and unload routes are behind it too
ADAPTERS = {  # different ranks and targets: max_lora_rank 16 pads the smaller ones
    "attention": {"r": 4, "lora_alpha": 8, "target_modules": ATTENTION},
    "mlp": {"r": 8, "lora_alpha": 16, "target_modules": MLP},
    "qv": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]},  # loaded while serving
    "wide": {"r": 32, "lora_alpha": 32, "target_modules": ["q_proj"]},  # over max_lora_rank: refused
}
NEW_TOKENS = 6
LOGPROB_TOLERANCE = 1e-4
CONFIG = {
    "name": MODEL, "task": "generate", "replicas": 2, "model": {"pretrained": "llama"},
    "http": {"auth": {"token_env": "LORA_TOKEN"}},
    "generation": {"max_num_seqs": 4, "max_model_len": 48, "prefill_buckets": [48], "decode_batch_buckets": [4],
                   "decode_context_buckets": [48], "on_device_sampling": False,  # greedy requests only
                   "lora": {"max_loras": 2, "max_lora_rank": 16, "allow_runtime_updates": True,
                            "lora_modules": {"attention": "adapters/attention", "mlp": "adapters/mlp"}}},
}


@pytest.fixture(scope="module")
def lora(server_factory, tmp_path_factory):
    """The tiny Llama with a byte-level tokenizer, two adapters from the model.yaml (paths relative to it), two
    replicas; PEFT's model of each adapter and the base as ``server.peft``."""
    tmp = tmp_path_factory.mktemp("lora")
    base = gm.build("llama")
    base.save_pretrained(tmp / "llama")
    tokenizer = gm.byte_tokenizer()
    tokenizer.save_pretrained(tmp / "llama")
    peft = {name: make_adapter(tmp / "adapters" / name, seed=seed + 1, **config)
            for seed, (name, config) in enumerate(ADAPTERS.items())}
    (tmp / "lora.yaml").write_text(yaml.safe_dump(CONFIG))
    srv = server_factory([str(tmp / "lora.yaml")], tmp, env={"LORA_TOKEN": TOKEN}, token=TOKEN)
    srv.peft, srv.base, srv.tokenizer, srv.dir = {**peft, MODEL: base}, base, tokenizer, tmp
    yield srv
    srv.stop()


def expected(server, model: str, prompt: list[int], new: int = NEW_TOKENS) -> tuple[str, list[float]]:
    """PEFT's (or the base's) ``new`` greedy tokens after ``prompt`` as text, and each token's logprob."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = server.peft[model].generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                          max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                          output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return server.tokenizer.decode(tokens), logprobs


def prompt(seed: int) -> list[int]:
    return torch.randint(1, gm.VOCAB, (9,), generator=torch.Generator().manual_seed(seed)).tolist()


def complete(client: openai.OpenAI, model: str, ids: list[int]) -> tuple[str, list[float]]:
    choice = client.completions.create(model=model, prompt=ids, max_tokens=NEW_TOKENS, temperature=0,
                                       logprobs=0).choices[0]
    return choice.text, choice.logprobs.token_logprobs


def check(server, answers, asked) -> None:
    for (text, logprobs), (model, ids) in zip(answers, asked):
        want_text, want_logprobs = expected(server, model, ids)
        assert text == want_text, model
        assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_TOLERANCE), model


def post(server, path: str, body: dict, token: str | None = TOKEN) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def scrape(server) -> str:
    request = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return answer.read().decode()


def metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_models_lists_each_adapter_with_its_base_as_parent(lora):
    with openai.OpenAI(base_url=f"{lora.url}/v1", api_key=TOKEN, max_retries=0) as client:
        cards = {m.id: m for m in client.models.list().data}
        assert list(cards) == [MODEL, "attention", "mlp"]
        assert (cards["mlp"].model_extra["parent"], cards["mlp"].model_extra["root"]) == \
            (MODEL, str(lora.dir / "adapters" / "mlp"))
        assert cards["attention"].model_extra["max_model_len"] == 48
        assert client.models.retrieve("attention").model_extra["parent"] == MODEL


def test_one_batch_of_adapters_and_the_base_each_answers_as_peft(lora):
    asked = [(model, prompt(seed)) for seed, model in enumerate(["attention", MODEL, "mlp", "attention", "mlp"])]
    with openai.OpenAI(base_url=f"{lora.url}/v1", api_key=TOKEN, max_retries=0) as client, \
            ThreadPoolExecutor(len(asked)) as pool:
        answers = list(pool.map(lambda a: complete(client, *a), asked))
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="mlp", prompt=asked[2][1], max_tokens=NEW_TOKENS, temperature=0, stream=True))
    check(lora, answers, asked)
    assert streamed == answers[2][0]
    assert answers[0][0] != answers[1][0]  # an adapter's answer is not the base's
    # vLLM's lora_requests_info: a series per set of adapters running, set when the engine's step saw it.
    running = {line.split('running_lora_adapters="')[1].split('"')[0] for line in scrape(lora).splitlines()
               if line.startswith("neuron_serve_lora_requests_info{") and 'max_lora="2"' in line}
    assert {"attention", "mlp"} & {name for names in running for name in names.split(",")}


def test_an_adapter_loaded_while_serving_answers_on_every_replica_without_a_compile_then_unloads(lora):
    compiled = metric_sum(scrape(lora), "neuron_serve_compiled_models", model=MODEL, state="compiled")
    live = lora.dir / "adapters" / "live"  # qv's files, then mlp's: load_inplace from the same directory
    shutil.copytree(lora.dir / "adapters" / "qv", live)
    status, text = post(lora, "/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": str(live)})
    assert (status, text) == (200, "Success: LoRA adapter 'qv' added successfully.")
    asked = [("qv", prompt(10 + i)) for i in range(4)]
    # Through /v1 (Serve routes an adapter to the replicas holding it) and the model's own routes (HAProxy's
    # round robin reaches both replicas, each loading it from the server's list on its first request).
    with openai.OpenAI(base_url=f"{lora.url}/v1", api_key=TOKEN, max_retries=0) as client, \
            openai.OpenAI(base_url=f"{lora.url}/v2/models/{MODEL}/v1", api_key=TOKEN, max_retries=0) as own:
        answers = [complete(client if i < 2 else own, model, ids) for i, (model, ids) in enumerate(asked)]
        answers += [complete(own, "qv", asked[0][1]) for _ in range(4)]
    check(lora, answers, asked + [asked[0]] * 4)
    metrics = scrape(lora)
    assert metric_sum(metrics, "neuron_serve_compiled_models", model=MODEL, state="compiled") == compiled
    loaded_on = {line.split('replica="')[1].split('"')[0] for line in metrics.splitlines()
                 if line.startswith("neuron_serve_lora_adapter_load_seconds_count{") and float(line.split()[-1]) > 0}
    assert len(loaded_on) == 2  # both replicas serve it

    # New files in the same directory, loaded in place: every replica reads them again (a new version).
    shutil.rmtree(live)
    shutil.copytree(lora.dir / "adapters" / "mlp", live)
    assert post(lora, "/v1/load_lora_adapter", {"lora_name": "qv", "lora_path": str(live), "load_inplace": True}) \
        == (200, "Success: LoRA adapter 'qv' added successfully.")
    with openai.OpenAI(base_url=f"{lora.url}/v2/models/{MODEL}/v1", api_key=TOKEN, max_retries=0) as own:
        replaced = [complete(own, "qv", asked[0][1]) for _ in range(4)]
    want = expected(lora, "mlp", asked[0][1])
    assert all(text == want[0] and logprobs == pytest.approx(want[1], abs=LOGPROB_TOLERANCE)
               for text, logprobs in replaced)

    status, text = post(lora, "/v1/unload_lora_adapter", {"lora_name": "qv"})
    assert (status, text) == (200, "Success: LoRA adapter 'qv' removed successfully.")
    with openai.OpenAI(base_url=f"{lora.url}/v1", api_key=TOKEN, max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as gone:
            complete(client, "qv", asked[0][1])
        assert gone.value.body["code"] == "model_not_found"
        assert "qv" not in [m.id for m in client.models.list().data]
    status, body = post(lora, "/v1/unload_lora_adapter", {"lora_name": "qv"})
    assert (status, json.loads(body)) == (404, {"error": {
        "message": "The lora adapter 'qv' cannot be found.", "type": "not_found_error", "param": "lora_name",
        "code": "model_not_found"}})


def test_unloading_an_adapter_lets_its_running_streams_finish_and_refuses_new_ones(lora):
    """Streams on an adapter run when it is unloaded: each one its replica took finishes whole, as PEFT's model
    answers; one reaching a replica after the unload, and every request after it, is 404."""
    source = lora.dir / "adapters" / "qv"
    assert post(lora, "/v1/load_lora_adapter", {"lora_name": "brief", "lora_path": str(source)}) == \
        (200, "Success: LoRA adapter 'brief' added successfully.")
    ids, long = prompt(30), 36  # up to max_model_len (48): a stream of many steps
    lora.peft["brief"] = lora.peft["qv"]
    streaming = threading.Event()

    def stream(client: openai.OpenAI) -> list[tuple[float, str, str | None]] | None:
        chunks = []
        try:
            for chunk in client.completions.create(model="brief", prompt=ids, max_tokens=long, temperature=0,
                                                   stream=True):
                chunks.append((time.monotonic(), chunk.choices[0].text, chunk.choices[0].finish_reason))
                streaming.set()
        except openai.NotFoundError as refused:  # it reached its replica after the unload
            assert not chunks and refused.body["code"] == "model_not_found"
            return None
        return chunks

    # More streams than the two replicas' 8 slots: some wait in an engine's queue while others stream.
    with openai.OpenAI(base_url=f"{lora.url}/v1", api_key=TOKEN, max_retries=0) as client, \
            ThreadPoolExecutor(12) as pool:
        streams = [pool.submit(stream, client) for _ in range(12)]
        assert streaming.wait(60)
        unloading = time.monotonic()
        assert post(lora, "/v1/unload_lora_adapter", {"lora_name": "brief"}) == \
            (200, "Success: LoRA adapter 'brief' removed successfully.")
        finished = [chunks for f in streams if (chunks := f.result(timeout=120)) is not None]
        with pytest.raises(openai.NotFoundError) as gone:
            complete(client, "brief", ids)
    assert gone.value.body["code"] == "model_not_found"
    want = expected(lora, "brief", ids, long)[0]
    assert finished  # the stream that had begun, at least
    for chunks in finished:
        assert "".join(text for _, text, _ in chunks) == want
        assert chunks[-1][2] == "length"
    # Some streams were still answering when the unload was asked for (under load the acknowledgement, which
    # every replica gives, may come after the last of them ends).
    assert max(chunks[-1][0] for chunks in finished) > unloading


def test_refusals_name_the_model_the_adapter_and_the_reason(lora):
    with openai.OpenAI(base_url=f"{lora.url}/v1", api_key=TOKEN, max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as unknown:
            complete(client, "nope", [1, 2])
    assert unknown.value.body["message"] == "the model 'nope' does not exist; this server serves: lora, attention, mlp"
    wide = lora.dir / "adapters" / "wide"
    status, body = post(lora, "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": str(wide)})
    assert (status, json.loads(body)["error"]["message"]) == (
        400, f"{wide / 'adapter_config.json'}: r is 32, more than generation.lora.max_lora_rank (16); set "
             f"generation.lora.max_lora_rank to 32, or serve an adapter of rank at most 16.")
    status, body = post(lora, "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": str(wide)})
    assert (status, json.loads(body)["error"]["message"]) == (
        400, "The lora adapter 'mlp' has already been loaded. (load_inplace: true replaces it)")
    status, body = post(lora, "/v1/load_lora_adapter", {"lora_name": MODEL, "lora_path": str(wide)})
    assert (status, json.loads(body)["error"]["message"]) == (
        400, "lora_name: 'lora' is the name of a served model; give the adapter another")
    status, body = post(lora, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert (status, json.loads(body)["error"]["param"]) == (400, "lora_path")
    status, body = post(lora, "/v1/unload_lora_adapter", {"lora_name": "mlp", "lora_int_id": 3})
    assert (status, json.loads(body)["error"]["message"]) == (400, "lora_int_id: Extra inputs are not permitted")
    status, body = post(lora, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(wide)}, token=None)
    assert (status, json.loads(body)["error"]["code"]) == (401, "invalid_api_key")
    # The server kept serving.
    with openai.OpenAI(base_url=f"{lora.url}/v1", api_key=TOKEN, max_retries=0) as client:
        check(lora, [complete(client, "mlp", prompt(20))], [("mlp", prompt(20))])
