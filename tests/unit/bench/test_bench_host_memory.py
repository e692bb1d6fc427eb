"""bench/host_memory.py's parts that run without a deployment: how it names a deployment's processes, the words
tokenizer of the 1B-shaped model, and its table against the targets."""

from bench import host_memory

GIB = 1 << 30


def test_each_process_of_a_deployment_is_named_by_what_it_is():
    assert host_memory._kind("/venv/bin/python -m neuron_serve.generation.process.worker 7") == "engine process"
    assert host_memory._kind("ray::ServeReplica:llm:generate") == "replica"
    assert host_memory._kind("/venv/bin/python /venv/bin/neuron-serve deploy model.yaml --port 1") == \
        "deploy (Ray driver)"
    assert host_memory._kind("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet") == \
        "Ray's own processes"


def test_the_words_tokenizer_gives_back_the_ids_of_a_completion():
    tok = host_memory.words_tokenizer(1000)
    assert tok("t5 t17 t999").input_ids == [5, 17, 999]
    assert [int(w[1:]) for w in tok.decode([5, 17, 999]).split()] == [5, 17, 999]


def test_the_table_says_each_figure_beside_its_target():
    row = {"case": "smollm2", "compiled_models": 24, "failed": 0, "all_compiled_s": 600.0,
           "processes_now_bytes": {"engine process": 3.5 * GIB, "replica": 1.0 * GIB},
           "processes_peak_bytes": {"engine process": 5.0 * GIB}, "total_now_bytes": 4.5 * GIB,
           "total_peak_bytes": 6.0 * GIB, "compiling_process": "engine process", "weights_bytes": 512 << 20,
           "kv_cache_bytes": 360 << 20, "further_model_median_bytes": 70 << 20, "further_model_max_bytes": 150 << 20,
           "compile_seconds": {"prefill_512": 20.0, "decode_16x512": 14.0, "prefill_32": 13.0},
           "answer": "equal to transformers", "killed_by_memory_monitor": False,
           "targets": {"deployment <= 4 GiB": False}}
    text = host_memory.table([row])
    assert "| smollm2 | 24 (0 failed) | 600 s | 3.50 GiB (5.00 GiB) | 4.50 GiB (6.00 GiB) | 0.50 GiB + 0.35 GiB | " \
           "70 / 150 MiB (29% of the weights) | 14.0 | equal to transformers |" in text
    assert "smollm2: deployment <= 4 GiB NOT met" in text
