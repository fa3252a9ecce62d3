"""Loading a config: YAML file (or the built-in default) plus dotted ``key.sub=value`` overrides,
validated into a ``TrainConfig``; every error is one line (``ConfigError``)."""
from __future__ import annotations

import copy
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
    "loss": {"ratio_level": "chunk", "surrogate": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28,
             "gamma": 0.95, "mismatch_level": "chunk", "mismatch_mode": "mask",
             "mismatch_low": 0.8, "mismatch_high": 5.0, "loss_agg": "token-mean"},
    "stabilizers": {"turn_credit": {"enabled": True, "weight": 1.0, "process_reward": 0.1},
                    "curriculum": {"enabled": True, "until_success": 0.6}},
}


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
