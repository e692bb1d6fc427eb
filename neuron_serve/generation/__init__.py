"""Generation (task: generate): a causal LM compiled around a KV cache on the core, and its engine."""
