"""The engine in a process of its own: the replica's client (client.py), the engine process (worker.py) and the typed
messages between them (messages.py)."""
