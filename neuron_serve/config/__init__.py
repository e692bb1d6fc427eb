"""model.yaml's schema: schema.py (ModelConfig and its loading), generation.py (its
``generation:`` section) and compiler_args.py (neuronx-cc's options).

Each is imported by its own name; this package re-exports nothing.
"""
