"""Run in fresh processes (CPU_NUM_DEVICES=2) by tests/unit/generation/test_compile_beside_serving.py, three deploys
in a row against one compile cache (NEURON_SERVE_CACHE_DIR, the caller's), each printing one JSON object:

- ``lora``: an LLM with two LoRA adapters on two cores (``--tensor-parallel-size 2``: one group of two), started on
  its first models while the rest compile in the background, and sent meanwhile what its clients send: adapter and
  base rows, seeded sampled and greedy, prompt logprobs (a model compiled on demand), an adapter loaded at runtime.
  Every answer against its PEFT model's; the compile counts once the background compile ends.
- ``embedder``: a sentence-transformers embedder with its default buckets, each bucket's output against eager.
- ``llm``: the LLM again with other buckets and no LoRA, every model compiled, greedy answers against eager.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import generation_models as gm
from neuron_serve.config.schema import parse_config
from neuron_serve.generation import SamplingParams
from neuron_serve.targets import xla_state

ADAPTERS = {"attention": {"r": 4, "lora_alpha": 8, "target_modules": gm.ATTENTION},
            "mlp": {"r": 8, "lora_alpha": 16, "target_modules": gm.MLP},
            "qv": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}}


def _want(model, prompt, params, tokens=8):
    if params.temperature > 0:
        return gm.eager_sampled(model, prompt, tokens, params)
    return gm.eager_greedy(model, prompt, tokens)


def lora(tensor_parallel_size: int) -> dict:
    from neuron_serve.generation.compiling.build import build_engine  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        lm, peft = gm.base_and_adapters(root, ADAPTERS)
        config = parse_config({
            "name": "lora", "task": "generate", "model": {"pretrained": "llama"}, "cores_per_replica": 2,
            "background_compile": True,
            "generation": {"max_num_seqs": 4, "max_model_len": 48, "prefill_buckets": [16, 48],
                           "decode_batch_buckets": [1, 4], "decode_context_buckets": [24, 48],
                           "tensor_parallel_size": tensor_parallel_size,
                           "lora": {"max_loras": 2, "max_lora_rank": 8, "allow_runtime_updates": True,
                                    "lora_modules": {"attention": "attention", "mlp": "mlp"}}}})
        front = build_engine(config, root, background=True)
        build = front.engines.build
        generator = torch.Generator().manual_seed(5)
        prompts = [torch.randint(0, gm.VOCAB, (n,), generator=generator).tolist() for n in (3, 9, 14, 5, 20, 7)]
        names = ["attention", None, "mlp", "attention", None, "mlp"]
        params = [SamplingParams(max_tokens=8, temperature=0) if i % 2 == 0 else
                  SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=i) for i in range(len(names))]
        equal, scored, rounds = [], [], 0
        started = time.perf_counter()
        try:
            # Traffic for as long as the background compile runs (and at least two rounds).
            while rounds < 2 or not build.finished.is_set():
                done = front.generate_batch(prompts, params, adapters=names, timeout=300)
                equal += [d.tokens == _want(lm if n is None else peft[n], q, p)
                          for d, n, q, p in zip(done, names, prompts, params)]
                if rounds == 0:  # prompt logprobs: their prefill compiles on demand, ahead of the background
                    row = front.generate_batch([prompts[2]], SamplingParams(max_tokens=1, temperature=0,
                                                                            prompt_logprobs=0), timeout=300)[0]
                    with torch.no_grad():
                        want = torch.log_softmax(lm(torch.tensor([prompts[2]])).logits[0].float(), -1)
                    got = [lp[0] for lp in row.prompt_logprobs[1:]]
                    scored.append(max(abs(g - float(want[i, prompts[2][i + 1]])) for i, g in enumerate(got)) < 1e-4)
                if rounds == 1:  # an adapter loaded at runtime, while compiles go on
                    front.engines.load_adapter("qv", str(root / "qv"))
                    late = SamplingParams(max_tokens=8, temperature=0.7, seed=41)
                    got = front.generate_batch(prompts[:2], late, adapters="qv", timeout=300)
                    equal += [d.tokens == _want(peft["qv"], q, late) for d, q in zip(got, prompts[:2])]
                rounds += 1
            seconds = time.perf_counter() - started
            build.wait(600)
            counts = build.compiles.counts()
            failures = build.compiles.failures()
            waits = xla_state.waits()
            after = time.perf_counter()  # the same traffic once every model is compiled, for the figures
            for _ in range(2):
                front.generate_batch(prompts, params, adapters=names, timeout=300)
            after = (time.perf_counter() - after) / 2
        finally:
            front.close()
    return {"equal": equal, "scored": scored, "rounds": rounds, "compiled": counts.compiled, "failed": counts.failed,
            "planned": len(build.order), "failures": failures,
            "seconds_per_round": seconds / rounds, "seconds_per_round_after": after, "lock_waits": waits}


def embedder() -> dict:
    import pooling_models  # noqa: PLC0415

    from neuron_serve.pooling import source  # noqa: PLC0415
    from neuron_serve.pooling.build import build, example_inputs  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as folder:
        directory = pooling_models.bert_embedder(Path(folder) / "embedder")
        config = parse_config({"name": "embedder", "task": "embed", "model": {"pretrained": str(directory)}})
        compiled, spec, _ = build(config)
        graph, _, _ = source.load(config, None)
        worst = 0.0
        for length in spec.length_buckets:
            inputs = tuple(t[:, :length] for t in example_inputs(spec, 3))
            with torch.no_grad():
                worst = max(worst, float((compiled(*inputs) - graph(*inputs)).abs().max()))
    return {"lengths": list(spec.length_buckets), "max_abs_error": worst}


def llm() -> dict:
    from neuron_serve.buckets.generation import GenerationBuckets  # noqa: PLC0415
    from neuron_serve.generation.compiling.compile import GenerationBuild  # noqa: PLC0415
    from neuron_serve.generation.frontend.processor import Frontend  # noqa: PLC0415
    from neuron_serve.generation.core.group import EngineGroup  # noqa: PLC0415

    lm = gm.build("llama")
    buckets = GenerationBuckets.build(4, 64, prefill=[32, 64], decode_rows=[2, 4], decode_context=[64])
    build = GenerationBuild(lm, buckets, name="llm")
    group = EngineGroup.on_cores(build.start(background=False), 2)
    front = Frontend(group, group.info)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, gm.VOCAB, (n,), generator=generator).tolist() for n in (4, 30, 50, 12)]
    try:
        done = front.generate_batch(prompts, SamplingParams(max_tokens=8, temperature=0), timeout=300)
    finally:
        front.close()
    counts = build.compiles.counts()
    return {"equal": [d.tokens == gm.eager_greedy(lm, p, 8) for d, p in zip(done, prompts)],
            "compiled": counts.compiled, "failed": counts.failed, "planned": len(build.order)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("deploy", choices=["lora", "embedder", "llm"])
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    result = (lora(args.tensor_parallel_size) if args.deploy == "lora" else embedder() if args.deploy == "embedder"
              else llm())
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
