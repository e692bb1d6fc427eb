"""Tensor parallelism: one engine over two emulated cores, the model split by transformers' tp plan.

The engines at tensor_parallel_size 2 run in a fresh process (tests/tensor_parallel_check.py):
SPMD is a mode of the whole process, whose cores must be exactly the group's. Greedy
generation there must equal transformers' token for token; the refusals are checked here,
before anything compiles.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import generation_models as gm
from neuron_serve.buckets.generation import GenerationBuckets
from neuron_serve.compile.subgraph import compile_count
from neuron_serve.config.schema import parse_config
from neuron_serve.errors import ConfigError
from neuron_serve.generation import SamplingParams
from neuron_serve.generation.runner import tensor_parallel
from neuron_serve.generation.compiling.build import build_engine, check_cache_fits, weight_bytes
from neuron_serve.partition.pipeline import CORE_MEMORY_ENV

ROOT = Path(__file__).resolve().parents[3]
SAMPLED = {"max_tokens": 10, "temperature": 0.8, "top_p": 0.9, "seed": 7}


@pytest.fixture(scope="module")
def at_tp2():
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2", "PYTHONWARNINGS": "ignore",
           "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "tensor_parallel_check.py"), json.dumps(SAMPLED)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_greedy_at_tp2_equals_transformers_with_sequences_joining_and_leaving(at_tp2, arch):
    assert at_tp2["equal"][arch] == [True] * 5


def test_prefix_caching_and_speculation_at_tp2_keep_greedy_output(at_tp2):
    assert at_tp2["cached_speculative_equal"] == [True] * 6


def test_lora_adapters_at_tp2_answer_as_peft_with_their_buffers_whole_on_each_core(at_tp2):
    """Rows of four adapters (ranks 2 to 16, on two buffer slots) and of the base at TP 2, each decoding 8 tokens:
    PEFT's tokens, logprobs within 1e-4. The buffers are kept whole on each core (the plan splits the cache): the
    2 layers' 7 projections, an A of (3 slots, in, 16) and a B of (3, 16, out) each, float32: (in + out) summed
    over q, k, v, o, gate, up, down is 64+64, 64+32, 64+32, 64+64, 64+128, 64+128, 128+64 = 1024."""
    lora = at_tp2["lora"]
    assert lora["equal"] == [True] * 5
    assert lora["worst_logprob_error"] < 1e-4
    assert lora["bytes_per_core"] == 2 * 1024 * 16 * 3 * 4


def test_int8_weights_and_an_fp8_cache_at_tp2_answer_as_eager_with_the_scales_split_with_their_weights(at_tp2):
    """Llama's int8 weights per channel and fp8 cache split over two cores: greedy output of the eager model with
    the same rounded weights and keys and values (tests/precision_models.py). A column-split layer's scales (one an
    output channel) are split with it; a row-split layer's stay whole, as its output channels are."""
    quantized = at_tp2["quantized"]
    assert quantized["equal"] == [True] * 5
    layer = "lm.model.layers.0."
    assert quantized["split"][layer + "self_attn.q_proj.weight"] == "(tp, -)"
    assert quantized["split"][layer + "self_attn.q_proj.weight_scale"] == "(tp, -)"
    assert quantized["split"][layer + "self_attn.o_proj.weight"] == "(-, tp)"
    assert layer + "self_attn.o_proj.weight_scale" not in quantized["split"]
    per_head = 2 * 2 * 4 * 48 * 16  # keys and values x layers x slots x positions x head_dim, one byte each
    assert quantized["memory"]["kv_cache"] == per_head  # two heads, one on each core
    # The float32 embeddings and LM head are most of this tiny model; the layers' weights are a quarter.
    assert quantized["memory"]["weights"] < at_tp2["memory"]["llama"]["weights"] - 3 * 20_000


def test_chunked_prefill_at_tp2_answers_as_transformers(at_tp2):
    """The mixed calls (decode rows and a prompt's chunk) compiled once for the group: every prompt, chunked beside
    the others' decodes, gets transformers' greedy tokens."""
    assert at_tp2["chunked"]["equal"] == [True] * 5 and at_tp2["chunked"]["chunked_steps"] > 0


def test_a_tensor_parallel_artifact_loads_over_its_group_and_answers_the_same(at_tp2):
    assert at_tp2["artifact_equal"] == [True] * 5


def test_a_seeded_sample_gives_the_same_tokens_alone_and_in_a_batch_at_tp2_as_eager_sampling(at_tp2):
    """Sampled on the group's cores, from the split model's logits: the tokens of eager sampling (as at TP 1,
    tests/unit/generation/test_generation_decode_steps.py), alone and beside greedy and sampled rows."""
    from tensor_parallel_check import prompts  # noqa: PLC0415 - the same prompts as at TP 2

    want = gm.eager_sampled(gm.build("llama"), prompts()[1], SAMPLED["max_tokens"], SamplingParams(**SAMPLED))
    assert at_tp2["sampled"] == at_tp2["sampled_mixed"] == want


def test_the_split_follows_the_models_tp_plan(at_tp2):
    llama = at_tp2["split"]["llama"]
    layer = "lm.model.layers.0."
    assert llama["tensor_parallel_size"] == 2
    assert llama["weights"][layer + "self_attn.q_proj.weight"] == "(tp, -)"  # colwise: output features
    assert llama["weights"][layer + "self_attn.k_proj.weight"] == "(tp, -)"
    assert llama["weights"][layer + "self_attn.o_proj.weight"] == "(-, tp)"  # rowwise: input features
    assert llama["weights"][layer + "mlp.down_proj.weight"] == "(-, tp)"
    assert llama["weights"]["lm.lm_head.weight"] == "(tp, -)"  # by vocabulary
    assert llama["state"] == "(-, tp, -, -)"  # the cache by key/value heads
    assert at_tp2["cache_split"] == "{devices=[1,2,1,1]0,1}"  # still split after decode calls and slot moves
    # Qwen2 with one key/value head for two cores: k/v projections and the cache whole on each core.
    qwen2 = at_tp2["split"]["qwen2"]
    assert qwen2["state"] == "replicated" and layer + "self_attn.k_proj.weight" not in qwen2["weights"]
    assert qwen2["weights"][layer + "self_attn.q_proj.bias"] == "(tp)"
    whole = weight_bytes(gm.build("llama"))
    assert at_tp2["memory"]["llama"]["weights"] < 0.75 * whole
    per_head = 2 * 2 * 4 * 48 * 16 * 4  # keys and values x layers x slots x positions x head_dim x float32
    assert at_tp2["memory"]["llama"]["kv_cache"] == 2 * per_head // 2  # two heads, one on each core
    assert at_tp2["memory"]["qwen2"]["kv_cache"] == per_head  # its one head on both


GENERATE = {"name": "lm", "task": "generate", "model": {"factory": "generation_models:build", "kwargs": {"arch": "llama"}}}


def _config(**generation):
    return parse_config({**GENERATE, "generation": {"max_num_seqs": 2, "max_model_len": 32, **generation}})


def test_tp_not_dividing_the_heads_is_refused_before_anything_compiles():
    compiled = compile_count()
    config = parse_config({**GENERATE, "cores_per_replica": 3, "generation": {"tensor_parallel_size": 3}})
    with pytest.raises(ConfigError) as err:
        build_engine(config, ROOT / "tests")
    assert str(err.value) == ("generation.tensor_parallel_size: 3 does not divide the model's 4 attention heads "
                              "(num_attention_heads); choose a tensor_parallel_size that divides 4.")
    assert compile_count() == compiled


def test_tp_past_the_replicas_cores_and_tp_0_are_refused_by_field():
    with pytest.raises(ConfigError) as err:
        parse_config({**GENERATE, "generation": {"tensor_parallel_size": 2}})
    assert str(err.value) == ("model.yaml: invalid model.yaml\n  generation.tensor_parallel_size: 2 cores per engine "
                              "do not divide the replica's 1 (cores_per_replica); set cores_per_replica to a multiple "
                              "of 2 (each group of 2 cores runs one engine)")
    with pytest.raises(ConfigError) as err:
        parse_config({**GENERATE, "generation": {"tensor_parallel_size": 0}})
    assert "generation.tensor_parallel_size" in str(err.value) and "greater than or equal to 1" in str(err.value)


def test_an_architecture_without_a_tp_plan_is_refused():
    with pytest.raises(ConfigError, match=r"^generation.tensor_parallel_size: 2 needs the model's tensor-parallel "
                                          r"plan, and gpt2's config has no base_model_tp_plan; serve it with "
                                          r"tensor_parallel_size 1"):
        tensor_parallel.check(gm.build("gpt2").config, 2)


def test_a_model_past_one_cores_budget_is_refused_at_tp1_naming_tp_and_fits_at_tp2(monkeypatch):
    lm = gm.build("llama")
    buckets = GenerationBuckets.build(4, 48, prefill=[48], decode_rows=[4], decode_context=[48])
    monkeypatch.setenv(CORE_MEMORY_ENV, str(int(weight_bytes(lm) * 0.75)))
    with pytest.raises(ConfigError, match=r"or split the model over 2 cores with generation.tensor_parallel_size: 2\.$"):
        check_cache_fits(lm, buckets)
    # slots x positions x keys and values x layers x key/value heads x head_dim x float32, half on each core
    assert check_cache_fits(lm, buckets, tensor_parallel_size=2) == 4 * 48 * 2 * 2 * 2 * 16 * 4 // 2
