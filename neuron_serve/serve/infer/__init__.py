"""The infer plane: a compiled model's requests, batched onto its cores, and its HTTP routes."""
