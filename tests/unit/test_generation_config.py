"""model.yaml of task: generate: its validation (each error naming the field and the fix),
the generation section's defaults, and build_engine from a save_pretrained directory."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from neuron_serve.config.schema import parse_config
from neuron_serve.config.generation import GenerationSettings
from neuron_serve.errors import ConfigError
from neuron_serve.generation import SamplingParams
from neuron_serve.generation.compiling.build import build_engine, load_lm, weight_bytes
from neuron_serve.partition.pipeline import CORE_MEMORY_ENV

GENERATE = {"name": "tiny-llama", "task": "generate", "model": {"pretrained": "llama"}}
INFER = {"name": "mlp", "model": {"factory": "example_models.mlp:build"},
         "inputs": [{"name": "x", "shape": [32, 784], "dtype": "float32"}]}
SMALL = {"max_model_len": 32, "prefill_buckets": [8, 32], "decode_batch_buckets": [2],
         "decode_context_buckets": [32], "max_num_seqs": 2}


def with_(base: dict, **changes) -> dict:
    data = copy.deepcopy(base)
    data.update(changes)
    return data


def without(base: dict, key: str) -> dict:
    return {k: v for k, v in copy.deepcopy(base).items() if k != key}


REFUSED = [
    ("generation with task infer", with_(INFER, generation={"max_num_seqs": 4}),
     "generation: applies to task: generate; set task: generate or remove generation"),
    ("tokenizer with task infer", with_(INFER, tokenizer="tok"),
     "tokenizer: applies to task: generate, embed, score or classify; set one of them or remove tokenizer"),
    ("pretrained with task infer", with_(INFER, model={"pretrained": "llama"}),
     "model.pretrained: a transformers model directory is served with task: generate (a causal LM) or embed, "
     "score, classify (a pooling model); set one of them, or use model.factory or model.artifact"),
    ("infer without inputs", without(INFER, "inputs"),
     "inputs: Field required for task: infer (add the model's inputs, each with name, shape and dtype)"),
    ("generate with inputs", with_(GENERATE, inputs=[{"name": "ids", "shape": [1, 8], "dtype": "int64"}]),
     "inputs: applies to task: infer; a generate model takes prompt token ids and returns tokens; remove inputs"),
    ("an unknown tool-call parser", with_(GENERATE, generation={"tool_call_parser": "mistral"}),
     "generation.tool_call_parser: Input should be 'hermes' or 'llama3_json' (use one of the values listed)"),
    ("generate with outputs", with_(GENERATE, outputs=["logits"]),
     "outputs: applies to task: infer; a generate model takes prompt token ids and returns tokens; remove outputs"),
    ("generate with buckets", with_(GENERATE, buckets={"sizes": [8], "inputs": {"ids": 1}}),
     "buckets: applies to task: infer; a generate model compiles its own buckets (see generation); remove buckets"),
    ("generate with batch_sizes", with_(GENERATE, batch_sizes=[1, 4]),
     "batch_sizes: applies to task: infer; a generate model compiles its own buckets (see generation); remove "
     "batch_sizes"),
    ("generate with weights but no artifact", with_(GENERATE, weights="finetune"),
     "weights: a generate model swaps in another checkpoint of its architecture from an artifact (model.artifact, "
     "written by neuron-serve build), without compiling; to compile from a checkpoint, name its directory as "
     "model.pretrained and remove weights"),
    ("generate with inline_weights_to_neff", with_(GENERATE, inline_weights_to_neff=False),
     "inline_weights_to_neff: applies to task: infer; a generate model's executables always take its weights as "
     "inputs, shared by every compiled model (another checkpoint: weights, beside model.artifact); remove "
     "inline_weights_to_neff"),
    ("generate with a pipeline", with_(GENERATE, placement={"mode": "pipeline"}),
     "placement.mode: pipeline applies to task: infer; a generate model runs on one core; remove placement or use "
     "mode: replicate"),
    ("generate with a partitioner", with_(GENERATE, partitioner={"min_subgraph_size": 2}),
     "partitioner: applies to task: infer; a generate model is compiled with the default partitioner settings; "
     "remove partitioner"),
    ("two model sources", with_(GENERATE, model={"factory": "a:b", "pretrained": "llama"}),
     "model: Value error, give exactly one of 'factory' (an import path 'package.module:function'), 'artifact' "
     "(a directory written by 'neuron-serve build') or 'pretrained' (a transformers or sentence-transformers "
     "model directory)"),
    ("no model source", with_(GENERATE, model={}), "model: Value error, give exactly one of 'factory'"),
    ("kwargs for pretrained", with_(GENERATE, model={"pretrained": "llama", "kwargs": {"a": 1}}),
     "model: Value error, 'kwargs' apply to a factory; an artifact or a pretrained directory is loaded as it is, "
     "remove 'kwargs'"),
    ("unknown task", with_(GENERATE, task="chat"),
     "task: Input should be 'infer', 'generate', 'embed', 'score' or 'classify' (use one of the values listed)"),
    ("generation typo", with_(GENERATE, generation={"max_num_seq": 4}),
     "generation.max_num_seq: Extra inputs are not permitted (remove it or check its spelling)"),
    ("no slots", with_(GENERATE, generation={"max_num_seqs": 0}),
     "generation.max_num_seqs: Input should be greater than or equal to 1"),
    ("max_model_len 1", with_(GENERATE, generation={"max_model_len": 1}),
     "generation.max_model_len: Input should be greater than or equal to 2"),
    ("queue bound 0", with_(GENERATE, generation={"max_waiting": 0}),
     "generation.max_waiting: Input should be greater than or equal to 1"),
    ("request timeout 0", with_(GENERATE, generation={"request_timeout_s": 0}),
     "generation.request_timeout_s: Input should be greater than 0"),
    ("token budget 0", with_(GENERATE, generation={"max_num_batched_tokens": 0}),
     "generation.max_num_batched_tokens: Input should be greater than or equal to 1"),
    ("bucket size 0", with_(GENERATE, generation={"prefill_buckets": [0, 32]}),
     "generation.prefill_buckets.0: Input should be greater than 0"),
    ("prefill short of max_model_len", with_(GENERATE, generation={"max_model_len": 64, "prefill_buckets": [8, 32]}),
     "generation.prefill_buckets: the largest bucket must be max_model_len (64), got 32: a larger one could never "
     "be used, a smaller one leaves max_model_len unreachable."),
    ("decode rows past max_num_seqs", with_(GENERATE, generation={"max_num_seqs": 4, "decode_batch_buckets": [1, 8]}),
     "generation.decode_batch_buckets: the largest bucket must be max_num_seqs (4), got 8"),
    ("prefill rows without 1", with_(GENERATE, generation={"max_num_seqs": 4, "prefill_batch_buckets": [2, 4]}),
     "generation.prefill_batch_buckets: give prompt counts from 1 (a prompt alone) to at most max_num_seqs (4), got "
     "[2, 4]."),
    ("prefill rows past max_num_seqs", with_(GENERATE, generation={"max_num_seqs": 4, "prefill_batch_buckets": [1, 8]}),
     "generation.prefill_batch_buckets: give prompt counts from 1 (a prompt alone) to at most max_num_seqs (4), got "
     "[1, 8]."),
    ("async scheduling with speculation", with_(GENERATE, generation={
        "async_scheduling": True, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}),
     "generation.async_scheduling: feeds each one-step decode's tokens to the next on the core, and "
     "speculative_config does not decode that way; set it false or leave it unset"),
    ("no adapter on the core", with_(GENERATE, generation={"lora": {"max_loras": 0}}),
     "generation.lora.max_loras: Input should be greater than or equal to 1"),
    ("a rank vLLM does not allow", with_(GENERATE, generation={"lora": {"max_lora_rank": 24}}),
     "generation.lora.max_lora_rank: 24 is not a rank vLLM allows; use 1, 8, 16, 32, 64, 128, 256, 320 or 512 (an "
     "adapter of a smaller rank is zero-padded to it)"),
    ("fewer adapters on the host than on the core", with_(GENERATE, generation={"lora": {"max_loras": 4,
                                                                                        "max_cpu_loras": 2}}),
     "generation.lora.max_cpu_loras: 2 is fewer than max_loras (4), and every adapter on the core is also kept on "
     "the host; raise max_cpu_loras to at least 4 or lower max_loras"),
    ("an adapter name no URL takes", with_(GENERATE, generation={"lora": {"lora_modules": {"SQL Adapter": "sql"}}}),
     "generation.lora.lora_modules.SQL Adapter: not a valid adapter name (a request names the adapter as its model: "
     "lowercase letters, digits, '-', '_', '.', starting with a letter or digit, at most 63 characters); rename it"),
    ("an adapter named as the model", with_(GENERATE, generation={"lora": {"lora_modules": {"tiny-llama": "sql"}}}),
     "generation.lora.lora_modules.tiny-llama: is the model's own name (the base model answers to it); give the "
     "adapter another name"),
    ("an adapter without a directory", with_(GENERATE, generation={"lora": {"lora_modules": {"sql": " "}}}),
     "generation.lora.lora_modules.sql: give the adapter's directory (a PEFT adapter directory, relative to the "
     "model.yaml's folder)"),
    ("lora typo", with_(GENERATE, generation={"lora": {"max_lora": 2}}),
     "generation.lora.max_lora: Extra inputs are not permitted (remove it or check its spelling)"),
    ("lora with task infer", with_(INFER, generation={"lora": {}}),
     "generation: applies to task: generate; set task: generate or remove generation"),
]


@pytest.mark.parametrize("data,line", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refused_names_the_field_and_the_fix(data, line):
    with pytest.raises(ConfigError) as err:
        parse_config(data, "model.yaml")
    first, *lines = str(err.value).splitlines()
    assert first == "model.yaml: invalid model.yaml"
    assert any(given.strip().startswith(line) for given in lines), str(err.value)


def test_empty_inputs_still_refused_for_infer():
    with pytest.raises(ConfigError, match="inputs: List should have at least 1 item"):
        parse_config(with_(INFER, inputs=[]))


def test_a_generate_model_yaml_parses_with_defaults():
    config = parse_config(GENERATE)
    assert (config.task, config.inputs, config.generation, config.tokenizer) == ("generate", None, None, None)
    assert config.model.pretrained == "llama"
    given = parse_config(with_(GENERATE, tokenizer="tok", generation={}, target="xla"))
    assert given.generation == GenerationSettings()
    assert given.generation.model_dump() == {
        "max_num_seqs": 8, "max_model_len": None, "prefill_buckets": None, "decode_batch_buckets": None,
        "decode_context_buckets": None, "decode_steps": 1, "on_device_sampling": True, "tensor_parallel_size": 1,
        "max_num_batched_tokens": None, "enable_chunked_prefill": False, "prefill_chunk_buckets": None,
        "long_prefill_token_threshold": 0, "max_num_partial_prefills": 1, "learn_buckets_after": None,
        "prefill_batch_buckets": None, "async_scheduling": None,
        "max_waiting": 256, "enable_prefix_caching": False, "speculative_config": None, "lora": None,
        "tool_call_parser": None, "quantization": None, "quantization_type": "per_channel_symmetric",
        "modules_to_not_convert": None, "kv_cache_dtype": "auto", "calculate_kv_scales": None,
        "request_timeout_s": None}
    assert parse_config(with_(GENERATE, model={"factory": "pkg.lm:build", "kwargs": {"size": 2}})).model.kwargs
    assert parse_config(INFER).task == "infer"


def test_lora_is_on_when_present_with_vllms_defaults():
    assert parse_config(with_(GENERATE, generation={})).generation.lora is None
    for given in ({}, None):  # `lora: {}`, or a bare `lora:` (YAML's null)
        assert parse_config(with_(GENERATE, generation={"lora": given})).generation.lora.model_dump() == {
            "max_loras": 1, "max_lora_rank": 16, "max_cpu_loras": 1, "lora_modules": {},
            "allow_runtime_updates": False}
    lora = parse_config(with_(GENERATE, generation={"lora": {
        "max_loras": 4, "max_lora_rank": 64, "lora_modules": {"sql": "adapters/sql", "chat-v2": "/srv/chat"},
        "allow_runtime_updates": True}})).generation.lora
    assert (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras, lora.allow_runtime_updates) == (4, 64, 4, True)
    assert lora.lora_modules == {"sql": "adapters/sql", "chat-v2": "/srv/chat"}
    assert parse_config(with_(GENERATE, generation={"lora": {"max_loras": 2, "max_cpu_loras": 8}})).generation.lora \
        .max_cpu_loras == 8


@pytest.mark.parametrize("generation,model", [
    # A base-model draft still proposes; the verify, with the row's adapter, decides: the output stays exact.
    ({"speculative_config": {"model": "draft", "num_speculative_tokens": 2}}, {"pretrained": "llama"}),
    ({"speculative_config": {"num_speculative_tokens": 2}, "enable_prefix_caching": True}, {"pretrained": "llama"}),
    ({"decode_steps": 4}, {"pretrained": "llama"}),
    ({}, {"artifact": "built"}),  # adapters are files of their own, beside the compiled models
], ids=["draft model", "ngram and prefix caching", "decode steps", "artifact"])
def test_lora_combines_with_the_other_generation_settings(generation, model):
    data = with_(GENERATE, model=model, cores_per_replica=2, generation={**generation, "lora": {"max_loras": 2}})
    assert parse_config(data).generation.lora.max_loras == 2


class Positions:
    def __init__(self, n: int | None) -> None:
        if n is not None:
            self.max_position_embeddings = n


def test_settings_to_buckets_defaults():
    buckets = GenerationSettings().to_buckets(Positions(4096))
    assert buckets.describe() == {
        "max_num_seqs": 8, "max_model_len": 2048, "prefill_buckets": [32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048],
        "decode_batch_buckets": [1, 4, 8], "decode_context_buckets": [128, 256, 512, 1024, 2048], "decode_steps": 1,
        "enable_prefix_caching": False, "speculative_tokens": 0, "on_device_sampling": True,
        "enable_chunked_prefill": False, "prefill_chunk_buckets": [], "prefill_batch_buckets": [1, 4, 8]}
    # Several prompts a prefill call while they hold at most max_model_len tokens.
    assert buckets.prefills[len(buckets.prefill):] == [(4, 32), (4, 64), (4, 128), (4, 256), (4, 384), (4, 512),
                                                       (8, 32), (8, 64), (8, 128), (8, 256)]
    assert GenerationSettings(prefill_batch_buckets=[1]).to_buckets(Positions(4096)).prefills == [
        (1, n) for n in buckets.prefill]
    chunked = GenerationSettings(enable_chunked_prefill=True).to_buckets(Positions(4096))
    # A chunk of a quarter of max_model_len beside each decode-rows bucket, greedy and sampled.
    assert chunked.chunks == [512] and chunked.mixed == [(1, 512), (4, 512), (8, 512)]
    assert chunked.count == buckets.count + 3 * 2
    short = GenerationSettings(max_num_seqs=2).to_buckets(Positions(64))
    assert (short.max_model_len, short.prefill, short.decode_rows, short.decode_context) == (64, [32, 64], [1, 2], [64])
    given = GenerationSettings(**SMALL).to_buckets(Positions(64))
    assert (given.prefill, given.decode_rows, given.decode_context) == ([8, 32], [2], [32])
    cached = GenerationSettings(max_num_seqs=2, prefill_buckets=[16, 64], decode_context_buckets=[32, 64],
                                enable_prefix_caching=True).to_buckets(Positions(64))
    # Two prefill buckets and two prompts of 16, four decode buckets greedy and sampled, three extend buckets.
    assert cached.extend == [(16, 32), (16, 64), (64, 64)] and cached.count == 3 + 2 * 2 * 2 + 3
    speculating = GenerationSettings(max_num_seqs=2, decode_context_buckets=[32, 64], speculative_config={
        "num_speculative_tokens": 3}).to_buckets(Positions(64))
    # A verify, greedy and sampled, per decode bucket.
    assert speculating.speculative_tokens == 3 and speculating.count == 3 + 2 * 2 * 2 + 2 * 2 * 2


def test_settings_to_buckets_refusals_name_the_field():
    with pytest.raises(ConfigError, match=r"^generation.max_model_len: 128 is more than the model's "
                                          r"max_position_embeddings \(64\); lower max_model_len to at most 64.$"):
        GenerationSettings(max_model_len=128).to_buckets(Positions(64))
    with pytest.raises(ConfigError, match="^generation.max_model_len: the model's config has no "
                                          "max_position_embeddings; set max_model_len.$"):
        GenerationSettings().to_buckets(Positions(None))
    with pytest.raises(ConfigError, match=r"^generation.prefill_buckets: the largest bucket must be max_model_len "
                                          r"\(64\), got 32"):
        GenerationSettings(prefill_buckets=[32]).to_buckets(Positions(64))


# -- build_engine ---------------------------------------------------------------------------

def tiny_llama(**overrides) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      **overrides)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A folder holding model.yaml's neighbours: llama/ (a tiny Llama and a word-level tokenizer), vit/."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415

    base = tmp_path_factory.mktemp("generate")
    torch.manual_seed(0)
    tiny_llama().save_pretrained(base / "llama")
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(base / "words")
    transformers.ViTModel(transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                 intermediate_size=64)).save_pretrained(base / "vit")
    (base / "broken").mkdir()
    (base / "broken" / "tokenizer.json").write_text("{not json")
    return base


def test_build_engine_generates_what_transformers_generates(pretrained):
    config = parse_config(with_(GENERATE, tokenizer="words", generation={**SMALL, "request_timeout_s": 90}))
    engine = build_engine(config, pretrained)
    try:
        [one] = engine.engines.engines  # one core: one engine
        assert one.tokenizer("w3 w9").input_ids == [3, 9]
        assert (one.name, one.request_timeout_s) == ("tiny-llama", 90)
        prompt = [5, 17, 99, 3, 42, 7]
        [done] = engine.generate_batch([prompt], SamplingParams(max_tokens=5, temperature=0), timeout=120)
    finally:
        engine.close()
    lm = transformers.AutoModelForCausalLM.from_pretrained(pretrained / "llama", local_files_only=True,
                                                           attn_implementation="eager")
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                           pad_token_id=0)
    assert (len(done.tokens), done.finish_reason) == (5, "length")
    assert done.tokens == want[0, len(prompt):].tolist()


def test_a_cache_too_big_for_the_core_is_refused_with_the_bytes(pretrained, monkeypatch):
    lm = transformers.AutoModelForCausalLM.from_pretrained(pretrained / "llama", local_files_only=True)
    weights = weight_bytes(lm)
    per_slot = 2 * 1 * 32 * 1 * 16 * 4  # keys and values x layers x positions x kv heads x head_dim x float32
    monkeypatch.setenv(CORE_MEMORY_ENV, str(weights + 3 * per_slot))
    config = parse_config(with_(GENERATE, generation={"max_num_seqs": 8, "max_model_len": 32}))
    with pytest.raises(ConfigError) as err:
        build_engine(config, pretrained)
    assert str(err.value) == (
        f"generation.max_num_seqs: 8 slots of 32 positions need {8 * per_slot} bytes of KV cache ({per_slot} per "
        f"slot) next to {weights} bytes of weights, more than the core's {weights + 3 * per_slot} bytes; at most 3 "
        f"slot(s) fit. Lower max_num_seqs or max_model_len, or split the model over 2 cores with "
        f"generation.tensor_parallel_size: 2.")


@pytest.mark.parametrize("model,tokenizer,text", [
    ("missing", None, "model.pretrained: {base}/missing is not a directory; give a directory written by "
                      "save_pretrained (relative to the model.yaml's folder)."),
    ("vit", None, "model.pretrained: cannot load {base}/vit as a transformers causal LM (ValueError: "
                  "Unrecognized configuration class"),
    ("llama", "nowhere", "tokenizer: {base}/nowhere is not a directory; give a directory of transformers tokenizer "
                         "files (tokenizer.json, tokenizer_config.json, ...)."),
    ("llama", "broken", "tokenizer: cannot load a tokenizer from {base}/broken (JSONDecodeError: "),
], ids=["missing directory", "not a causal LM", "missing tokenizer", "unreadable tokenizer"])
def test_build_engine_refusals_name_the_field(pretrained, model, tokenizer, text):
    data = with_(GENERATE, model={"pretrained": model}, generation=SMALL)
    if tokenizer:
        data["tokenizer"] = tokenizer
    with pytest.raises(ConfigError) as err:
        build_engine(parse_config(data), pretrained)
    assert str(err.value).startswith(text.format(base=pretrained)), str(err.value)


FACTORIES = '''
import torch
import transformers


def linear():
    return torch.nn.Linear(4, 4)


def sdpa_llama():
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
'''


def test_factory_models_must_be_causal_lms_and_get_eager_attention(tmp_path):
    (tmp_path / "generation_config_factories.py").write_text(FACTORIES)
    linear = parse_config(with_(GENERATE, model={"factory": "generation_config_factories:linear"}))
    with pytest.raises(ConfigError, match=r"^model.factory: 'generation_config_factories:linear' returned a Linear, "
                                          r"not a transformers causal LM .*task: generate needs one.$"):
        build_engine(linear, tmp_path)
    sdpa = parse_config(with_(GENERATE, model={"factory": "generation_config_factories:sdpa_llama"}))
    lm = load_lm(sdpa, tmp_path)
    assert lm.config._attn_implementation == "eager"
    assert not lm.training


def test_lora_is_refused_by_build_not_ignored():
    """generation.lora is served by deploy (test_lora_serving.py) and in process (test_lora_engine.py); an
    artifact does not carry adapters yet, so neuron-serve build refuses it, naming where."""
    from neuron_serve.config.generation import refuse_lora  # noqa: PLC0415

    config = parse_config(with_(GENERATE, model={"pretrained": "llama"}, generation={**SMALL, "lora": {"max_loras": 2}}))
    with pytest.raises(ConfigError, match=r"^generation\.lora: neuron-serve build \(an artifact\) does not serve LoRA "
                                          r"adapters yet; `neuron-serve deploy` serves them from the model\.yaml"):
        refuse_lora(config.generation, "neuron-serve build (an artifact)")


def test_build_engine_refuses_an_infer_model():
    with pytest.raises(ConfigError, match="^task: mlp is a task: infer model; build_engine serves task: generate.$"):
        build_engine(parse_config(INFER))


@pytest.mark.parametrize("given, line", [
    ([0, 32], "generation.prefill_buckets.0: Input should be greater than 0"),
    ("atuo", "generation.prefill_buckets: Input should be 'auto' (use one of the values listed)"),
])
def test_a_bucket_list_or_auto_is_refused_for_what_was_given_only(given, line):
    """A list-or-auto field says what is wrong with the list given, or with the word: not both of pydantic's
    branches."""
    with pytest.raises(ConfigError) as err:
        parse_config(with_(GENERATE, generation={"prefill_buckets": given}), "model.yaml")
    assert str(err.value).splitlines()[1:] == [f"  {line}"]
