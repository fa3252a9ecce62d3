"""Loading a config: YAML file (or the built-in default) plus dotted ``key.sub=value`` overrides,
validated into a ``TrainConfig``; every error is one line (``ConfigError``).

Paths in a YAML file: a relative input path (``INPUT_PATHS``: the task files, the demonstrations,
a local model directory) means the file next to the YAML when one is there, else the one in the
working directory (configs written before this rule name repo-root paths and keep working); a
path that exists in neither place is left as written, for its own one-line error.  Outputs
(``output_dir``) and command-line overrides stay relative to the working directory.  The YAML's
directory is importable (appended to ``sys.path`` and ``PYTHONPATH``, so spawned processes import
it too): ``env.reward_fn: "my_reward:score"`` finds ``my_reward.py`` next to the config.  When that
directory is itself a package (it holds ``__init__.py``), the folder above its top package is
importable as well, so ``examples.mcp.reward:score`` works from any working directory."""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import ValidationError

from ..errors import one_line_error
from .schema import TrainConfig


class ConfigError(ValueError):
    pass


# The built-in default run (``python -m arl.train`` without --config): the README's main job, i.e.
# exactly configs/tiny_cpu.yaml (tests/test_config.py keeps the two equal).  The section defaults
# stay generic; only this run's choices live here.
BUILTIN_DEFAULT: dict = {
    "output_dir": "runs/tiny_cpu",
    "env": {"max_turns": 6, "pool_size": 32},
    "rollout": {"temperature": 0.7, "max_turn_tokens": 48, "max_total_tokens": 768},
    "trainer": {"steps": 200, "max_wall_s": 1200,
                "optim": {"lr": 4.0e-4, "warmup_steps": 5, "schedule": "constant", "grad_clip": 1.0}},
    "sft": {"episodes": 2048, "steps": 232},
    "algo": {"advantage": "grpo"},
    "loss": {"ratio_level": "chunk", "surrogate": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28,
             "gamma": 0.95, "mismatch_level": "chunk", "mismatch_mode": "mask",
             "mismatch_low": 0.8, "mismatch_high": 5.0, "loss_agg": "token-mean"},
    "stabilizers": {"turn_credit": {"enabled": True, "weight": 1.0, "process_reward": 0.1},
                    "curriculum": {"enabled": True, "until_success": 0.6}},
}


# dotted keys of input paths a YAML file may give relative to itself
INPUT_PATHS = ("env.dataset", "env.dataset.path", "env.dataset.eval_path", "sft.dataset", "model.name_or_path")


def _get_dotted(d: dict, dotted: str) -> Any:
    for p in dotted.split("."):
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def resolve_paths(data: dict, base: Path) -> None:
    """Rewrites ``data``'s relative ``INPUT_PATHS`` that exist under ``base`` (the YAML's directory)
    as ``base/path``; the others stay as written (relative to the working directory)."""
    for key in INPUT_PATHS:
        v = _get_dotted(data, key)
        if isinstance(v, str) and v and not Path(v).expanduser().is_absolute() and (base / v).exists():
            _set_dotted(data, key, str(base / v))


def make_importable(directory: Path) -> None:
    """``directory`` on the import path of this process and the ones it starts, after what is
    already there (a plugin named like an installed module does not shadow it)."""
    d = str(directory.resolve())
    if d not in sys.path:
        sys.path.append(d)
    parts = [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]
    if d not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join(parts + [d])


def package_root(directory: Path) -> Optional[Path]:
    """The folder holding ``directory``'s top-level package, or None when it is not a package."""
    d = directory.resolve()
    if not (d / "__init__.py").is_file():
        return None
    while (d.parent / "__init__.py").is_file() and d.parent != d:
        d = d.parent
    return d.parent


def _set_dotted(d: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    cur = d
    for p in parts[:-1]:
        nxt = cur.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
        cur = nxt
    cur[parts[-1]] = value


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> TrainConfig:
    """YAML file (or ``BUILTIN_DEFAULT`` when None) plus ``key.sub=value`` overrides."""
    data: dict = copy.deepcopy(BUILTIN_DEFAULT) if path is None else {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config: no such file {path}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--config: {path} is not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--config: {path} must hold a mapping at the top level")
        resolve_paths(data, p.parent)
        make_importable(p.parent)
        root = package_root(p.parent)
        if root is not None:
            make_importable(root)
    for ov in overrides or []:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r}: expected key.sub=value")
        k, v = ov.split("=", 1)
        _set_dotted(data, k.strip(), yaml.safe_load(v) if v.strip() else None)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(one_line_error(e, root=TrainConfig)) from None
    except ValueError as e:  # a section's own one-line error, raised from its constructor
        raise ConfigError(str(e).splitlines()[0]) from None


def dump_config(cfg: TrainConfig) -> str:
    """The resolved config as YAML, every key with its value (defaults included): what
    ``--print-config`` prints, and a valid ``--config`` file."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False)
