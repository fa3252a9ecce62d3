"""Name -> environment class, so configs can say ``env: toy_lookup``."""
from __future__ import annotations

from typing import Callable, Dict, Type

from .base import Environment

ENVIRONMENTS: Dict[str, Type[Environment]] = {}


def register_env(name: str) -> Callable[[Type[Environment]], Type[Environment]]:
    def deco(cls: Type[Environment]) -> Type[Environment]:
        ENVIRONMENTS[name] = cls
        return cls

    return deco


def make_env(name: str, **kwargs) -> Environment:
    if name not in ENVIRONMENTS:
        raise ValueError(f"env: unknown {name!r}; choose from {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name](**kwargs)
