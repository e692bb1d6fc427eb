"""Checkpoints quantized by llm-compressor, as its users write them: a tiny Llama (make_tiny_llm.py) with fp8
weights per channel (FP8_DYNAMIC), and with fp8 weights per tensor and KV cache scales (FP8).

llm-compressor runs in .venv-llmcompressor (its pins clash with .venv's: tests/quantized/); ``make test`` installs
it, and run alone pytest makes it here, one test process at a time (a lock), as the checkpoints.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-llmcompressor"
MAKER = ROOT / "tests" / "quantized" / "make_checkpoint.py"


def checkpoint(folder: Path, scheme: str) -> Path:
    """``folder``/``scheme``: the tiny Llama quantized with llm-compressor's preset ``scheme`` (made once)."""
    out = folder / scheme
    if (out / "config.json").is_file():
        return out
    with open(ROOT / ".llmcompressor.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (VENV / ".installed").is_file():
            subprocess.run(["make", str(VENV.relative_to(ROOT) / ".installed")], cwd=ROOT, check=True, timeout=1800)
        base = folder / "base"
        if not (base / "config.json").is_file():
            subprocess.run([sys.executable, str(ROOT / "deployments" / "example_models" / "make_tiny_llm.py"),
                            str(base)], check=True, capture_output=True, timeout=600)
        if not (out / "config.json").is_file():
            made = subprocess.run([str(VENV / "bin" / "python"), str(MAKER), str(base), str(out), scheme],
                                  capture_output=True, text=True, timeout=900)
            assert made.returncode == 0, made.stderr[-4000:]
    return out
