"""Run in a fresh process (CPU_NUM_DEVICES=2) by tests/unit/generation/test_generation_engine.py: an engine per core.

Compiles a tiny Llama once, copies it onto core 1, runs eight greedy prompts at once on
the group and prints one JSON object: whether every answer equals transformers' greedy
generation, how many requests each core's engine served, and which engine each of three
requests went to once core 0 holds three long ones, and whether prompt logprobs asked of both engines at
once equal transformers' log-softmax; then, with the prefill buckets switched on both engines, whether greedy
and sampled answers do. Then LoRA on the two engines: seeded sampled and greedy requests of
mixed lengths over two adapters and the base (sampled on the core), and an adapter loaded on the group
afterwards, each answer against its PEFT model's.
"""

import json
import tempfile
import threading
from pathlib import Path

import torch

import generation_models as gm
from neuron_serve.buckets.generation import GenerationBuckets
from neuron_serve.generation import SamplingParams
from neuron_serve.generation.compiling.compile import compile_generation
from neuron_serve.generation.frontend.processor import Frontend
from neuron_serve.generation.core.group import EngineGroup
from neuron_serve.generation.frontend.protocol import EngineRequest


def main() -> None:
    lm = gm.build("llama")
    buckets = GenerationBuckets.build(4, 48, prefill=[16, 48], decode_rows=[1, 4], decode_context=[24, 48])
    group = EngineGroup.on_cores(compile_generation(lm, buckets), 2)
    frontend = Frontend(group, group.info)
    served = [0, 0]
    lock = threading.Lock()
    for index, engine in enumerate(group.engines):  # count what each engine admits
        schedule = engine.scheduler.schedule

        def counted(schedule=schedule, index=index):
            plan = schedule()
            with lock:
                served[index] += len(plan.admitted)
            return plan
        engine.scheduler.schedule = counted
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, gm.VOCAB, (n,), generator=generator).tolist() for n in (3, 9, 14, 5, 20, 7, 11, 2)]
    done = frontend.generate_batch(prompts, SamplingParams(max_tokens=10, temperature=0), timeout=300)
    equal = [d.tokens == gm.eager_greedy(lm, p, 10) for d, p in zip(done, prompts)]
    at_once = list(served)
    finished = threading.Semaphore(0)

    def sink(event):
        if event.finished:
            finished.release()

    long = SamplingParams(max_tokens=30, temperature=0)
    for i in range(3):
        group.engines[0].submit(EngineRequest(f"long-{i}", prompts[0], long), sink)
    routed = []
    for _ in range(3):
        rid = frontend.submit(prompts[1], long, sink)
        routed.append(group.engines.index(group._members[rid]))
    for _ in range(6):
        finished.acquire(timeout=300)
    # Prompt logprobs on both engines at once: the prefill keeping every position's logits compiles once, on
    # the compile queue, while both wait.
    scored = frontend.generate_batch(prompts[4:8], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                                     timeout=300)
    logprobs_equal = []
    for d, p in zip(scored, prompts[4:8]):
        with torch.no_grad():
            want = torch.log_softmax(lm(torch.tensor([p])).logits[0].float(), -1)
        got = [lp[0] for lp in d.prompt_logprobs[1:]]
        logprobs_equal.append(max(abs(g - float(want[i, p[i + 1]])) for i, g in enumerate(got)) < 1e-4)
    rebucketed = _rebucketed(lm, group, frontend, prompts)
    frontend.close()
    print(json.dumps({"equal": equal, "served": at_once, "routed": routed, "scored": logprobs_equal,
                      "devices": [str(e.executor.device) for e in group.engines], "rebucketed": rebucketed,
                      "lora": _lora(prompts)}))


def _rebucketed(lm, group, frontend, prompts: list[list[int]]) -> dict:
    """The group's prefill buckets switched while it serves (what prefill_buckets: auto does): [16, 48] -> [8, 48]
    (and 4 prompts of 8 a call, within max_model_len where 4 of 16 were not).
    Each engine's prefill models after it, and whether greedy and seeded sampled requests of mixed lengths spread
    over both engines then answer as transformers does."""
    compiled, kept = group.build.switch({"prefill": [8, 48]}, "rebucket check")
    params = [SamplingParams(max_tokens=8, temperature=0) if i % 2 else
              SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=i) for i in range(len(prompts))]
    done = frontend.generate_batch(prompts, params, timeout=300)
    equal = [d.tokens == (gm.eager_greedy(lm, q, 8) if p.temperature == 0 else gm.eager_sampled(lm, q, 8, p))
             for d, q, p in zip(done, prompts, params)]
    return {"compiled": compiled, "kept": kept, "equal": equal,
            "prefill": [[s.label for s in e.model.shapes if s.kind == "prefill"] for e in group.engines],
            "buckets": [e.model.buckets.prefill for e in group.engines]}


ADAPTERS = {"attention": {"r": 4, "lora_alpha": 8, "target_modules": gm.ATTENTION},
            "mlp": {"r": 8, "lora_alpha": 16, "target_modules": gm.MLP},
            "qv": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}}


def _lora(prompts: list[list[int]]) -> dict:
    """What clients send to a replica of two cores with adapters: every third request greedy, the others seeded
    and sampled (temperature with top-p, or top-k), over "attention", "mlp" and the base, spread over both
    engines; then "qv", loaded on the group, sampled. Whether each answer is its model's: PEFT's greedy tokens,
    or the tokens its PEFT model's own logits give under the compiled sampler's draws (eager_sampled)."""
    from neuron_serve.config.schema import parse_config  # noqa: PLC0415
    from neuron_serve.generation.compiling.build import build_engine  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        lm, peft = gm.base_and_adapters(root, ADAPTERS)
        config = parse_config({
            "name": "lora", "task": "generate", "model": {"pretrained": "llama"}, "cores_per_replica": 2,
            "generation": {"max_num_seqs": 4, "max_model_len": 48, "prefill_buckets": [48],
                           "decode_batch_buckets": [4], "decode_context_buckets": [48],
                           "lora": {"max_loras": 2, "max_lora_rank": 8,
                                    "lora_modules": {"attention": "attention", "mlp": "mlp"}}}})
        front = build_engine(config, root)
        names = ["attention", None, "mlp", "attention", "mlp", None, "attention", "mlp"]
        params = [SamplingParams(max_tokens=10, temperature=0) if i % 3 == 0 else
                  SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=i) if i % 3 == 1 else
                  SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=i) for i in range(len(names))]
        late = [SamplingParams(max_tokens=10, temperature=0.7, seed=99 + i) for i in range(4)]
        try:
            done = front.generate_batch(prompts, params, adapters=names, timeout=300)
            front.engines.load_adapter("qv", str(root / "qv"))
            loaded = front.generate_batch(prompts[:4], late, adapters="qv", timeout=300)
            written = [e.adapters.writes for e in front.engines.engines]
        finally:
            front.close()

        def want(model, prompt, p):
            return gm.eager_sampled(model, prompt, 10, p) if p.temperature > 0 else gm.eager_greedy(model, prompt, 10)

        equal = [d.tokens == want(lm if n is None else peft[n], q, p) for d, n, q, p in zip(done, names, prompts, params)]
        equal += [d.tokens == want(peft["qv"], q, p) for d, q, p in zip(loaded, prompts, late)]
    return {"equal": equal, "written": written}


if __name__ == "__main__":
    main()
