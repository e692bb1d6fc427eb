"""The front end of the engines, in the replica: requests checked and admitted (processor.py), the engine's request and
event types (protocol.py), output text and stop strings (text.py), grammars (structured.py), events handed to an
event loop (mailbox.py)."""
