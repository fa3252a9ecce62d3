"""The training config schema: one pydantic section per YAML section, and the cross-checks
between sections (in ``TrainConfig``, nowhere else).  Components take their section as is.
"""
from __future__ import annotations

from importlib.util import find_spec
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..ops.policy_loss.config import LossConfig
from .algo import AlgoConfig, check_algo, check_moved
from .critic import CriticConfig
from .stabilizers import StabilizerConfig, check_turn_credit_loss


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class TinyModelConfig(Section):
    """A Qwen2-architecture model built locally (no download; arl/model/tiny.py): the embedded default."""

    layers: int = Field(2, ge=1)
    hidden: int = Field(128, ge=8)
    heads: int = Field(4, ge=1)
    kv_heads: int = Field(2, ge=1)
    intermediate: int = Field(384, ge=8)
    vocab_size: int = Field(1024, ge=300)
    max_position: int = Field(2048, ge=64)
    rope_theta: float = Field(10000.0, gt=0)
    # lm_head shares the input embedding (as in most small instruct models: SmolLM2, Qwen2.5-0.5B)
    tie_word_embeddings: bool = False

    @model_validator(mode="after")
    def _check(self) -> "TinyModelConfig":
        if self.hidden % self.heads:
            raise ValueError(f"hidden: {self.hidden} must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: {self.kv_heads} must divide heads ({self.heads})")
        return self


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


class DatasetConfig(Section):
    """Tasks from a file, one per row (arl/data/tasks.py): JSONL, JSON, parquet, or a directory
    written by HF ``datasets``' ``save_to_disk``.  A row holds ``prompt`` or ``messages``; its
    other keys (ground truth, metadata) reach the environment and the reward function as is."""

    path: str = Field(min_length=1)
    eval_path: Optional[str] = Field(None, min_length=1)  # held-out rows from this file; eval_fraction is then ignored
    eval_fraction: float = Field(0.1, ge=0, lt=1)  # else this share of path's rows, seeded
    bad_rows: Literal["fail", "skip"] = "fail"  # skip: counted and reported, never silent
    shuffle: bool = True  # a seeded new order every epoch (False: file order)


class EnvConfig(Section):
    name: str = "toy_lookup"
    kwargs: dict[str, Any] = {}
    pool_size: int = Field(16, ge=1)  # concurrent environment instances (tool calls in flight)
    # the one turn limit: the episode ends past it, and environments that take ``max_turns`` get it
    max_turns: int = Field(8, ge=1)
    # the user's reward function, "pkg.module:fn", handed to environments that take ``reward_fn``
    reward_fn: Optional[str] = None
    eval_tasks: int = Field(64, ge=0)  # held-out episodes for the success rate
    dataset: Optional[DatasetConfig] = None  # tasks from data; None: the env makes tasks from seeds

    @field_validator("dataset", mode="before")
    @classmethod
    def _path_alone(cls, v: Any) -> Any:
        if isinstance(v, str):  # `dataset: tasks.jsonl`, the common case
            return {"path": v}
        if v is not None and not isinstance(v, (dict, DatasetConfig)):
            raise ValueError(f"expected a path or a mapping {{path: ..., eval_path: ...}}, got {type(v).__name__}")
        return v


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
    over_cap: Literal["keep", "mask"] = "keep"  # filtered trajectories past the cap: train with reward 0, or mask
    retries: int = Field(1, ge=0)  # re-runs of an episode after a recoverable fault
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    tensor_parallel: int = Field(1, ge=1)
    # how new weights reach the engine: "file" = a safetensors file in /dev/shm that the engine
    # reloads; "group" = trainer rank 0 broadcasts the tensors into the engine's workers over a
    # process group (NCCL on GPU, gloo on CPU); "auto" = group on GPU, file on CPU
    weight_sync: Literal["auto", "file", "group"] = "auto"
    sync_bucket_mb: Optional[int] = Field(None, ge=0, description="weight sync: flat per-dtype buckets of this many MiB, "
                                          "one broadcast or file each; 0 = per tensor; None = 256 on GPU, 0 on CPU")
    # vLLM engines, each driven by its own rollout process that generates tasks_per_step / engines
    # groups of every batch.  None: one on the CPU layout, one per node on GPU layouts (over that
    # node's rollout GPUs); the CPU layout takes any number (how the multi-engine path is tested).
    engines: Optional[int] = Field(None, ge=1)

    def sync_mode(self, device: str, colocate: bool = False) -> str:
        """``auto``: the group on separate GPUs; the file on CPU and on colocated GPUs (NCCL cannot
        pair the trainer and an engine worker on one GPU)."""
        if self.weight_sync != "auto":
            return self.weight_sync
        return "group" if device == "cuda" and not colocate else "file"


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
    # with the old-logp pass skipped, the logprob head computes its gradients in its forward (3
    # matmuls, no logits recomputation) wherever the loss's gradient is local (not IPA's mixed loss):
    # at V=151936 its extra peak with the entropy is 14.3% of naive's and its step 0.85x the naive
    # head's (the recompute head: 1.05x; quiet CPU, README).  false: the bounded-memory recompute head
    head_grad_in_forward: bool = True
    deterministic: bool = False
    # CPU layout: torch threads per trainer rank (None: $OMP_NUM_THREADS, else 1).  One rank on a
    # small machine trains faster with more; vLLM's engine shares the same cores
    cpu_threads: Optional[int] = Field(None, ge=1)
    eval_every: int = Field(5, ge=1)
    checkpoint_every: int = Field(10, ge=1)
    # checkpoints kept in output_dir/checkpoints (the newest ones; None: all); the one just written
    # is never deleted, so --resume always finds the newest
    keep_last: Optional[int] = Field(None, ge=1)
    # an HF-format export (with the tokenizer) inside each checkpoint, checkpoints/step<N>/hf: loads in
    # transformers, vLLM and python -m arl.eval; off saves a model's size of disk per checkpoint
    checkpoint_hf: bool = True
    max_wall_s: Optional[float] = Field(None, gt=0)


class SFTConfig(Section):
    enabled: bool = True
    # demonstrations (JSONL of {"messages": [...]} chats with tool calls); None: the env's expert
    dataset: Optional[str] = None
    episodes: int = Field(256, ge=1)  # expert demonstrations (or at most this many dataset rows)
    steps: int = Field(100, ge=0)
    batch_size: int = Field(32, ge=1)  # demonstrations per step
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
    # the trainer and the vLLM engine share the devices (verl's hybrid engine): every GPU of the
    # node holds a trainer rank and a share of the engine, and rollout and training take turns
    # (arl/rollout/colocate.py).  None: true for a 1-GPU node, else false.  On CPU it sets the
    # same schedule on the one machine.
    colocate: Optional[bool] = None

    @model_validator(mode="after")
    def _colocated_gpus(self) -> "LayoutConfig":
        if self.colocate is None:
            self.colocate = self.device == "cuda" and self.gpus_per_node == 1
        if self.colocate and self.device == "cuda":  # every GPU is both: what was left out is all of them
            self.rollout_gpus = self.rollout_gpus or self.gpus_per_node
            self.trainer_gpus = self.trainer_gpus or self.gpus_per_node
        return self


WANDB_PIN = "wandb==0.31.0"  # the version tested (optional: not installed by install.sh)


class WandbConfig(Section):
    """Weights & Biases run of trainer rank 0: the metrics.jsonl records, step for step.  Offline
    mode needs no network or account (``wandb sync <output_dir>/wandb/offline-run-*`` uploads later)."""

    project: str
    entity: Optional[str] = None
    name: Optional[str] = None  # None: the output_dir's name
    mode: Literal["online", "offline"] = "offline"
    tags: list[str] = []


class LoggingConfig(Section):
    jsonl: bool = True
    tensorboard: bool = True
    progress: bool = True
    wandb: Optional[WandbConfig] = None  # None: off

    @field_validator("wandb")
    @classmethod
    def _wandb_installed(cls, v: Optional[WandbConfig]) -> Optional[WandbConfig]:
        if v is not None and find_spec("wandb") is None:
            raise ValueError(f"the wandb package is not installed (pip install {WANDB_PIN})")
        return v


class TrainConfig(Section):
    seed: int = 0
    output_dir: str = "runs/default"
    model: ModelConfig = ModelConfig()
    env: EnvConfig = EnvConfig()
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    algo: AlgoConfig = AlgoConfig()
    loss: LossConfig = LossConfig()
    sft: SFTConfig = SFTConfig()
    layout: LayoutConfig = LayoutConfig()
    logging: LoggingConfig = LoggingConfig()
    stabilizers: StabilizerConfig = StabilizerConfig()
    critic: CriticConfig = CriticConfig()

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_moved(data, {"loss": LossConfig, "critic": CriticConfig})
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> "TrainConfig":
        if self.loss.kl_beta > 0 and not self.trainer.reference_model:
            raise ValueError("loss.kl_beta > 0 needs trainer.reference_model: true")
        if self.stabilizers.kl.enabled and not self.trainer.reference_model:
            raise ValueError("stabilizers.kl.enabled needs trainer.reference_model: true")
        check_turn_credit_loss(self.stabilizers, self.loss)
        check_algo(self.algo, self.critic, self.stabilizers, self.loss)
        lay = self.layout
        if lay.device == "cuda" and lay.colocate:
            if not lay.rollout_gpus == lay.trainer_gpus == lay.gpus_per_node:
                raise ValueError(
                    f"layout.colocate: every GPU holds a trainer rank and a share of the engine, so "
                    f"layout.rollout_gpus ({lay.rollout_gpus}) and layout.trainer_gpus ({lay.trainer_gpus}) must "
                    f"both equal layout.gpus_per_node ({lay.gpus_per_node}), or be left out")
            if lay.nodes > 1:
                raise ValueError("layout.colocate: one node only (the weights reach a colocated engine through "
                                 "/dev/shm; use the separate layout, layout.colocate: false, across nodes)")
            if self.rollout.weight_sync == "group":
                raise ValueError("rollout.weight_sync: 'group' pairs trainer rank 0 and an engine worker in one NCCL "
                                 "group, which NCCL refuses on one GPU; use 'file' (or 'auto') with layout.colocate")
        if lay.device == "cuda":
            if not lay.colocate and lay.rollout_gpus + lay.trainer_gpus != lay.gpus_per_node:
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
