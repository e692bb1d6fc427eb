"""What runs on the cores: the calls of a step (calls.py) on the executor (executor.py), the compiled generation model
and its buckets (model.py), the causal LM around its KV-cache slots (slots.py, mixed.py, shapes.py), attention and
tensor parallelism."""
