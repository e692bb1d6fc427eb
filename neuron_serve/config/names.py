"""Names a model answers to in URLs and in OpenAI's ``model`` field: a model's, and a LoRA adapter's
(served as a model of its own). Part of the model.yaml schema; imports nothing."""

NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
NAME_RULE = "lowercase letters, digits, '-', '_', '.', starting with a letter or digit, at most 63 characters"
