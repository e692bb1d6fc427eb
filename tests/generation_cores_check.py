"""Run in a fresh process (CPU_NUM_DEVICES=2) by tests/unit/generation/test_generation_engine.py: an engine per core.

Compiles a tiny Llama once, copies it onto core 1, runs eight greedy prompts at once on
the group and prints one JSON object: whether every answer equals transformers' greedy
generation, how many requests each core's engine served, and which engine each of three
requests went to once core 0 holds three long ones, and whether prompt logprobs asked of both engines at
once equal transformers' log-softmax.
"""

import json
import threading

import torch

import generation_models as gm
from neuron_serve.buckets.generation import GenerationBuckets
from neuron_serve.generation import SamplingParams
from neuron_serve.generation.compiling import compile_generation
from neuron_serve.generation.frontend import Frontend
from neuron_serve.generation.group import EngineGroup
from neuron_serve.generation.protocol import EngineRequest


def main() -> None:
    lm = gm.build("llama")
    buckets = GenerationBuckets.build(4, 48, prefill=[16, 48], decode_rows=[1, 4], decode_context=[24, 48])
    group = EngineGroup.on_cores(compile_generation(lm, buckets), 2)
    frontend = Frontend(group, group.info)
    served = [0, 0]
    lock = threading.Lock()
    for index, engine in enumerate(group.engines):  # count what each engine admits
        admit = engine.scheduler.admit

        def counted(*startable, admit=admit, index=index):
            admitted = admit(*startable)
            with lock:
                served[index] += len(admitted)
            return admitted
        engine.scheduler.admit = counted
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
    frontend.close()
    print(json.dumps({"equal": equal, "served": at_once, "routed": routed, "scored": logprobs_equal,
                      "devices": [str(e.executor.device) for e in group.engines]}))


if __name__ == "__main__":
    main()
