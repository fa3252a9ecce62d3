"""The registries of the loss's parts written as one torch function each: surrogates and KL
estimators, by name.  spec.py registers the built-in ones (importing the package imports it);
LossConfig checks its names against these tables, and the reference runs any of them."""
from __future__ import annotations

from typing import Callable, Dict

# surrogate name -> fn(A, r, logp, cfg) -> (pg_t, clipped, dual-clipped)
SURROGATES: Dict[str, Callable] = {}
# kl estimator name -> fn(logp, ref, cfg) -> kl_t
KL_ESTIMATORS: Dict[str, Callable] = {}


def _register(table: dict, what: str, name: str):
    def deco(fn):
        if name in table:
            raise ValueError(f"{what} {name!r} is already registered")
        table[name] = fn
        return fn

    return deco


def register_surrogate(name: str):
    """``@register_surrogate("name")`` on ``fn(A, r, logp, cfg) -> (pg, clipped, dual)`` over the
    trained tokens (spec.py): pg the per-token surrogate (differentiable in r and logp), clipped /
    dual the bool masks its clip_frac / dual_clip_frac metrics count."""
    return _register(SURROGATES, "surrogate", name)


def register_kl_estimator(name: str):
    """``@register_kl_estimator("name")`` on ``fn(logp, ref, cfg) -> kl`` per trained token."""
    return _register(KL_ESTIMATORS, "kl_estimator", name)
