"""The neuron-serve version, in a leaf module so the server can report it without
importing the compiler."""

__version__ = "0.1.0"
