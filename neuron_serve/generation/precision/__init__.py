"""How the weights and the cache are held: dtypes (dtypes.py), int8 and fp8 quantization (quantization.py), quantized
checkpoints (checkpoint.py) and the fp8 KV-cache format (kv_cache.py)."""
