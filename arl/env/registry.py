"""Environments by name: a registered one (``env.name: toy_lookup``) or the user's own class by
import path (``env.name: "my_pkg.envs:MyEnv"``, an ``Environment`` subclass, imported in every
process that makes one)."""
from __future__ import annotations

import asyncio
import importlib
import inspect
from typing import Callable, Dict, Type

from ..config import EnvConfig
from .base import Environment
from .unavailable import UNAVAILABLE

ENVIRONMENTS: Dict[str, Type[Environment]] = {}


def register_env(name: str) -> Callable[[Type[Environment]], Type[Environment]]:
    def deco(cls: Type[Environment]) -> Type[Environment]:
        ENVIRONMENTS[name] = cls
        return cls

    return deco


def env_class(name: str) -> Type[Environment]:
    """The class ``name`` stands for; a one-line ValueError naming what is wrong otherwise."""
    if ":" not in name:
        if name not in ENVIRONMENTS:
            if name in UNAVAILABLE:  # an ecosystem package arl cannot carry yet: say why
                raise ValueError(UNAVAILABLE[name])
            raise ValueError(f"env: unknown {name!r}; choose from {sorted(ENVIRONMENTS)} or give 'module:Class'")
        return ENVIRONMENTS[name]
    module, _, attr = name.partition(":")
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # the user's module: any import-time error is theirs to see, in one line
        raise ValueError(f"env.name: cannot import {module!r} ({type(e).__name__}: {e})") from None
    cls = getattr(mod, attr, None)
    if cls is None:
        raise ValueError(f"env.name: module {module!r} has no {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"env.name: {name!r} is not an arl.env.Environment subclass")
    return cls


def env_kwargs(cfg: EnvConfig, model_dir: str | None = None) -> dict:
    """The constructor arguments of the configured environment: ``env.kwargs``, plus the config's
    ``env.max_turns`` (the one turn limit), ``env.reward_fn`` and ``env.tool_parser`` (as ``parser``)
    for a constructor that takes them, and ``model_dir`` as ``tokenizer`` for one that takes a
    tokenizer (vLLM's tool parsers read it).  One-line ValueError for a limit, reward or parser
    given twice, or one the environment cannot take."""
    kwargs = dict(cfg.kwargs)
    params = inspect.signature(env_class(cfg.name)).parameters
    if cfg.tool_parser is not None:
        if "parser" in kwargs:
            raise ValueError("env.kwargs.parser and env.tool_parser: give the tool-call format once (env.tool_parser)")
        if "parser" not in params:
            raise ValueError(f"env.tool_parser: environment {cfg.name!r} takes no tool-call parser")
        kwargs["parser"] = cfg.tool_parser
    if model_dir is not None and "tokenizer" in params and "tokenizer" not in kwargs:
        kwargs["tokenizer"] = model_dir
    if "max_turns" in kwargs:
        raise ValueError("env.kwargs.max_turns: set env.max_turns instead (the one turn limit)")
    if "max_turns" in params:
        kwargs["max_turns"] = cfg.max_turns
    if cfg.reward_fn is not None:
        if "reward_fn" in kwargs:
            raise ValueError("env.kwargs.reward_fn and env.reward_fn: give the reward function once")
        if "reward_fn" not in params:
            raise ValueError(f"env.reward_fn: environment {cfg.name!r} takes no reward function (it computes its own)")
        kwargs["reward_fn"] = cfg.reward_fn
    return kwargs


def make_env(name: str, **kwargs) -> Environment:
    cls = env_class(name)
    try:  # unknown or missing kwargs: say so before the constructor runs
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"env.kwargs: {e} ({cls.__name__})") from None
    return cls(**kwargs)


def check_env(name: str, kwargs: dict, task: dict | None = None) -> None:
    """Make the environment and reset its first task (what ``--dry-run`` does, so a bad env.name,
    env.kwargs or environment fails before any process starts).  ``task``: the first dataset row,
    passed to an env whose reset takes one."""
    env = make_env(name, **kwargs)
    extra = {"task": task} if task is not None and "task" in inspect.signature(env.reset).parameters else {}

    async def first_task():
        try:
            await env.reset(0, **extra)
        finally:
            await env.close()

    try:
        asyncio.run(first_task())
    except Exception as e:
        raise ValueError(f"env: {name!r} failed to reset task 0 ({type(e).__name__}: {e})") from None
