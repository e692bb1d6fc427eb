"""Quantize a causal LM directory with llm-compressor, as its users do, and save it compressed (run with
.venv-llmcompressor's python by tests/quantized_checkpoints.py).

    python make_checkpoint.py BASE OUT SCHEME

SCHEME is llm-compressor's preset: FP8_DYNAMIC (fp8 weights per channel, activations per token at run time) or FP8
(fp8 weights per tensor and static activation scales, calibrated), the latter with an fp8 KV cache scheme (a
k_scale and v_scale per layer, calibrated). Every linear layer but the LM head; calibrated on a few sentences.
"""

import sys

import datasets
import torch
import transformers
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier

TEXTS = ["The capital of France is Paris.", "make serve runs the example deployment on two emulated cores.",
         "def f(x):\n    return x + 1\n", "A request runs in the smallest compiled bucket that holds it."]
KV = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def main(base: str, out: str, scheme: str) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"],
                                  kv_cache_scheme=KV if scheme == "FP8" else None)
    oneshot(model=model, recipe=recipe, dataset=datasets.Dataset.from_dict(dict(tokenizer(TEXTS))),
            processor=tokenizer, num_calibration_samples=len(TEXTS), max_seq_length=32)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
