"""Deploys in a row against one compile cache never break each other (tests/compile_beside_serving_check.py, each a
fresh process of two emulated cores, as a replica's engine process is): an LLM with LoRA adapters compiling in the
background while it serves adapter, sampled, prompt-logprobs and runtime-load traffic, on two cores and at
tensor_parallel_size 2; then an embedder with its default buckets; then an LLM with other buckets. Every compile
of every deploy succeeds, every answer is eager's, and the cache holds no "unsupported" that is not a verdict."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("one-cache")


def _deploy(cache_dir: Path, *args: str) -> dict:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2", "PYTHONWARNINGS": "ignore",
           "NEURON_SERVE_CACHE_DIR": str(cache_dir), "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "compile_beside_serving_check.py"), *args],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "failed after" not in proc.stderr, proc.stderr[-4000:]  # no compile of the queue failed
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _no_false_verdicts(cache_dir: Path) -> list[str]:
    """The reasons of every "unsupported" in the cache (this tiny Llama and BERT run every operator)."""
    return [json.loads(p.read_text())["payload"]["reason"] for p in (cache_dir / "support").rglob("*.json")
            if not json.loads(p.read_text())["payload"]["supported"]]


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_an_llm_with_adapters_compiles_every_model_while_it_serves(cache_dir, tensor_parallel_size):
    result = _deploy(cache_dir, "lora", "--tensor-parallel-size", str(tensor_parallel_size))
    assert result["failed"] == 0 and result["failures"] == []
    assert result["compiled"] == result["planned"] + 1  # and the prompt-logprobs prefill, asked for by a request
    assert result["rounds"] >= 2 and all(result["equal"]) and result["scored"] == [True]
    assert _no_false_verdicts(cache_dir) == []


def test_then_an_embedder_and_an_llm_with_other_buckets_start_on_the_same_cache(cache_dir):
    embedder = _deploy(cache_dir, "embedder")
    assert embedder["max_abs_error"] < 1e-4  # XLA:CPU's summation order against eager's
    llm = _deploy(cache_dir, "llm")
    assert llm["failed"] == 0 and llm["compiled"] == llm["planned"] and all(llm["equal"])
    assert _no_false_verdicts(cache_dir) == []
