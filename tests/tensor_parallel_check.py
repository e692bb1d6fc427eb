"""Run in a fresh process by tests/unit/generation/test_tensor_parallel.py: engines at tensor_parallel_size 2.

SPMD is a mode of the whole process, so the check runs apart from the test session: this
process's XLA runtime is two emulated cores, and each engine spans both. For Llama, Qwen2
with one key/value head (fewer than the cores: kept whole on each), Mistral and Qwen3 it
prints whether greedy generation equals transformers' with sequences joining and leaving
(five prompts, four slots, slot moves), with decode_steps 2 for Llama; then a seeded
sampled request's tokens, the split of the weights and each core's bytes, and whether
Llama saved as an artifact and loaded again answers the same; with two LoRA adapters, whether each row
of a mixed batch answers as PEFT's model; with int8 weights and an fp8 cache, whether it answers as its eager
reference; with chunked prefill, whether it answers as transformers; as one JSON object.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch_xla

import generation_models as gm
from neuron_serve.generation import SamplingParams, engine_for
from neuron_serve.generation.compiling.artifact import load_generation, save_generation
from neuron_serve.generation.core.engine import Engine
from neuron_serve.generation.frontend.processor import Frontend
from neuron_serve.generation.core.group import describe

SHAPES = {"max_num_seqs": 4, "max_model_len": 48, "prefill_buckets": [16, 48], "decode_batch_buckets": [1, 4],
          "decode_context_buckets": [48]}
# The other architectures' split is what is checked: one model of each kind (prompts padded, rows in one call).
ONE_BUCKET = {"max_num_seqs": 4, "max_model_len": 48, "prefill_buckets": [48], "decode_batch_buckets": [4],
              "decode_context_buckets": [48]}
PROMPT_LENGTHS = (3, 11, 20, 7, 30)
NEW_TOKENS = (12, 5, 14, 9, 15)
MODELS = {"llama": {}, "qwen2": {"num_key_value_heads": 1}, "mistral": {}, "qwen3": {}}


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, gm.VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _artifact_round_trip(engine, want: list[list[int]]) -> list[bool]:
    """Save the split model as ``neuron-serve build`` does, load it over the same two cores, generate again."""
    with tempfile.TemporaryDirectory() as folder:
        save_generation(engine.engines.model, Path(folder) / "built", eos_token_ids=[])
        model, _, _ = load_generation(Path(folder) / "built")
    engine = Engine(model)
    loaded = Frontend(engine, describe([engine], 8))
    try:
        assert engine.model.tensor_parallel_size == 2
        done = loaded.generate_batch(prompts(), [SamplingParams(max_tokens=n, temperature=0) for n in NEW_TOKENS],
                                     timeout=300)
    finally:
        loaded.close()
    return [d.tokens == w for d, w in zip(done, want)]


def main(sampled_params: dict) -> None:
    result = {"equal": {}, "split": {}, "memory": {}}
    for arch, overrides in MODELS.items():
        lm = gm.build(arch, **overrides)
        # Llama also samples (on the core); the others generate greedily, so compile no sampled forms.
        engine = engine_for(lm, **(SHAPES if arch == "llama" else ONE_BUCKET), tensor_parallel_size=2, decode_steps=2 if arch == "llama" else 1,
                            on_device_sampling=arch == "llama")
        try:
            done = engine.generate_batch(prompts(), [SamplingParams(max_tokens=n, temperature=0) for n in NEW_TOKENS],
                                         timeout=300)
            want = [gm.eager_greedy(lm, p, n) for p, n in zip(prompts(), NEW_TOKENS)]
            result["equal"][arch] = [d.tokens == w for d, w in zip(done, want)]
            result["split"][arch] = engine.engines.model.sharding.describe()
            result["memory"][arch] = engine.engines.executor.memory()
            if arch == "llama":
                # A seeded sample alone, and in a batch beside greedy and other sampled rows.
                params = SamplingParams(**sampled_params)
                [sampled] = engine.generate_batch([prompts()[1]], params, timeout=300)
                result["sampled"] = sampled.tokens
                mixed = engine.generate_batch(prompts()[:3], [SamplingParams(max_tokens=9, temperature=0), params,
                                                              SamplingParams(max_tokens=12, temperature=1.0, seed=2)],
                                              timeout=300)
                result["sampled_mixed"] = mixed[1].tokens
                result["cache_split"] = torch_xla._XLAC._get_xla_sharding_spec(engine.engines.model.compiled.states[0])
                result["artifact_equal"] = _artifact_round_trip(engine, want)
        finally:
            engine.close()
    result["cached_speculative_equal"] = _cached_and_speculative()
    result["lora"] = _lora()
    result["quantized"] = _quantized()
    result["chunked"] = _chunked()
    print(json.dumps(result))


LORA_ADAPTERS = {"attention": {"r": 4, "lora_alpha": 8, "target_modules": gm.ATTENTION},
                 "mlp": {"r": 8, "lora_alpha": 16, "target_modules": gm.MLP},
                 "qv": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]},
                 "wide": {"r": 16, "lora_alpha": 8, "target_modules": ["o_proj", "up_proj", "down_proj"]}}


def _lora() -> dict:
    """Llama at TP 2 with four LoRA adapters of ranks 2 to 16 (model.yaml's lora_modules) on two buffer slots:
    rows of each and of the base in one batch (an adapter waits for a slot), each answer's tokens and logprobs
    against PEFT's model with that adapter; the buffers' bytes a core."""
    from neuron_serve.config.schema import parse_config  # noqa: PLC0415
    from neuron_serve.generation.compiling.build import build_engine  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        lm, peft = gm.base_and_adapters(root, LORA_ADAPTERS)
        config = parse_config({"name": "lora", "task": "generate", "model": {"pretrained": "llama"},
                               "cores_per_replica": 2,
                               "generation": {**ONE_BUCKET, "tensor_parallel_size": 2, "on_device_sampling": False,
                                              "lora": {"max_loras": 2, "max_lora_rank": 16,
                                                       "lora_modules": {n: n for n in LORA_ADAPTERS}}}})
        engine = build_engine(config, root, cores=2)
        names = ["attention", None, "mlp", "qv", "wide"]
        try:
            done = engine.generate_batch(prompts(), SamplingParams(max_tokens=8, temperature=0, logprobs=0),
                                         adapters=names, timeout=300)
            memory = engine.engines.engines[0].executor.memory()
        finally:
            engine.close()
        equal, worst = [], 0.0
        for d, name, prompt in zip(done, names, prompts()):
            model = lm if name is None else peft[name]
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                     min_new_tokens=8, do_sample=False, output_scores=True,
                                     return_dict_in_generate=True, pad_token_id=0)
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
            equal.append(d.tokens == tokens)
            worst = max([worst, *(abs(a - b) for a, b in zip(d.logprobs, logprobs))])
    return {"equal": equal, "worst_logprob_error": worst, "bytes_per_core": memory.get("lora")}


def _quantized() -> dict:
    """Llama at TP 2 with int8 weights per channel and an fp8 KV cache: greedy output against an eager model with
    the same weights and the same rounding of keys and values; how its weights' scales are split."""
    import precision_models as pm  # noqa: PLC0415
    from neuron_serve.config.generation import GenerationSettings  # noqa: PLC0415
    from neuron_serve.generation.precision import kv_cache, dtypes as precision  # noqa: PLC0415

    lm = gm.build("llama")
    precision.prepare(lm, GenerationSettings(quantization="int8", kv_cache_dtype="fp8"), dtype=torch.float32)
    form = kv_cache.of(lm)
    reference = pm.dequantized_copy(gm.build("llama"), "int8")
    engine = engine_for(lm, **ONE_BUCKET, tensor_parallel_size=2, on_device_sampling=False)
    try:
        done = engine.generate_batch(prompts(), [SamplingParams(max_tokens=n, temperature=0) for n in NEW_TOKENS],
                                     timeout=300)
        split = engine.engines.model.sharding.describe()["weights"]
        memory = engine.engines.executor.memory()
    finally:
        engine.close()
    want = [pm.rounded_greedy(reference, p, n, form.k_scales, form.v_scales) for p, n in zip(prompts(), NEW_TOKENS)]
    return {"equal": [d.tokens == w for d, w in zip(done, want)], "memory": memory,
            "split": {k: v for k, v in split.items() if "layers.0." in k}}


def _chunked() -> dict:
    """Llama at TP 2 with chunked prefill: the five prompts (3 to 30 tokens) in chunks of up to 8 beside the rows
    decoding, greedy output against transformers'; the steps that carried a chunk."""
    lm = gm.build("llama")
    engine = engine_for(lm, **ONE_BUCKET, tensor_parallel_size=2, on_device_sampling=False,
                        enable_chunked_prefill=True, prefill_chunk_buckets=[8], max_num_batched_tokens=12)
    try:
        done = engine.generate_batch(prompts(), [SamplingParams(max_tokens=n, temperature=0) for n in NEW_TOKENS],
                                     timeout=300)
        chunks = sum(1 for _, _, chunk in engine.engines.step_log if chunk)
    finally:
        engine.close()
    want = [gm.eager_greedy(lm, p, n) for p, n in zip(prompts(), NEW_TOKENS)]
    return {"equal": [d.tokens == w for d, w in zip(done, want)], "chunked_steps": chunks}


def _cached_and_speculative() -> list[bool]:
    """Llama at TP 2 with prefix caching and n-gram speculation: prompts sharing a repetitive prefix, each run
    twice (the second from the cache), greedy output compared with transformers'."""
    lm = gm.build("llama")
    engine = engine_for(lm, **SHAPES, tensor_parallel_size=2, enable_prefix_caching=True,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 2}, on_device_sampling=False)
    prefix = [5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9]
    shared = [prefix + [3, 7], prefix + [21], prefix + [3, 7, 30, 2]]
    equal = []
    try:
        for _ in range(2):
            done = engine.generate_batch(shared, [SamplingParams(max_tokens=16, temperature=0)] * 3, timeout=300)
            equal += [d.tokens == gm.eager_greedy(lm, p, 16) for d, p in zip(done, shared)]
    finally:
        engine.close()
    return equal


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
