"""Checkpoints llm-compressor quantized (tests/quantized_checkpoints.py): their fp8 layers loaded as they are stored
(not quantized again; a weight past a NeuronCore's fp8 range rescaled into it), their KV cache scales used, and the
served model's answers those of an eager model with the same weights and the same rounding of keys and values."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file

import precision_models as pm
import quantized_checkpoints
from neuron_serve.config.schema import parse_config
from neuron_serve.errors import ConfigError
from neuron_serve.generation import SamplingParams
from neuron_serve.generation.precision import kv_cache, dtypes as precision
from neuron_serve.generation.compiling.build import build_engine
from neuron_serve.generation.compiling.loading import load_lm
from neuron_serve.generation.precision.quantization import QuantizedLinear

SHAPES = {"max_num_seqs": 4, "max_model_len": 64, "prefill_buckets": [64], "decode_batch_buckets": [4],
          "decode_context_buckets": [64], "on_device_sampling": False}
PROMPTS = ["The capital of France is", "Buckets are", "make serve runs"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llmcompressor")
    return {scheme: quantized_checkpoints.checkpoint(folder, scheme) for scheme in ("FP8_DYNAMIC", "FP8")}


def _config(directory, **generation):
    return parse_config({"name": "ckpt", "task": "generate", "model": {"pretrained": str(directory)},
                         "generation": {**SHAPES, **generation}})


def _stored(directory) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def test_fp8_layers_are_loaded_as_stored_and_rescaled_into_a_neuron_cores_range(checkpoints, caplog):
    directory = checkpoints["FP8_DYNAMIC"]
    stored = _stored(directory)
    with caplog.at_level(logging.INFO, logger="neuron_serve"):
        lm = load_lm(_config(directory))
    said = precision.describe(lm)
    assert said == {"dtype": "float32", "quantization": "fp8", "kv_cache_dtype": "auto",
                    "quantization_type": "per_channel_symmetric", "quantized_layers": 14,
                    "quantized_by": "compressed-tensors"}
    layers = {n: m for n, m in lm.named_modules() if isinstance(m, QuantizedLinear)}
    rescaled = 0
    for name, layer in layers.items():
        weight, scale = stored[f"{name}.weight"].float(), stored[f"{name}.weight_scale"].float().reshape(-1, 1)
        # llm-compressor maps each channel's largest weight to 448 (OCP's e4m3fn); a channel past 240 is brought
        # into a NeuronCore's range: its stored values times 240 / its largest, rounded to fp8 again, its scale times
        # the inverse. A channel within 240 would be kept byte for byte.
        largest = weight.abs().amax(1, keepdim=True)
        factor = torch.where(largest > 240, largest / 240, torch.ones_like(largest))
        assert layer.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(layer.weight.float(), (weight / factor).to(torch.float8_e4m3fn).float())
        assert torch.allclose(layer.weight_scale, scale * factor, rtol=1e-6, atol=0)
        # The same weights within fp8's rounding: half a step of the top binade (8 in 128..256), 1/30 of 240.
        error = (layer.dequantized(torch.float32) - weight * scale).abs().amax(1)
        assert (error <= (weight * scale).abs().amax(1) / 30).all()
        rescaled += int(bool((largest > 240).any()))
    assert rescaled == 14
    assert f"14 linear layers loaded in fp8 (compressed-tensors, per channel symmetric) as the checkpoint holds " \
           f"them; {rescaled} rescaled into a NeuronCore's fp8 range (+-240)" in caplog.text
    assert "the checkpoint also quantizes activations; neuron-serve serves its weights only" in caplog.text
    assert isinstance(lm.lm_head, torch.nn.Linear)  # llm-compressor's ignore list


def test_a_checkpoint_with_kv_scales_serves_as_eager_with_its_weights_and_its_scales(checkpoints):
    """FP8 (weights per tensor, a k_scale and v_scale per layer): greedy tokens and logprobs (1e-4) of an eager Llama
    whose linear weights are the served ones and whose cache rounds through fp8 with the checkpoint's scales, taken
    from llm-compressor's 448 range to a NeuronCore's 240."""
    directory = checkpoints["FP8"]
    stored = _stored(directory)
    front = build_engine(_config(directory, kv_cache_dtype="fp8"))
    try:
        model = front.engines.engines[0].executor.model
        assert model.precision["kv_cache_scales"] == "checkpoint"
        assert model.precision["quantization_type"] == "per_tensor_symmetric"
        tokenizer = front.tokenizer
        ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
        done = front.generate_batch(ids, SamplingParams(max_tokens=8, temperature=0, logprobs=0), timeout=300)
    finally:
        front.close()
    loaded = load_lm(_config(directory, kv_cache_dtype="fp8"))
    form = kv_cache.of(loaded)
    for layer in range(2):
        assert form.k_scales[layer] == pytest.approx(float(stored[f"model.layers.{layer}.self_attn.k_scale"]) * 448 / 240)
        assert form.v_scales[layer] == pytest.approx(float(stored[f"model.layers.{layer}.self_attn.v_scale"]) * 448 / 240)
    # The base llm-compressor quantized: its other tensors (embeddings, norms, the LM head) are the checkpoint's.
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory.parent / "base",
                                                                  attn_implementation="eager").eval()
    for name, module in loaded.named_modules():
        if isinstance(module, QuantizedLinear):
            reference.get_submodule(name).weight.data = module.dequantized(torch.float32)
    for completion, prompt in zip(done, ids):
        cache = pm.Fp8RoundingCache(form.k_scales, form.v_scales, reference.config)
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True, **{pm.cache_kwarg(reference): cache})
        tokens = out.sequences[0, len(prompt):].tolist()
        # The model's own logits (its EOS is held back by min_new_tokens in the scores, not in these).
        logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]
        assert completion.tokens == tokens
        assert completion.logprobs == pytest.approx(logprobs, abs=1e-4)


def test_a_quantization_the_checkpoint_does_not_hold_is_refused(checkpoints):
    directory = checkpoints["FP8_DYNAMIC"]
    with pytest.raises(ConfigError) as other:
        load_lm(_config(directory, quantization="int8"))
    assert str(other.value) == ("generation.quantization: int8, but the checkpoint is quantized to fp8 already "
                                "(compressed-tensors, its config.json's quantization_config); remove "
                                "generation.quantization to serve it as it is, or serve a full-precision checkpoint "
                                "to quantize it to int8.")
    with pytest.raises(ConfigError) as granularity:
        load_lm(_config(directory, quantization="fp8", quantization_type="per_tensor_symmetric"))
    assert str(granularity.value).startswith("generation.quantization_type: per_tensor_symmetric, but the "
                                             "checkpoint's fp8 weights are per_channel_symmetric")
    assert precision.describe(load_lm(_config(directory, quantization="fp8")))["quantized_by"] == "compressed-tensors"
