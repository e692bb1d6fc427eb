"""The engine's step: the scheduler's plan (scheduler.py, plan.py), the requests and their status (request.py,
states.py), the prefix cache, the stop rules, the metrics, and one engine per core (engine.py, group.py)."""
