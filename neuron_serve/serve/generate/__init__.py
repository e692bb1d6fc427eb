"""The generation plane: a generate model's requests, streamed from its engines, and its HTTP routes."""
