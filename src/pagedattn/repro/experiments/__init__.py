"""One module per paper result: ``run(...) -> pandas.DataFrame``, written to ``results/<notebook name>/``.

Each experiment's parameters are a dataclass marked ``@validated``: a bad value (a count below 1, a rate that is not
positive, an empty sweep) fails at once with a ValueError naming the parameter, not deep inside a simulation.

What the experiments share lives once in ``common``: the parameters' base classes (``ExperimentParams``,
``ServingParams``, with the quick run's values), the CPU-scale model (``tiny_opt``), scaled traces, the engine of a
system (``make_engine``), replaying a trace on a real engine against a clock (``replay``, ``Clock``) and timing by
the fastest run (``fastest``). Each ``run()`` writes its own ``summary.json``; notebooks plot what it returns.
"""
from __future__ import annotations

import dataclasses
import numbers

#: the integer fields that may be 0: a seed, and a number of doublings (notebook 13's searches run on one length)
FROM_ZERO = ("seed", "max_length_doublings")


def check_params(params) -> None:
    """Raise ValueError, naming the field, unless every numeric field of the dataclass ``params`` (and every number
    inside its lists, tuples and dicts) is valid: those named in ``FROM_ZERO`` integers >= 0, other integers >= 1,
    other numbers > 0 (``inf`` allowed: an offline rate); lists and tuples not empty."""
    where = f"{type(params).__module__.rsplit('.', 1)[-1]}.{type(params).__name__}"
    for f in dataclasses.fields(params):
        _check(f"{where}.{f.name}", f.name, getattr(params, f.name))


def _check(label: str, name: str, value) -> None:
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _check(f"{label}[{k!r}]", name, v)
    elif isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{label} must not be empty")
        for i, v in enumerate(value):
            _check(f"{label}[{i}]", name, v)
    elif isinstance(value, numbers.Integral):
        low = 0 if name in FROM_ZERO else 1
        if value < low:
            raise ValueError(f"{label} must be an integer >= {low}, got {value}")
    elif isinstance(value, numbers.Real) and not value > 0:  # also NaN
        raise ValueError(f"{label} must be > 0, got {value}")


def validated(cls):
    """Class decorator, placed between ``@dataclass`` and the class: the dataclass checks its fields when made."""
    own = cls.__dict__.get("__post_init__")

    def __post_init__(self) -> None:
        if own is not None:
            own(self)
        check_params(self)

    cls.__post_init__ = __post_init__
    return cls
