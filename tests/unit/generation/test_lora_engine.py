"""LoRA adapters served by one engine: rows of different adapters and of the base in one compiled call, each
answer PEFT's own model's, token for token and logprob for logprob; adapters loaded and unloaded while it
serves, more adapters than buffer slots, and prefix caching kept apart per adapter."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import generation_models as gm
from generation_models import ATTENTION, MLP
from prometheus_client import REGISTRY

from neuron_serve.compile import subgraph
from neuron_serve.errors import AdapterNotLoaded
from neuron_serve.config.schema import parse_config
from neuron_serve.generation import SamplingParams
from neuron_serve.generation.compiling.build import build_engine

# Different ranks and targets (max_lora_rank 16 pads the smaller ones).
ADAPTERS = {
    "attention": {"r": 4, "lora_alpha": 8, "target_modules": ATTENTION},
    "mlp": {"r": 8, "lora_alpha": 16, "target_modules": MLP, "use_rslora": True},
    "layer-1": {"r": 16, "lora_alpha": 8, "target_modules": ATTENTION + MLP, "layers_to_transform": [1]},
    "qv": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]},
}
NEW_TOKENS = 6
LOGPROB_TOLERANCE = 1e-4
# Two buffer slots for four adapters: some requests wait for a slot, and adapters leave the core for others.
LORA = {"max_loras": 2, "max_lora_rank": 16, "max_cpu_loras": 3}


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, gm.VOCAB, (count, length), generator=generator).tolist()


def eager(model: torch.nn.Module, prompt: list[int], new: int = NEW_TOKENS) -> tuple[list[int], list[float]]:
    """``model``'s ``new`` greedy tokens after ``prompt`` and each one's logprob, by transformers' own generate."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(score[0].float(), -1)[token].item() for score, token in zip(out.scores, tokens)]
    return tokens, logprobs


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny Llama served from a model.yaml with generation.lora (prefix caching on), three adapters loaded at
    start from paths relative to it; PEFT's model of each adapter (and of "qv", loaded later), the base model."""
    root = tmp_path_factory.mktemp("lora-engine")
    lm, peft = gm.base_and_adapters(root, ADAPTERS)
    config = parse_config({
        "name": "lora", "task": "generate", "model": {"pretrained": "llama"},
        "generation": {"max_num_seqs": 4, "max_model_len": 48, "prefill_buckets": [12, 48],
                       "prefill_batch_buckets": [1, 4], "decode_batch_buckets": [4],
                       "decode_context_buckets": [48], "on_device_sampling": False, "enable_prefix_caching": True,
                       "async_scheduling": True,  # off by default on emulated cores: adapters' rows decoded ahead
                       "lora": {**LORA, "lora_modules": {name: name for name in ("attention", "mlp", "layer-1")}}}})
    front = build_engine(config, root)
    yield front, peft, lm, root
    front.close()


def hits() -> float:
    """Prompt tokens the engine's prefix cache has reused so far."""
    return REGISTRY.get_sample_value("neuron_serve_prefix_cache_hits_total", {"model_name": "lora", "replica": "0"}) or 0.0


def prefill_calls(label: str) -> float:
    return REGISTRY.get_sample_value("neuron_serve_generation_step_seconds_count",
                                     {"model_name": "lora", "replica": "0", "bucket": label}) or 0.0


def check(done, models, prompt_ids):
    for completion, model, prompt in zip(done, models, prompt_ids):
        want_tokens, want_logprobs = eager(model, prompt)
        assert completion.tokens == want_tokens
        assert completion.logprobs == pytest.approx(want_logprobs, abs=LOGPROB_TOLERANCE)


def test_rows_of_three_adapters_and_the_base_in_one_batch_each_equal_peft(served):
    front, peft, lm, _ = served
    names = ["attention", None, "mlp", "layer-1", "attention", None]
    asked = prompts(len(names), 9, seed=3)
    compiles = subgraph._compiles
    batched = prefill_calls("prefill_4x12")
    done = front.generate_batch(asked, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0),
                                adapters=names, timeout=300)
    check(done, [lm if n is None else peft[n] for n in names], asked)
    assert prefill_calls("prefill_4x12") > batched  # prompts of different adapters prefilled in one call
    [engine] = front.engines.engines
    adapters = engine.adapters
    # Three adapters through two slots: one waited for a slot, and a slot was written again; nothing compiled.
    assert adapters.writes >= 3 and len(adapters.resident) == 2
    assert subgraph._compiles == compiles
    # The base's answer is not any adapter's.
    assert done[1].tokens != done[0].tokens or done[1].logprobs != done[0].logprobs


def test_an_adapter_loaded_while_serving_answers_as_peft_and_once_unloaded_is_refused(served):
    front, peft, _, root = served
    asked = prompts(2, 7, seed=4)
    with pytest.raises(AdapterNotLoaded, match="adapter 'qv' is not loaded"):
        front.generate_batch(asked[:1], SamplingParams(max_tokens=2, temperature=0), adapters="qv")
    front.engines.load_adapter("qv", str(root / "qv"))
    compiles = subgraph._compiles
    done = front.generate_batch(asked, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0),
                                adapters=["qv", "mlp"], timeout=300)
    check(done, [peft["qv"], peft["mlp"]], asked)
    assert subgraph._compiles == compiles  # loading an adapter writes buffers, never compiles
    front.engines.unload_adapter("qv")
    with pytest.raises(AdapterNotLoaded, match="adapter 'qv' is not loaded"):
        front.generate_batch(asked[:1], SamplingParams(max_tokens=2, temperature=0), adapters="qv")


def test_a_prompt_cached_under_one_adapter_is_computed_again_under_another(served):
    front, peft, lm, _ = served
    shared = prompts(1, 40, seed=5)[0]  # two whole blocks of 16 tokens to reuse
    for run, name in enumerate(("attention", "mlp", None, "attention")):
        before = hits()
        [done] = front.generate_batch([shared], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0),
                                      adapters=name, timeout=300)
        check([done], [lm if name is None else peft[name]], [shared])
        # Only the second "attention" run reuses a cached prefix: its own first run's two whole blocks.
        assert hits() - before == (32 if run == 3 else 0)


def test_unloading_an_adapter_lets_the_requests_taken_finish_on_it(served):
    """Six requests on an adapter, four running on the engine's slots and two waiting, when it is unloaded: all
    six finish as PEFT's model answers; a new request is refused, and the adapter is forgotten after the last."""
    front, peft, _, root = served
    [engine] = front.engines.engines
    front.engines.load_adapter("qv", str(root / "qv"))
    asked, new = prompts(6, 9, seed=8), 24
    done = []
    worker = threading.Thread(target=lambda: done.extend(front.generate_batch(
        asked, SamplingParams(max_tokens=new, temperature=0), adapters="qv", timeout=300)))
    worker.start()
    deadline = time.monotonic() + 60
    while engine.running < 4 and time.monotonic() < deadline:
        time.sleep(0.001)
    running = engine.running
    front.engines.unload_adapter("qv")
    with pytest.raises(AdapterNotLoaded, match="adapter 'qv' is not loaded"):
        front.generate_batch(asked[:1], SamplingParams(max_tokens=2, temperature=0), adapters="qv")
    worker.join(120)
    assert running == 4  # the unload came while four ran (and two waited)
    assert [c.tokens for c in done] == [eager(peft["qv"], p, new)[0] for p in asked]
    assert {c.finish_reason for c in done} == {"length"}
    assert "qv" not in engine.adapters.paths and "qv" not in engine.adapters.resident


def repetitive(seed: int, length: int) -> list[int]:
    """A prompt repeating a short random phrase, so n-gram speculation finds proposals in it."""
    phrase = torch.randint(1, gm.VOCAB, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
    return (phrase * (length // 5 + 1))[:length]


@pytest.mark.parametrize("proposer", [{"method": "ngram"}, {"method": "draft_model", "model": "llama"}],
                         ids=["ngram", "base-as-draft"])
def test_speculative_decoding_verifies_each_row_under_its_own_adapter(served, proposer):
    """Speculation with adapters: each round's verify call takes each row's adapter, so every row's greedy output
    is still its PEFT model's, with proposals accepted and rejected; n-gram proposals, or a draft model's (the
    base model as its own draft: its proposals are the base's, verified under each row's adapter). No logprobs:
    a row asking for them takes its logits home every step and is not speculated."""
    _, peft, lm, root = served
    model = f"lora-speculative-{proposer['method']}"
    config = parse_config({
        "name": model, "task": "generate", "model": {"pretrained": "llama"}, "background_compile": False,
        "generation": {"max_num_seqs": 4, "max_model_len": 48, "prefill_buckets": [12, 48],
                       "prefill_batch_buckets": [1, 4], "decode_batch_buckets": [4],
                       "decode_context_buckets": [48], "on_device_sampling": False,
                       "speculative_config": {**proposer, "num_speculative_tokens": 2},
                       "lora": {**LORA, "lora_modules": {name: name for name in ("attention", "mlp")}}}})
    front = build_engine(config, root)

    def counted(name: str) -> float:
        return REGISTRY.get_sample_value(f"neuron_serve_spec_decode_num_{name}_total",
                                         {"model_name": model, "replica": "0"}) or 0.0

    names = ["attention", None, "mlp", "attention"]
    asked = [repetitive(seed, 20) for seed in range(len(names))]
    new = 26  # long enough for the tiny random models' answers to repeat themselves, which n-grams then propose
    try:
        done = front.generate_batch(asked, SamplingParams(max_tokens=new, temperature=0), adapters=names,
                                    timeout=300)
    finally:
        front.close()
    for completion, name, prompt in zip(done, names, asked):
        assert completion.tokens == eager(lm if name is None else peft[name], prompt, new)[0]
    assert 0 < counted("accepted_tokens") < counted("draft_tokens")
