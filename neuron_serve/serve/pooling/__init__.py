"""The pooling plane (task: embed, score, classify): text to embeddings and scores on the infer plane's queue and
cores; plane.py, answers.py (its answers per route), http.py (the model's routes), observer.py (its metrics)."""
