"""What a generate model's buckets cost on the traffic it gets: each call's real and padded units counted per
bucket, the sizes kept in the compile cache, and `neuron-serve buckets` proposing the lists that cost least
(the padding recomputed here by hand)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY

import generation_models as gm
from neuron_serve import cli, logs
from neuron_serve.buckets import usage as bucket_usage
from neuron_serve.compile import cache as compile_cache
from neuron_serve.generation import SamplingParams, engine_for

ROOT = Path(__file__).resolve().parents[3]
GENERATION = {"max_num_seqs": 1, "max_model_len": 48, "prefill_buckets": [16, 48], "decode_batch_buckets": [1],
              "decode_context_buckets": [48], "on_device_sampling": False}  # three compiled models


@pytest.fixture(autouse=True)
def logging_as_it_was():
    """cli.main in process sets neuron-serve's logging as a command prints it (the partitioner's lists at DEBUG):
    put back for the tests that read the log after these in the same process."""
    level, lists = logs._serve.level, logs._partitioner_level
    yield
    logs._serve.setLevel(level)
    logs._partitioner_level = lists


def work(model: str, family: str, bucket: int, kind: str) -> float:
    return REGISTRY.get_sample_value("neuron_serve_bucket_work_total", {
        "model": model, "replica": "0", "family": family, "bucket": str(bucket), "kind": kind}) or 0.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Two prompts, of 5 and 20 tokens, one after the other, 3 tokens each (a prefill and two one-row decodes), on
    an engine whose compile cache is new."""
    name = "usage"
    store = compile_cache.configure(tmp_path_factory.mktemp("usage") / "cache")
    engine = engine_for(gm.build("llama"), name=name, **GENERATION)
    try:
        for length in (5, 20):
            engine.generate_batch([list(range(1, length + 1))], SamplingParams(max_tokens=3, temperature=0))
        deadline = time.monotonic() + 10  # an engine applies its metrics on its own thread, after the step
        while work(name, "prefill", 48, "padded") < 28 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        engine.close()
        compile_cache.configure()
    return name, store.root


def test_each_call_counts_its_real_and_padded_units_by_bucket(served):
    name, _ = served
    assert (work(name, "prefill", 16, "real"), work(name, "prefill", 16, "padded")) == (5, 11)
    assert (work(name, "prefill", 48, "real"), work(name, "prefill", 48, "padded")) == (20, 28)
    assert (work(name, "decode_rows", 1, "real"), work(name, "decode_rows", 1, "padded")) == (4, 0)


def test_the_sizes_are_kept_in_the_compile_cache_and_the_cli_proposes_buckets_from_them(served, tmp_path):
    name, cache = served
    kept = json.loads((cache / "traffic" / name / "0.json").read_text())
    assert kept == {"model": name, "replica": "0",
                    "sizes": {"prefill": {"5": 1, "20": 1}, "decode_rows": {"1": 4},
                              # the positions each decode's row attended over: 5 and 6 of the first, 20, 21
                              "decode_context": {"6": 1, "7": 1, "21": 1, "22": 1}}}
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump({"name": name, "task": "generate",
                                      "model": {"factory": "generation_models:build"}, "generation": GENERATION}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "neuron_serve.cli", "--cache-dir", str(cache), "buckets",
                           str(config), "--min-calls", "1", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    prefill = json.loads(done.stdout)["prefill"]
    # Today 5 runs as 16 and 20 as 48: (16 + 48) / (5 + 20). Two buckets with 48 kept: [20, 48] runs both as 20,
    # (20 + 20) / 25; [5, 48] would cost (5 + 48) / 25.
    assert (prefill["today"], prefill["proposed"]) == ([16, 48], [20, 48])
    assert prefill["padding_today"] == pytest.approx(64 / 25) and prefill["padding_proposed"] == pytest.approx(40 / 25)
    text = subprocess.run([sys.executable, "-m", "neuron_serve.cli", "--cache-dir", str(cache), "buckets",
                           str(config), "--min-calls", "1"], capture_output=True, text=True, env=env, timeout=120).stdout
    assert "  today    [16, 48]: padded work 2.56x the real" in text
    assert "  proposed [20, 48]: padded work 1.60x the real" in text
    assert text.endswith("generation:\n  prefill_buckets: [20, 48]\n  decode_batch_buckets: [1]\n"
                         "  decode_context_buckets: [48]\n")


def test_decode_context_buckets_are_proposed_from_the_positions_decode_calls_attended_over(tmp_path, capsys):
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump({"name": "lm", "task": "generate", "model": {"factory": "x:y"},
                                      "generation": {**GENERATION, "decode_context_buckets": [24, 48]}}))
    sizes = tmp_path / "sizes.json"
    sizes.write_text(json.dumps({"decode_context": {"9": 30, "12": 50, "40": 5}}))
    assert cli.main(["buckets", str(config), "--sizes", str(sizes), "--min-calls", "50", "--json"]) == 0
    context = json.loads(capsys.readouterr().out)["decode_context"]
    # Today 9 and 12 run as 24, 40 as 48: (80 x 24 + 5 x 48) / 990; [12, 48] runs them as 12 and 48.
    assert (context["today"], context["proposed"]) == ([24, 48], [12, 48])
    assert context["padding_proposed"] == pytest.approx((80 * 12 + 5 * 48) / (9 * 30 + 12 * 50 + 40 * 5))


def test_a_file_of_sizes_and_a_budget_of_buckets(tmp_path, capsys):
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump({"name": "lm", "task": "generate", "model": {"factory": "x:y"},
                                      "generation": GENERATION}))
    sizes = tmp_path / "sizes.json"
    sizes.write_text(json.dumps({"prefill": {"3": 10, "9": 5, "30": 1}}))
    assert cli.main(["buckets", str(config), "--sizes", str(sizes), "--max-models", "3", "--min-calls", "16", "--json"]) == 0
    prefill = json.loads(capsys.readouterr().out)["prefill"]
    assert prefill["proposed"] == [3, 9, 48]  # 30 runs on 48, the largest, kept
    assert prefill["padding_proposed"] == pytest.approx((10 * 3 + 5 * 9 + 48) / (10 * 3 + 5 * 9 + 30))


def test_a_family_with_too_few_calls_gets_no_proposal_and_the_count_is_said(tmp_path, capsys):
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump({"name": "lm", "task": "generate", "model": {"factory": "x:y"},
                                      "generation": GENERATION}))
    sizes = tmp_path / "sizes.json"
    sizes.write_text(json.dumps({"prefill": {"3": 1}, "decode_rows": {"1": 120}}))
    assert cli.main(["buckets", str(config), "--sizes", str(sizes)]) == 0
    text = capsys.readouterr().out
    assert ("prefill (generation.prefill_buckets, tokens; 1 calls):\n  today    [16, 48]: padded work 5.33x the "
            "real\n        16: 1 calls, 3 real, 13 padded\n  too little traffic to propose from: 1 calls recorded, "
            "at least 100 wanted (--min-calls N)\n") in text
    assert text.endswith("model.yaml:\ngeneration:\n  decode_batch_buckets: [1]\n")  # the one with enough
    sizes.write_text(json.dumps({"prefill": {"3": 1}}))
    assert cli.main(["buckets", str(config), "--sizes", str(sizes)]) == 0
    assert capsys.readouterr().out.endswith("\nmodel.yaml: nothing to change until more traffic is recorded\n")
    assert cli.main(["buckets", str(config), "--sizes", str(sizes), "--json"]) == 0
    prefill = json.loads(capsys.readouterr().out)["prefill"]
    assert (prefill["calls"], prefill["min_calls"], prefill["proposed"]) == (1, 100, None)
    assert cli.main(["buckets", str(config), "--sizes", str(sizes), "--min-calls", "0"]) == 2
    assert capsys.readouterr().err == "error: --min-calls: a proposal needs at least one call; got 0.\n"


def test_a_replica_writes_what_it_recorded_seconds_after_a_call_and_the_cli_reads_it_while_it_serves(
        fresh_cache, tmp_path, capsys):
    """No request after the last is needed for its sizes to reach the cache (a burst of traffic, then none)."""
    usage = bucket_usage.Usage("live", "r1", fresh_cache.root)
    for length in (5, 9, 9):
        usage.record("prefill", length, 16)
    deadline = time.monotonic() + 10
    while not usage.path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert json.loads(usage.path.read_text())["sizes"] == {"prefill": {"5": 1, "9": 2}}
    usage.record("prefill", 30, 48)  # a later call: written again, as late
    deadline = time.monotonic() + 10
    while "30" not in json.loads(usage.path.read_text())["sizes"]["prefill"] and time.monotonic() < deadline:
        time.sleep(0.1)
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump({"name": "live", "task": "generate", "model": {"factory": "x:y"},
                                      "generation": GENERATION}))
    assert cli.main(["buckets", str(config), "--min-calls", "4"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"live: sizes from {fresh_cache.root / 'traffic' / 'live'} (1 replica)\n"
                           f"prefill (generation.prefill_buckets, tokens; 4 calls):\n"), text


def test_refusals_name_what_to_do(fresh_cache, tmp_path, capsys):
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump({"name": "lm", "task": "generate", "model": {"factory": "x:y"},
                                      "generation": GENERATION}))
    assert cli.main(["buckets", str(config)]) == 1
    where = fresh_cache.root / "traffic" / "lm"
    assert capsys.readouterr().err == (f"error: no sizes recorded for lm in {where} (0 replicas): serve it first "
                                       f"(each replica writes its sizes 2 s after a call at most, and when it "
                                       f"stops), or pass --sizes FILE\n")
    sizes = tmp_path / "sizes.json"
    sizes.write_text(json.dumps({"prefill": {"3": 10}}))
    assert cli.main(["buckets", str(config), "--sizes", str(sizes), "--max-models", "0"]) == 2
    assert capsys.readouterr().err == "error: --max-models: a family needs at least one bucket; got 0.\n"
    infer = tmp_path / "infer.yaml"
    infer.write_text(yaml.safe_dump({"name": "mlp", "model": {"factory": "x:y"}, "dynamic_batch": False,
                                     "inputs": [{"name": "x", "shape": [1, 4]}]}))
    assert cli.main(["buckets", str(infer), "--sizes", str(sizes)]) == 2
    assert ("error: buckets: mlp compiles one shape at one batch size: nothing to propose. neuron-serve buckets "
            "proposes a task: infer model's shape buckets") in capsys.readouterr().err


def test_auto_buckets_are_learned_from_the_recorded_calls_once_there_are_enough(served, caplog):
    """prefill_buckets and decode_batch_buckets auto, on the sizes the served engine recorded (prompts of 5 and 20
    tokens, four one-row decodes): as many buckets as the defaults, 48 and 1 kept, the ones that pad those calls
    least; with more calls asked for than were recorded, the defaults."""
    from neuron_serve.buckets import traffic  # noqa: PLC0415
    from neuron_serve.config.generation import GenerationSettings  # noqa: PLC0415
    from neuron_serve.generation.compiling.build import checked_buckets  # noqa: PLC0415

    name, cache = served
    lm = gm.build("llama")
    base = {"max_num_seqs": 1, "max_model_len": 48, "on_device_sampling": False}
    defaults = checked_buckets(lm, GenerationSettings(**base), name=name)
    wanted = traffic.propose({5: 1, 20: 1}, len(defaults.prefill), 48)
    assert wanted[-1] == 48 and 20 in wanted and len(wanted) == len(defaults.prefill)
    compile_cache.configure(cache)
    try:
        auto = GenerationSettings(**base, prefill_buckets="auto", decode_batch_buckets="auto",
                                  decode_context_buckets="auto", learn_buckets_after=2)
        with caplog.at_level("INFO", logger="neuron_serve"):
            buckets = checked_buckets(lm, auto, name=name)
        assert (buckets.prefill, buckets.decode_rows, buckets.decode_context) == (wanted, [1], [48])
        assert "model usage: generation.decode_context_buckets [48], learned from 4 recorded calls" in caplog.text
        assert (f"model usage: generation.prefill_buckets {wanted}, learned from 2 recorded calls: padded work "
                f"{traffic.padding({5: 1, 20: 1}, wanted):.2f}x the real, against "
                f"{traffic.padding({5: 1, 20: 1}, defaults.prefill):.2f}x with the defaults {defaults.prefill}") \
            in caplog.text
        caplog.clear()
        with caplog.at_level("INFO", logger="neuron_serve"):
            buckets = checked_buckets(lm, auto.model_copy(update={"learn_buckets_after": 5}), name=name)
        assert buckets.prefill == defaults.prefill
        assert (f"model usage: generation.prefill_buckets {defaults.prefill}, the defaults (auto: 2 recorded of the 5 "
                f"it waits for)") in caplog.text
    finally:
        compile_cache.configure()


def test_the_padding_of_several_engine_processes_is_summed_bucket_by_bucket():
    """A replica's tensor-parallel groups each count their own calls; the metadata says their sum."""
    one = {"prefill": {"padded_fraction": 0.5, "buckets": {"64": {"calls": 2, "real": 64, "padded": 64}}}}
    two = {"prefill": {"padded_fraction": 0.0, "buckets": {"64": {"calls": 1, "real": 64, "padded": 0},
                                                            "512": {"calls": 1, "real": 256, "padded": 256}}},
           "decode_rows": {"padded_fraction": 0.0, "buckets": {"1": {"calls": 3, "real": 3, "padded": 0}}}}
    assert bucket_usage.merged_summaries([one, two, {}]) == {
        "prefill": {"padded_fraction": round(320 / (384 + 320), 4),
                    "buckets": {"64": {"calls": 3, "real": 128, "padded": 64},
                                "512": {"calls": 1, "real": 256, "padded": 256}}},
        "decode_rows": {"padded_fraction": 0.0, "buckets": {"1": {"calls": 3, "real": 3, "padded": 0}}}}


def test_learn_buckets_after_needs_an_auto_family():
    from neuron_serve.config.generation import GenerationSettings  # noqa: PLC0415
    from neuron_serve.errors import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError, match="learn_buckets_after: applies with prefill_buckets, decode_batch_buckets or "
                                          "decode_context_buckets auto; set one to auto or remove learn_buckets_after"):
        GenerationSettings.checked({"prefill_buckets": [16], "learn_buckets_after": 3})
