"""Every federated algorithm by its `name`, read off the classes themselves.

A class that sets `name` registers itself when it is defined (`FederatedAlgorithm.__init_subclass__`);
importing this module imports the whole family first. The job file (`trainer.job`), the worker's
command line and the README's table of algorithms all read this registry, so a new algorithm is
offered everywhere by defining it, and nowhere by a list kept by hand.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import dpledger.trainer.federated  # noqa: F401  (defines, and so registers, every algorithm)
from dpledger.trainer.federated.base import REGISTERED, AlgorithmArgs, FederatedAlgorithm


def algorithms() -> dict[str, type[FederatedAlgorithm]]:
    """Every registered algorithm, by name, in name order."""
    return {name: REGISTERED[name] for name in sorted(REGISTERED)}


def standalone() -> dict[str, type[FederatedAlgorithm]]:
    """The algorithms a plain round loop can run: not those that need a coordinator between rounds."""
    return {name: cls for name, cls in algorithms().items() if not cls.coordinated}


def options(cls: type[FederatedAlgorithm]) -> dict[str, inspect.Parameter]:
    """The algorithm's own options (the keyword arguments of its `halves`), by name; a parameter
    without a default is required."""
    parameters = inspect.signature(cls.halves).parameters.values()
    return {p.name: p for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


def build(name: str, common: AlgorithmArgs, settings: Mapping[str, Any]) -> FederatedAlgorithm:
    """The algorithm `name` over `common`, given those of `settings` that its constructor takes."""
    known = algorithms()
    if name not in known:
        raise ValueError(f"algorithm must be one of {', '.join(known)}. Found {name!r}.")
    cls = known[name]
    taken = options(cls)
    return cls(**common, **{key: value for key, value in settings.items() if key in taken})
