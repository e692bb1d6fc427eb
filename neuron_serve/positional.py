"""Keyword arguments passed positionally, as torch-neuronx still accepts them (deprecated).

torch-neuronx 2.15.0 deprecated ``trace(model, x, None, ["--auto-cast", "all"])``: it
warns and infers the keyword arguments from their order in the reference signature
``trace(func, example_inputs, *_, input_output_aliases={}, compiler_workdir=None,
compiler_args=None, partitioner_config=None, inline_weights_to_neff=True)``.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable

from .errors import ConfigError

TRACE_ORDER = ("input_output_aliases", "compiler_workdir", "compiler_args", "partitioner_config",
               "inline_weights_to_neff")
# Reference defaults: passing one positionally asks for nothing, even where not implemented.
REFERENCE_DEFAULTS = {"input_output_aliases": ({}, None), "compiler_workdir": (None,), "compiler_args": (None,),
                      "partitioner_config": (None,), "inline_weights_to_neff": (True,)}
MESSAGE = ("{fn}(): passing keyword arguments as positional arguments is deprecated (torch-neuronx 2.15.0) and is "
           "likely to become an error; inferred {inferred}. Assign kwargs as kwargs and not args.")


def _same(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and isinstance(value, (dict, bool)) and value == default)


def infer_keywords(order: tuple[str, ...], required: int) -> Callable:
    """Let the decorated function take its ``order`` keywords positionally after ``required`` arguments.

    Extra positional arguments warn (DeprecationWarning) and are passed as those
    keywords; a keyword given both ways, too many arguments, or a keyword the function
    does not take is a ConfigError.
    """

    def wrap(fn: Callable) -> Callable:
        params = inspect.signature(fn).parameters

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if len(args) <= required:
                return fn(*args, **kwargs)
            extra = args[required:]
            if len(extra) > len(order):
                raise ConfigError(f"{fn.__name__}() takes {required} positional arguments and at most "
                                  f"{len(order)} inferred keyword arguments ({', '.join(order)}); got {len(args)}.")
            inferred = dict(zip(order, extra))
            warnings.warn(MESSAGE.format(fn=fn.__name__, inferred=", ".join(f"{k}={v!r}" for k, v in inferred.items())),
                          DeprecationWarning, stacklevel=2)
            for name, value in inferred.items():
                if name in kwargs:
                    raise ConfigError(f"{fn.__name__}(): {name} given both positionally and as a keyword; "
                                      f"pass it once, as {name}=...")
                if name not in params:
                    if any(_same(value, d) for d in REFERENCE_DEFAULTS.get(name, ())):
                        continue
                    raise ConfigError(f"{fn.__name__}(): the positional argument {value!r} is inferred as {name}, "
                                      f"which neuron-serve's {fn.__name__}() does not take yet.")
                kwargs[name] = value
            return fn(*args[:required], **kwargs)

        return call

    return wrap
