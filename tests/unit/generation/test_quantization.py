"""Weights in int8 or fp8, a model in bfloat16, a KV cache in fp8: each served model answers as its eager reference
(tests/precision_models.py: weights quantized and dequantized by hand, keys and values rounded through fp8 with
the same scales), with the generation features it combines with; what each holds on the core; the refusals."""

from __future__ import annotations

import pytest
import torch

import generation_models as gm
import precision_models as pm
from neuron_serve.buckets.generation import GenerationBuckets
from neuron_serve.config.schema import parse_config
from neuron_serve.errors import ConfigError
from neuron_serve.generation import SamplingParams, engine_for
from neuron_serve.generation.precision import kv_cache, dtypes as precision, quantization
from neuron_serve.generation.compiling.build import build_engine, check_cache_fits, weight_bytes
from neuron_serve.generation.compiling.loading import load_lm
from neuron_serve.partition.pipeline import CORE_MEMORY_ENV

from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]
FACTORY = {"factory": "generation_models:build", "kwargs": {"arch": "llama"}}
SHAPES = {"max_num_seqs": 4, "max_model_len": 48, "prefill_buckets": [48], "decode_batch_buckets": [4],
          "decode_context_buckets": [48]}
LOGPROB_TOLERANCE = 1e-4


def prompts(lengths=(3, 11, 20, 7), seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, gm.VOCAB, (n,), generator=generator).tolist() for n in lengths]


def config(dtype: str = "auto", **generation):
    return parse_config({"name": "q", "task": "generate", "model": FACTORY, "dtype": dtype,
                         "generation": {**SHAPES, **generation}})


def eager(model, prompt: list[int], new: int, cache=None) -> tuple[list[int], list[float]]:
    """``model``'s greedy tokens and their logprobs by transformers' generate (``cache``: its past_key_values)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             **({pm.cache_kwarg(model): cache} if cache is not None else {}))
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]


@pytest.fixture(scope="module")
def int8_fp8_cache():
    """int8 weights per channel and an fp8 KV cache, from a model.yaml, with prefix caching, decode_steps 2, n-gram
    speculation and sampling on the core: the engine, the model as loaded (its scales), and the reference with the
    same scales."""
    front = build_engine(config(quantization="int8", kv_cache_dtype="fp8", enable_prefix_caching=True,
                                decode_steps=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
                         TESTS)
    loaded = load_lm(config(quantization="int8", kv_cache_dtype="fp8"), TESTS)
    form = kv_cache.of(loaded)
    reference = pm.dequantized_copy(gm.build("llama"), "int8", per_channel=True)
    yield front, form, reference
    front.close()


def test_int8_weights_and_an_fp8_cache_answer_as_eager_with_the_same_rounding(int8_fp8_cache):
    front, form, reference = int8_fp8_cache
    assert form.source == "calibrated" and len(form.k_scales) == 2 and all(s > 0 for s in form.k_scales)
    done = front.generate_batch(prompts(), SamplingParams(max_tokens=8, temperature=0, logprobs=0), timeout=300)
    for completion, prompt in zip(done, prompts()):
        tokens, logprobs = eager(reference, prompt, 8, pm.Fp8RoundingCache(form.k_scales, form.v_scales,
                                                                            reference.config))
        assert completion.tokens == tokens
        assert completion.logprobs == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE)


def test_the_quantized_cache_keeps_answers_with_prefix_caching_speculation_multi_step_decode_and_core_sampling(
        int8_fp8_cache):
    front, form, reference = int8_fp8_cache
    shared = [5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9, 2]  # a prefix of a block and more
    greedy = SamplingParams(max_tokens=10, temperature=0)
    for _ in range(2):  # the second time from the prefix cache
        [again] = front.generate_batch([shared + [7]], greedy, timeout=300)
        assert again.tokens == pm.rounded_greedy(reference, shared + [7], 10, form.k_scales, form.v_scales)
    sampled = SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=11)
    [alone] = front.generate_batch([prompts()[1]], sampled, timeout=300)
    mixed = front.generate_batch(prompts()[:3], [greedy, sampled, SamplingParams(max_tokens=6, temperature=1, seed=2)],
                                 timeout=300)
    want = gm.eager_sampled(pm.RoundedModel(reference, form.k_scales, form.v_scales), prompts()[1], 9, sampled)
    assert alone.tokens == mixed[1].tokens == want


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_weights_quantized_at_start_answer_as_an_eager_model_with_the_same_weights(per_channel, tmp_path):
    """Every linear layer but the LM head in fp8, per tensor or per channel: the compiled model's logprobs within
    1e-4 of an eager model whose weights were rounded the same way (int8's: the fixture above)."""
    granularity = "per_channel_symmetric" if per_channel else "per_tensor_symmetric"
    lm = gm.build("llama")
    precision.prepare(lm, config(quantization="fp8", quantization_type=granularity).generation, dtype=torch.float32)
    reference = pm.dequantized_copy(gm.build("llama"), "fp8", per_channel)
    front = engine_for(lm, **SHAPES, on_device_sampling=False)
    try:
        done = front.generate_batch(prompts(), SamplingParams(max_tokens=6, temperature=0, logprobs=0), timeout=300)
        if not per_channel:  # neuron-serve build's artifact of it: the same answers, and it says what it holds
            loaded = _artifact_round_trip(front, tmp_path)
    finally:
        front.close()
    for completion, prompt in zip(done, prompts()):
        tokens, logprobs = eager(reference, prompt, 6)
        assert completion.tokens == tokens
        assert completion.logprobs == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE)
    if not per_channel:
        tokens, precision_said = loaded
        assert tokens == [d.tokens for d in done]
        assert (precision_said["quantization"], precision_said["quantization_type"]) == ("fp8", granularity)


def _artifact_round_trip(front, folder) -> tuple[list[list[int]], dict]:
    """The engine's model saved as neuron-serve build saves it and loaded again: its greedy tokens, its precision."""
    from neuron_serve.generation.compiling.artifact import load_generation, save_generation  # noqa: PLC0415
    from neuron_serve.generation.core.engine import Engine  # noqa: PLC0415
    from neuron_serve.generation.frontend.processor import Frontend  # noqa: PLC0415
    from neuron_serve.generation.core.group import describe  # noqa: PLC0415

    save_generation(front.engines.model, folder / "built", eos_token_ids=[])
    model, _, _ = load_generation(folder / "built")
    engine = Engine(model)
    loaded = Frontend(engine, describe([engine], 8))
    try:
        done = loaded.generate_batch(prompts(), SamplingParams(max_tokens=6, temperature=0), timeout=300)
    finally:
        loaded.close()
    return [d.tokens for d in done], model.precision


def test_int8_per_tensor_weights_are_the_hand_rounded_ones():
    lm = gm.build("llama")
    precision.prepare(lm, config(quantization="int8", quantization_type="per_tensor_symmetric").generation,
                      dtype=torch.float32)
    reference = pm.dequantized_copy(gm.build("llama"), "int8", per_channel=False)
    ours = dict(lm.named_modules())
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            assert ours[name].weight.dtype == torch.int8 and ours[name].weight_scale.numel() == 1
            assert torch.allclose(ours[name].dequantized(torch.float32), module.weight, rtol=0, atol=1e-7)


def test_a_bfloat16_model_answers_as_eager_bfloat16_with_float32_logits():
    """Weights, activations and cache in bfloat16 (half float32's bytes on the core); the logits leave in float32.
    Greedy tokens are eager bfloat16's, and every prompt position's logprob (prompt logprobs: the compiled
    prefill's) within 0.01 of eager bfloat16's: XLA:CPU keeps the elementwise steps between two products in float32
    where eager PyTorch rounds each to bfloat16, so the two differ by more than float32 runs do."""
    front = build_engine(config("bfloat16", on_device_sampling=False), TESTS)
    reference = gm.build("llama").to(torch.bfloat16)
    executor = front.engines.engines[0].executor
    try:
        assert executor.precision["dtype"] == "bfloat16"
        assert executor.model.state.tensors[0].dtype == torch.bfloat16  # the cache
        # Two bytes a parameter, and the rotary frequencies the compiled models read (8 floats), kept in float32 as
        # transformers keeps them: what the core holds, once for every compiled model
        parameters = sum(p.numel() for p in gm.build("llama").parameters())
        assert executor.memory()["weights"] == 2 * parameters + 8 * 4
        prompt = prompts((30,))[0]
        [scored] = front.generate_batch([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                                        timeout=300)
        done = front.generate_batch(prompts(), SamplingParams(max_tokens=6, temperature=0), timeout=300)
    finally:
        front.close()
    got = torch.tensor([lp[0] for lp in scored.prompt_logprobs[1:]])
    index, after = torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])
    with torch.no_grad():
        want = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), -1)[index, after]
    assert (got - want).abs().max() < 0.01
    assert [d.tokens for d in done] == [gm.eager_greedy(reference, p, 6) for p in prompts()]


def test_what_a_core_holds_shrinks_with_int8_weights_and_an_fp8_cache():
    lm = gm.build("llama")
    full = weight_bytes(lm)
    precision.prepare(lm, config(quantization="int8", kv_cache_dtype="fp8").generation, dtype=torch.float32)
    linear = sum(m.weight.numel() for m in quantization.quantized_layers(lm))
    channels = sum(m.weight_scale.numel() for m in quantization.quantized_layers(lm))
    # Each quantized weight: 4 bytes become 1, plus a float32 scale per output channel.
    assert weight_bytes(lm) == full - 3 * linear + 4 * channels
    buckets = GenerationBuckets.build(4, 48)
    cache = check_cache_fits(lm, buckets)
    assert cache == 2 * 2 * 4 * 48 * 2 * 16  # keys and values x layers x slots x positions x kv heads x head_dim, 1 byte


def test_a_model_too_big_for_a_core_in_float32_serves_in_int8(monkeypatch):
    budget = 350_000  # bytes: the float32 weights (427 kB) do not fit, int8 weights (210 kB) and the cache (98 kB) do
    monkeypatch.setenv(CORE_MEMORY_ENV, str(budget))
    with pytest.raises(ConfigError) as refused:
        check_cache_fits(load_lm(config(), TESTS), GenerationBuckets.build(4, 48))
    assert "more than the core's 350000 bytes" in str(refused.value)
    lm = load_lm(config(quantization="int8"), TESTS)
    assert check_cache_fits(lm, GenerationBuckets.build(4, 48)) > 0


def test_an_fp8_cache_holds_twice_the_slots_of_a_bfloat16_one():
    from neuron_serve.generation.compiling.build import slots_that_fit  # noqa: PLC0415

    buckets = GenerationBuckets.build(4, 48)
    half = load_lm(config("bfloat16"), TESTS)
    eighth = load_lm(config("bfloat16", kv_cache_dtype="fp8"), TESTS)
    core = 1 << 20
    assert slots_that_fit(eighth, buckets, core) == 2 * slots_that_fit(half, buckets, core) or \
        abs(slots_that_fit(eighth, buckets, core) - 2 * slots_that_fit(half, buckets, core)) <= 1


def test_refusals_name_the_field_and_the_fix():
    with pytest.raises(ConfigError) as unknown:
        config(quantization="int4")
    assert "generation.quantization: Input should be 'int8' or 'fp8' (use one of the values listed)" in \
        str(unknown.value)
    with pytest.raises(ConfigError) as alone:
        config(quantization_type="per_tensor_symmetric")
    assert ("generation.quantization_type: applies with quantization (int8 or fp8); set quantization or remove "
            "quantization_type") in str(alone.value)
    with pytest.raises(ConfigError) as scales:
        config(calculate_kv_scales=True)
    assert "generation.calculate_kv_scales: applies with kv_cache_dtype fp8" in str(scales.value)
    gpt2 = parse_config({"name": "g", "task": "generate", "generation": {**SHAPES, "quantization": "fp8"},
                         "model": {"factory": "generation_models:build", "kwargs": {"arch": "gpt2"}}})
    with pytest.raises(ConfigError) as conv:
        load_lm(gpt2, TESTS)
    assert str(conv.value) == ("generation.quantization: fp8 cannot quantize transformer.h.0.attn.c_attn, a "
                               "transformers Conv1D (GPT-2's projection layout), not a torch.nn.Linear; add "
                               "'c_attn' to generation.modules_to_not_convert, or serve the model without "
                               "quantization.")
    with pytest.raises(ConfigError) as none_left:
        load_lm(config(quantization="int8", modules_to_not_convert=["*"]), TESTS)
    assert "converts no layer of this model" in str(none_left.value)
    with pytest.raises(ConfigError) as no_scales:
        load_lm(config(kv_cache_dtype="fp8", calculate_kv_scales=False), TESTS)
    assert str(no_scales.value).startswith("generation.calculate_kv_scales: false, but the checkpoint has no k_scale")
    infer = {"name": "m", "model": {"factory": "m:f"}, "inputs": [{"name": "x", "shape": [1, 4]}], "dtype": "bfloat16"}
    with pytest.raises(ConfigError) as infer_dtype:
        parse_config(infer)
    assert "dtype: applies to task: generate, embed, score or classify" in str(infer_dtype.value)


def test_modules_to_not_convert_by_name_pattern_or_last_part():
    scheme = quantization.WeightQuantization("int8", modules_to_not_convert=("lm_head", "o_proj", "model.layers.1.*"))
    assert not scheme.converts("lm_head") and not scheme.converts("model.layers.0.self_attn.o_proj")
    assert not scheme.converts("model.layers.1.mlp.up_proj")
    assert scheme.converts("model.layers.0.mlp.up_proj")
    lm = gm.build("llama")
    precision.prepare(lm, config(quantization="fp8", modules_to_not_convert=["o_proj", "lm_head"]).generation,
                      dtype=torch.float32)
    kept = [n for n, m in lm.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(kept) == ["lm_head", "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]
    said = precision.describe(lm)
    assert said == {"dtype": "float32", "quantization": "fp8", "kv_cache_dtype": "auto",
                    "quantization_type": "per_channel_symmetric", "quantized_layers": 12,
                    "quantized_by": "neuron-serve"}


def test_fp8_weights_stay_within_a_neuron_cores_range_and_checkpoint_scales_are_rescaled():
    w = torch.randn(8, 16) * 3
    q, scale = quantization.quantize_weight(w, "fp8")
    assert q.dtype == torch.float8_e4m3fn and q.float().abs().max() <= 240
    assert (q.float() * scale - w).abs().max() <= 0.07 * w.abs().max()
    ocp = (w / (w.abs().amax(1, keepdim=True) / 448)).to(torch.float8_e4m3fn)  # quantized for OCP's 448
    fitted, rescaled, changed = quantization.fit_neuron_fp8(ocp, w.abs().amax(1, keepdim=True) / 448)
    assert changed and fitted.float().abs().max() <= 240
    assert (fitted.float() * rescaled - w).abs().max() <= 0.07 * w.abs().max()


def _dequantize_in_place(model: torch.nn.Module) -> torch.nn.Module:
    """PEFT's model with its base's linear layers (not the adapters', not the LM head) rounded to int8 per channel."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "lora_" not in name and not name.endswith("lm_head"):
            w = module.weight.data
            scale = w.abs().amax(1, keepdim=True) / 127
            module.weight.data = (w / scale).round().clamp(-127, 127) * scale
    return model


def test_lora_adapters_on_int8_weights_and_an_fp8_cache_answer_as_peft_on_the_same_weights(tmp_path):
    """Adapters stay in the compute dtype (float32) over the int8 base: each row of a batch mixing two adapters and
    the base answers as PEFT's model of its adapter over the rounded base, with the same fp8 rounding."""
    adapters = {"attention": {"r": 4, "lora_alpha": 8, "target_modules": gm.ATTENTION},
                "mlp": {"r": 8, "lora_alpha": 16, "target_modules": gm.MLP}}
    lm, peft = gm.base_and_adapters(tmp_path, adapters)
    generation = {**SHAPES, "on_device_sampling": False, "quantization": "int8", "kv_cache_dtype": "fp8",
                  "lora": {"max_loras": 2, "max_lora_rank": 8, "lora_modules": {n: n for n in adapters}}}
    settings = parse_config({"name": "q", "task": "generate", "model": {"pretrained": "llama"},
                             "generation": generation})
    front = build_engine(settings, tmp_path)
    names = ["attention", None, "mlp", "attention"]
    try:
        buffers = front.engines.engines[0].model.state.tensors[-1]
        done = front.generate_batch(prompts(), SamplingParams(max_tokens=6, temperature=0, logprobs=0),
                                    adapters=names, timeout=300)
    finally:
        front.close()
    assert buffers.dtype == torch.float32
    form = kv_cache.of(load_lm(settings.model_copy(update={"generation": settings.generation.model_copy(
        update={"lora": None})}), tmp_path))
    for completion, name, prompt in zip(done, names, prompts()):
        model = pm.dequantized_copy(lm, "int8") if name is None else _dequantize_in_place(peft[name])
        tokens, logprobs = eager(model, prompt, 6, pm.Fp8RoundingCache(form.k_scales, form.v_scales, lm.config))
        assert completion.tokens == tokens
        assert completion.logprobs == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE)
