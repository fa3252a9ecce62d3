"""Training configuration: YAML + dotted CLI overrides, validated by pydantic.

Every section forbids unknown keys; any error is one line naming the dotted key and, for an
unknown key, the keys allowed there:  ``trainer.zero_stag: unknown key (allowed: ...)``.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .ops.policy_loss.config import LossConfig
from .stabilizers.config import StabilizerConfig


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class TinyModelConfig(Section):
    """A Qwen2-architecture model built locally (no download): the embedded default."""

    layers: int = Field(2, ge=1)
    hidden: int = Field(128, ge=8)
    heads: int = Field(4, ge=1)
    kv_heads: int = Field(2, ge=1)
    intermediate: int = Field(384, ge=8)
    vocab_size: int = Field(1024, ge=300)
    max_position: int = Field(2048, ge=64)


class ArchConfig(Section):
    """Dimensions of a model that is not available offline, for --dry-run memory estimates."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab_size: int
    tie_word_embeddings: bool = False


class ModelConfig(Section):
    name_or_path: str = "tiny"  # "tiny" builds TinyModelConfig locally; else a local dir or hub id
    tiny: TinyModelConfig = TinyModelConfig()
    arch: Optional[ArchConfig] = None  # needed by --dry-run when name_or_path is not local
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gradient_checkpointing: bool = False
    # the trainer's packed attention (arl/model/packed.py): auto = flash-attn varlen on GPU when
    # installed, else arl's exact per-sequence SDPA; hf_sdpa_packed = transformers' block mask
    attn_implementation: Literal["auto", "flash_attention_2", "varlen_sdpa", "hf_sdpa_packed"] = "auto"


class EnvConfig(Section):
    name: str = "toy_lookup"
    kwargs: dict[str, Any] = {}
    pool_size: int = Field(16, ge=1)  # concurrent environment instances (tool calls in flight)
    max_turns: int = Field(8, ge=1)
    eval_tasks: int = Field(64, ge=0)  # held-out episodes for the success rate


class RolloutConfig(Section):
    engine: Literal["vllm"] = "vllm"
    group_size: int = Field(8, ge=1)  # samples per task (GRPO group)
    tasks_per_step: int = Field(16, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_turn_tokens: int = Field(64, ge=1)
    max_total_tokens: int = Field(1024, ge=16)
    staleness: int = Field(1, ge=0)  # max policy versions between generation and training
    filter_cap: float = Field(0.5, ge=0, le=1)  # max filtered fraction per step (recoverable faults)
    retries: int = Field(1, ge=0)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    tensor_parallel: int = Field(1, ge=1)
    # how new weights reach the engine: "file" = a safetensors file in /dev/shm that the engine
    # reloads; "group" = trainer rank 0 broadcasts the tensors into the engine's workers over a
    # process group (NCCL on GPU, gloo on CPU); "auto" = group on GPU, file on CPU
    weight_sync: Literal["auto", "file", "group"] = "auto"
    # vLLM engines, each driven by its own rollout process that generates tasks_per_step / engines
    # groups of every batch.  None: one on the CPU layout, one per node on GPU layouts (over that
    # node's rollout GPUs); the CPU layout takes any number (how the multi-engine path is tested).
    engines: Optional[int] = Field(None, ge=1)

    def sync_mode(self, device: str) -> str:
        return self.weight_sync if self.weight_sync != "auto" else ("group" if device == "cuda" else "file")


class OptimConfig(Section):
    lr: float = Field(1e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    grad_clip: float = Field(1.0, gt=0)


class TrainerConfig(Section):
    world_size: int = Field(2, ge=1)  # trainer ranks (data parallel)
    zero_stage: Literal[0, 1, 2, 3] = 2
    micro_batch_tokens: int = Field(4096, ge=16)  # hard token budget of a packed micro-batch
    steps: int = Field(50, ge=0)
    updates_per_batch: int = Field(1, ge=1)  # optimizer steps per rollout batch
    optim: OptimConfig = OptimConfig()
    reference_model: bool = False  # frozen copy for KL (needed when loss.kl_beta > 0)
    backend: Literal["auto", "reference", "cpu", "triton", "cuda"] = "auto"  # policy-loss backend
    deterministic: bool = False
    eval_every: int = Field(5, ge=1)
    checkpoint_every: int = Field(10, ge=1)
    max_wall_s: Optional[float] = Field(None, gt=0)


class SFTConfig(Section):
    enabled: bool = True
    episodes: int = Field(256, ge=1)  # expert demonstrations
    steps: int = Field(100, ge=0)
    lr: float = Field(1e-3, gt=0)
    micro_batch_tokens: int = Field(4096, ge=16)


class LayoutConfig(Section):
    """Where processes run.  CPU: trainer ranks + one in-process engine on one machine.
    GPU: ``rollout_gpus`` + ``trainer_gpus`` per node, nodes from a hostfile."""

    device: Literal["cpu", "cuda"] = "cpu"
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    rollout_gpus: int = Field(0, ge=0)  # per node
    trainer_gpus: int = Field(0, ge=0)  # per node
    hostfile: Optional[str] = None
    gpu_memory_gib: float = Field(80.0, gt=0)
    launcher: Literal["spawn", "deepspeed", "torchrun"] = "spawn"


class LoggingConfig(Section):
    jsonl: bool = True
    tensorboard: bool = True
    progress: bool = True


class TrainConfig(Section):
    seed: int = 0
    output_dir: str = "runs/default"
    model: ModelConfig = ModelConfig()
    env: EnvConfig = EnvConfig()
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    loss: LossConfig = LossConfig()
    sft: SFTConfig = SFTConfig()
    layout: LayoutConfig = LayoutConfig()
    logging: LoggingConfig = LoggingConfig()
    stabilizers: StabilizerConfig = StabilizerConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> "TrainConfig":
        if self.loss.kl_beta > 0 and not self.trainer.reference_model:
            raise ValueError("loss.kl_beta > 0 needs trainer.reference_model: true")
        if self.stabilizers.kl.enabled and not self.trainer.reference_model:
            raise ValueError("stabilizers.kl.enabled needs trainer.reference_model: true")
        if self.stabilizers.turn_credit.enabled:  # per-chunk advantages go in as one segment per chunk
            from .stabilizers.turn_credit import check_loss_config

            check_loss_config(self.loss)
        lay = self.layout
        if lay.device == "cuda":
            if lay.rollout_gpus + lay.trainer_gpus != lay.gpus_per_node:
                raise ValueError(
                    f"layout.rollout_gpus + layout.trainer_gpus = {lay.rollout_gpus + lay.trainer_gpus} "
                    f"must equal layout.gpus_per_node = {lay.gpus_per_node}")
            if lay.trainer_gpus * lay.nodes != self.trainer.world_size:
                raise ValueError(
                    f"trainer.world_size = {self.trainer.world_size} must equal layout.trainer_gpus x layout.nodes "
                    f"= {lay.trainer_gpus * lay.nodes}")
            if lay.rollout_gpus % self.rollout.tensor_parallel:
                raise ValueError("layout.rollout_gpus must be a multiple of rollout.tensor_parallel")
            if lay.nodes > 1 and not lay.hostfile:
                raise ValueError("layout.hostfile is required when layout.nodes > 1")
            if lay.nodes > 1 and self.rollout.weight_sync == "file":
                raise ValueError("rollout.weight_sync: 'file' writes to trainer rank 0's /dev/shm, which engines on "
                                 "other nodes cannot read; use 'group' (or 'auto') with layout.nodes > 1")
            if self.rollout.engines not in (None, lay.nodes):
                raise ValueError(f"rollout.engines: GPU layouts run one engine per node (layout.nodes = {lay.nodes}), "
                                 f"got {self.rollout.engines}")
        if self.rollout.tasks_per_step % self.num_engines():
            raise ValueError(f"rollout.tasks_per_step = {self.rollout.tasks_per_step} must be a multiple of the number "
                             f"of engines ({self.num_engines()}): each engine generates an equal share of a batch")
        if self.rollout.max_turn_tokens > self.rollout.max_total_tokens:
            raise ValueError("rollout.max_turn_tokens must be <= rollout.max_total_tokens")
        if self.rollout.max_total_tokens > self.trainer.micro_batch_tokens:
            raise ValueError(
                f"rollout.max_total_tokens = {self.rollout.max_total_tokens} exceeds trainer.micro_batch_tokens = "
                f"{self.trainer.micro_batch_tokens}: a trajectory could not be packed")
        return self

    def num_engines(self) -> int:
        """Rollout engines of this layout (see ``rollout.engines``)."""
        if self.layout.device == "cuda":
            return self.layout.nodes
        return self.rollout.engines or 1


# ---------------------------------------------------------------- loading and errors
def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the (nested) model section that a pydantic error location points into."""
    cur: Any = model
    for part in loc[:-1]:
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)) or part not in cur.model_fields:
            return []
        ann = cur.model_fields[part].annotation
        if get_origin(ann) is Union:
            ann = next((a for a in get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)), ann)
        cur = ann
    return sorted(cur.model_fields) if isinstance(cur, type) and issubclass(cur, BaseModel) else []


def config_error(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = tuple(e["loc"])
    key = ".".join(str(p) for p in loc) or "config"
    if e["type"] == "extra_forbidden":
        return f"{key}: unknown key (allowed: {', '.join(_allowed_keys(TrainConfig, loc))})"
    msg = e["msg"].removeprefix("Value error, ")
    for prefix in ("LossConfig: ", "StabilizerConfig: "):  # sections raising their own one-line error
        if msg.startswith(prefix):
            msg = msg.removeprefix(prefix)
            sub, _, rest = msg.partition(": ")
            parts = tuple(sub.split("."))
            if rest and all(p.isidentifier() or p.isdigit() for p in parts):
                if rest == "unknown key":
                    rest += f" (allowed: {', '.join(_allowed_keys(TrainConfig, loc + parts))})"
                return f"{key}.{sub}: {rest}"
    return f"{key}: {msg}" if loc else msg


class ConfigError(ValueError):
    pass


def _set_dotted(d: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    cur = d
    for p in parts[:-1]:
        nxt = cur.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
        cur = nxt
    cur[parts[-1]] = value


# The built-in default run (``python -m arl.train`` without --config): the README's main job, i.e.
# exactly configs/tiny_cpu.yaml (tests/test_config.py keeps the two equal).  The model defaults above
# stay generic; only this run's choices live here.
BUILTIN_DEFAULT: dict = {
    "output_dir": "runs/tiny_cpu",
    "env": {"max_turns": 6, "pool_size": 32},
    "rollout": {"temperature": 0.7, "max_turn_tokens": 48, "max_total_tokens": 768},
    "trainer": {"steps": 200, "max_wall_s": 1200,
                "optim": {"lr": 4.0e-4, "warmup_steps": 5, "schedule": "constant", "grad_clip": 1.0}},
    "sft": {"episodes": 2048, "steps": 232},
    "loss": {"ratio_level": "chunk", "surrogate": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28,
             "adv_norm": "group_std", "gamma": 0.95, "mismatch_level": "chunk", "mismatch_mode": "mask",
             "mismatch_low": 0.8, "mismatch_high": 5.0, "loss_agg": "token-mean"},
    "stabilizers": {"turn_credit": {"enabled": True, "weight": 1.0, "process_reward": 0.1},
                    "curriculum": {"enabled": True, "until_success": 0.6}},
}


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
        raise ConfigError(config_error(e)) from None
    except ValueError as e:  # LossConfig's own one-line error, raised from its __init__
        raise ConfigError(str(e).splitlines()[0]) from None
