"""Token choice: on the core inside the compiled call (sampler.py), per-request parameters and the host's choice
(sampling.py), and the merge of the two for a call's rows (choice.py)."""
