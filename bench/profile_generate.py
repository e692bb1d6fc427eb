"""Where SmolLM2-135M-Instruct's time goes in the engine, in process: compiled calls against eager transformers.

    python -m bench.profile_generate     # about 8 minutes: six SmolLM2 models compile first (make llm-example)

One engine (``engine_for``: prefill buckets 64, 128, 256, 512; decode rows 1 and 8; contexts 128 and 512), no
HTTP, no engine process: a prompt's one-token generate (its padded prefill, the cache write, the sampling) at
50, 100, 200 and 400 tokens against transformers' forward of the same ids, and the decode time per token of one
stream (33 tokens less 1, over 32) against transformers' ``generate`` of the same; then one decode step of 8
streams. Medians of 5 runs after one warm-up. It tells the compiled calls' cost apart from the serving path's
and from the padding of the buckets a deployment compiles (docs/guides/benchmarks.md, Generation over HTTP).
"""
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import torch  # noqa: E402
import transformers  # noqa: E402

import real_models  # noqa: E402
from neuron_serve.generation import engine_for  # noqa: E402
from neuron_serve.generation.frontend.protocol import SamplingParams  # noqa: E402

def main() -> None:
    folder = real_models.smollm2()
    lm = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    engine = engine_for(lm, max_num_seqs=8, max_model_len=512, prefill_buckets=[64, 128, 256, 512],
                        decode_batch_buckets=[1, 8], decode_context_buckets=[128, 512], name="profile")
    print(f"built in {time.perf_counter() - t0:.0f} s", flush=True)
    g = torch.Generator().manual_seed(1)
    def med(f, runs=5):
        xs = []
        for _ in range(runs + 1):
            s = time.perf_counter(); f(); xs.append(time.perf_counter() - s)
        return statistics.median(xs[1:])
    with torch.inference_mode():
        for n in (50, 100, 200, 400):
            ids = torch.randint(1, 49000, (1, n), generator=g)
            one = med(lambda: engine.generate_batch([ids[0].tolist()], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)))
            eager = med(lambda: lm(ids))
            print(f"prefill {n:4d}: engine {one*1e3:7.1f} ms  eager forward {eager*1e3:7.1f} ms  ratio {one/eager:.2f}", flush=True)
        for n in (50, 200):
            ids = torch.randint(1, 49000, (1, n), generator=g)
            one = med(lambda: engine.generate_batch([ids[0].tolist()], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)))
            many = med(lambda: engine.generate_batch([ids[0].tolist()], SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)))
            e1 = med(lambda: lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, min_new_tokens=1))
            e33 = med(lambda: lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=33, do_sample=False, min_new_tokens=33))
            print(f"decode after {n:4d}: engine {(many-one)/32*1e3:6.1f} ms/token  eager generate {(e33-e1)/32*1e3:6.1f} ms/token", flush=True)
        for rows in (8,):
            prompts = [torch.randint(1, 49000, (100,), generator=g).tolist() for _ in range(rows)]
            one = med(lambda: engine.generate_batch(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)))
            many = med(lambda: engine.generate_batch(prompts, SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)))
            print(f"decode 8 rows after 100: engine {(many-one)/32*1e3:6.1f} ms/step", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
