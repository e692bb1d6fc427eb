"""The examples' real models, made as `make llm-example` and `make embed-example` make them, once per checkout.

``make test`` makes both before pytest starts; run alone, pytest makes what is missing here, one test process at
a time (a lock beside the directories), so two workers never write the same one.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENTS = ROOT / "deployments"
MAKERS = DEPLOYMENTS / "example_models"


def _made(marker: Path, command: list[str]) -> None:
    if marker.is_file():
        return
    with open(DEPLOYMENTS / ".examples.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.is_file():
            subprocess.run([sys.executable, *command], check=True, cwd=ROOT, timeout=900)


def smollm2() -> Path:
    """deployments/llm/: SmolLM2-135M-Instruct as a transformers directory (model, tokenizer, chat template)."""
    _made(DEPLOYMENTS / "llm" / "config.json", [str(MAKERS / "make_llm.py"), str(DEPLOYMENTS / "llm")])
    return DEPLOYMENTS / "llm"


def all_minilm_l6_v2() -> Path:
    """deployments/embedder/: all-MiniLM-L6-v2 as a sentence-transformers directory (and deployments/reranker/)."""
    _made(DEPLOYMENTS / "embedder" / "modules.json", [str(MAKERS / "make_embedders.py"), str(DEPLOYMENTS)])
    return DEPLOYMENTS / "embedder"
