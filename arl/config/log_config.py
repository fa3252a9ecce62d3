"""The ``logging`` section: metrics.jsonl, TensorBoard, the progress bar and Weights & Biases
(arl/metrics/logger.py)."""
from __future__ import annotations

from importlib.util import find_spec
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


WANDB_PIN = "wandb==0.31.0"  # the version tested (optional: bash install.sh --wandb)


class WandbConfig(_Section):
    """Weights & Biases run of trainer rank 0: the metrics.jsonl records, step for step.  Offline
    mode needs no network or account (``wandb sync <output_dir>/wandb/offline-run-*`` uploads later)."""

    project: str = Field(description="W&B project name.")
    entity: Optional[str] = Field(None, description="W&B entity (user or team); null: the account's default.")
    name: Optional[str] = Field(None, description="W&B run name; null: the output_dir's name.")
    mode: Literal["online", "offline"] = Field(
        "offline", description="offline writes under output_dir/wandb (no network; wandb sync uploads later); "
        "online uploads.")
    tags: list[str] = Field([], description="W&B run tags.")
    samples: int = Field(
        4, ge=0, description="Held-out episodes of each evaluation logged as a W&B table (heldout/samples: "
        "seed, success, reward, the rendered transcript); 0: none.")


class LoggingConfig(_Section):
    jsonl: bool = Field(True, description="Write output_dir/metrics.jsonl, one record per step.")
    tensorboard: bool = Field(True, description="Write TensorBoard events to output_dir/tb.")
    progress: bool = Field(True, description="Show a progress bar on the console.")
    wandb: Optional[WandbConfig] = Field(
        None, description="Log every step's record to Weights & Biases (needs the wandb package); null: off.")

    @field_validator("wandb")
    @classmethod
    def _wandb_installed(cls, v: Optional[WandbConfig]) -> Optional[WandbConfig]:
        if v is not None and find_spec("wandb") is None:
            raise ValueError(f"the wandb package is not installed (pip install {WANDB_PIN})")
        return v
