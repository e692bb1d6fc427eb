"""LoRA adapters: PEFT's files read (config.py, adapter.py), laid out for the compiled models (layers.py), held in the
core's buffer slots and counted from a request's submission to its end (adapters.py)."""
