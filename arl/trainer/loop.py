"""The RL loop: processes, the step, weight sync, evaluation and checkpoints.

Processes (one machine; GPU nodes use the same roles on their own devices):
  * the launcher (``python -m arl.train``) builds the model directory and the SFT data, starts
    one rollout process per engine (``rollout.engines``, default 1) and ``trainer.world_size``
    trainer ranks, and waits;
  * a rollout process runs its vLLM engine and the async ``RolloutManager`` (environments in a
    pool, bounded staleness) in one asyncio loop; it hands its share of every batch to trainer
    rank 0 on ``batches`` and takes ``weights`` / ``eval`` / ``stop`` orders on its own ``orders``
    queue (trainer rank 0's end: ``link.RolloutLink``);
  * trainer ranks (DeepSpeed, gloo on CPU) run the SFT warm start, then per step: rank 0 takes a
    batch, packs it for all ranks (``pack_step``), scatters the micro-batches; every rank
    recomputes old logprobs and runs ``updates_per_batch`` optimizer steps; rank 0 writes the new
    weights to shared memory and orders the engine to reload them (policy version + 1).

Determinism: with ``rollout.staleness: 0`` and fixed seeds, step k is generated from version k
on tasks [k*G, (k+1)*G) with per-sample seeds (engine e of E takes the e-th G/E of them), so a
resumed run reproduces an uninterrupted one.
"""
from __future__ import annotations

import asyncio
import os
import queue as queue_mod
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import torch

from ..config import OptimConfig, TrainConfig
from ..data.packer import PackerConfig, pack_step

EVAL_SEED_BASE = 1_000_000  # held-out task seeds (training tasks count up from 0)


# ---------------------------------------------------------------- model and data
def model_dir_for(cfg: TrainConfig) -> str:
    if cfg.model.name_or_path != "tiny":
        return cfg.model.name_or_path
    from ..models.tiny import TinyModelConfig, build_tiny_model

    t = cfg.model.tiny
    tiny = TinyModelConfig(vocab_size=t.vocab_size, hidden_size=t.hidden, num_hidden_layers=t.layers,
                           num_attention_heads=t.heads, num_key_value_heads=t.kv_heads,
                           intermediate_size=t.intermediate, max_position_embeddings=t.max_position,
                           seed=cfg.seed, envs=(cfg.env.name,))
    return str(build_tiny_model(config=tiny))


def make_env_factory(cfg: TrainConfig):
    from ..env import make_env

    name, kwargs = cfg.env.name, dict(cfg.env.kwargs)
    return lambda: make_env(name, **kwargs)


def expert_trajectories(cfg: TrainConfig, model_dir: str, n: int, seed_base: int = 2_000_000) -> list:
    """Expert demonstrations rendered exactly as the rollout renders a model's turns."""
    from transformers import AutoTokenizer

    from ..env import make_env
    from ..rollout.engine import Sample
    from ..rollout.episode import ChatFormat, Episode, EpisodeConfig

    tok = AutoTokenizer.from_pretrained(model_dir)
    fmt = ChatFormat(tok)
    # no faults, no latency, no unsolvable tasks: the expert's fixed turns must stay valid
    env = make_env(cfg.env.name, **{k: v for k, v in cfg.env.kwargs.items() if k not in _FAULT_KEYS})
    ep_cfg = EpisodeConfig(max_turns=cfg.env.max_turns, max_total_tokens=cfg.rollout.max_total_tokens)

    async def one(seed):
        ep = Episode(env, fmt, ep_cfg, seed)
        await ep.start()
        turns = env.expert_turns()
        if turns is None:
            return None
        for text in turns:
            if ep.done:
                break
            ids = fmt.encode(text)
            await ep.apply(Sample(ids, [0.0] * len(ids), text, "stop"))
        t = ep.trajectory()
        return t if t.reward > 0 else None

    async def all_():
        out = []
        for s in range(seed_base, seed_base + 4 * n):
            t = await one(s)
            if t is not None:
                out.append(t)
            if len(out) >= n:
                break
        return out

    return asyncio.run(all_())


# ---------------------------------------------------------------- rollout process
def rollout_process(cfg_dict: dict, model_dir: str, batches, orders, parent_pid: Optional[int] = None,
                    engine: int = 0) -> None:
    """The rollout process of engine ``engine``: its vLLM engine, environments and rollout manager
    (see arl/trainer/link.py for how several engines share a batch).  It starts at the policy
    version of the trainer's first weight sync (a resumed run's step)."""
    if parent_pid is not None:
        from .dist import die_with_parent

        die_with_parent(parent_pid, take_children=True)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = TrainConfig.model_validate(cfg_dict)
    try:
        asyncio.run(_rollout_main(cfg, model_dir, batches, orders, engine))
        batches.put(("stopped", engine))  # trainer rank 0 may now go (under torchrun it serves this queue)
    except BaseException as e:  # tell the trainer instead of leaving it waiting
        where = f"engine {engine}: " if cfg.num_engines() > 1 else ""
        batches.put(("error", f"{where}{type(e).__name__}: {e}"))
        raise


def _next_order(orders, closing) -> Optional[tuple]:
    """One order, or None after a short wait: the executor thread that waits for orders must come
    back by itself, or asyncio's shutdown (which joins it) would hang on an error."""
    while not closing.is_set():
        try:
            return orders.get(timeout=0.5)
        except queue_mod.Empty:
            continue
    return None


async def _evaluate(engine, fmt, cfg: TrainConfig, n: int) -> float:
    from ..rollout.engine import SamplingConfig
    from ..rollout.episode import EpisodeConfig, run_episode

    factory = make_env_factory(cfg)
    ep_cfg = EpisodeConfig(max_turns=cfg.env.max_turns, max_total_tokens=cfg.rollout.max_total_tokens,
                           sampling=SamplingConfig(max_tokens=cfg.rollout.max_turn_tokens, temperature=0.0))
    sem = asyncio.Semaphore(cfg.env.pool_size)

    async def one(i):
        async with sem:
            env = factory()
            try:
                t = await run_episode(engine, env, fmt, EVAL_SEED_BASE + i, ep_cfg)
            finally:
                await env.close()
            return float(t.reward > 0 and t.metadata.get("fault") == "none")

    res = await asyncio.gather(*(one(i) for i in range(n)))
    return float(np.mean(res)) if res else float("nan")


_FAULT_KEYS = ("recoverable_rate", "unrecoverable_rate", "unsolvable_frac", "latency_median_s", "latency_p99_s",
               "tool_timeout_s")


def _ipa_start_hook(cfg: TrainConfig, fmt):
    """``(resampler, start_for)`` for IPA chunk-initialization resampling, or ``(None, None)`` when off:
    ``start_for(seed)`` plays the environment's expert on the task (faults off, so its turns stay
    valid) and returns the start state at the chunk the resampler's schedule picks (parallel mode:
    one of the anchors, by task seed); None when the env has no demonstrator for the task."""
    if not cfg.stabilizers.ipa.enabled:
        return None, None
    from ..env import make_env
    from ..env.expert import expert_transcript
    from ..stabilizers.ipa import IPAResampler, expert_trajectory, start_state

    resampler = IPAResampler(cfg.stabilizers.ipa)
    max_turns = cfg.env.max_turns
    # the expert plays the task as the rollout will see it (unsolvable_frac defines the task: an
    # unsolvable one has no expert prefix and starts fresh), without the run-time faults
    kwargs = {k: v for k, v in cfg.env.kwargs.items() if k not in _FAULT_KEYS or k == "unsolvable_frac"}

    async def start_for(seed: int):
        env = make_env(cfg.env.name, **kwargs)
        try:
            res = await expert_transcript(env, seed)
        finally:
            await env.close()
        if res is None:
            return None
        task, transcript = res
        expert = expert_trajectory(fmt, env.system_prompt, task, transcript, task_seed=seed)
        if expert.reward <= 0 or len(expert.turns) > max_turns:  # failed, or longer than an episode may be
            return None
        ks = resampler.start_chunks(len(expert.turns))
        return start_state(expert, ks[seed % len(ks)])

    return resampler, start_for


def _engine_kwargs(cfg: TrainConfig) -> dict:
    """vLLM arguments of the GPU layout: the rollout GPUs of node 0 as tensor parallel x data parallel."""
    if cfg.layout.device != "cuda":
        return {}
    tp = cfg.rollout.tensor_parallel
    return {"tensor_parallel_size": tp, "data_parallel_size": max(1, cfg.layout.rollout_gpus // tp),
            "gpu_memory_utilization": cfg.rollout.gpu_memory_utilization}


def _rollout_rate(engine, batch) -> dict:
    """This engine's throughput over the interval since its previous batch (the first: since the
    first weights arrived): the batch's tokens (prompt + observations + model turns) and its
    model-turn tokens per second of wall time, and the
    fraction of that time the engine had no call in flight (evaluations count as busy).  With
    several engines the rates add up (``merge_batches``)."""
    from ..metrics import rollout_rates

    st = engine.idle_stats(reset=True)
    return {**rollout_rates(batch.trajectories, max(st["wall_s"], 1e-9)), "rollout/engine_idle_frac": st["idle_frac"]}


async def _rollout_main(cfg: TrainConfig, model_dir: str, batches, orders, engine_index: int = 0) -> None:
    from transformers import AutoTokenizer

    from ..rollout.engine import SamplingConfig, make_engine
    from ..rollout.episode import ChatFormat, EpisodeConfig
    from ..rollout.manager import RolloutConfig, RolloutManager
    from ..stabilizers.dynamic_sampling import fill_batch
    from .link import engine_task_seeds

    r = cfg.rollout
    engine = make_engine(r.engine, model=model_dir, seed=cfg.seed, max_model_len=max(r.max_total_tokens + 64, 256),
                         dtype=cfg.model.dtype, engine_kwargs=_engine_kwargs(cfg))
    fmt = ChatFormat(AutoTokenizer.from_pretrained(model_dir))
    n_engines = cfg.num_engines()
    rcfg = RolloutConfig(
        group_size=r.group_size, groups_per_step=r.tasks_per_step // n_engines, max_staleness=r.staleness,
        env_pool_size=cfg.env.pool_size, max_retries=r.retries, max_filtered_frac=r.filter_cap, seed=cfg.seed,
        episode=EpisodeConfig(max_turns=cfg.env.max_turns, max_total_tokens=r.max_total_tokens,
                              sampling=SamplingConfig(max_tokens=r.max_turn_tokens, temperature=r.temperature,
                                                      top_p=r.top_p)))
    loop = asyncio.get_running_loop()
    synced = asyncio.Event()
    stop = asyncio.Event()
    manager: Optional[RolloutManager] = None
    evals: set = set()

    async def take_orders():
        nonlocal manager
        while not stop.is_set():
            msg = await loop.run_in_executor(None, _next_order, orders, closing)
            if msg is None:
                return
            kind = msg[0]
            if kind == "stop":
                stop.set()
                return
            if kind == "join_sync":  # the weight-sync group: this engine's workers join as receivers
                _, host, port, world, backend = msg
                await engine.join_weight_sync(host, port, world, backend)
            elif kind == "weights":
                _, wdir, version, ipa_state = msg
                if resampler is not None and ipa_state is not None:
                    resampler.load_state_dict(ipa_state)
                if manager is None:
                    await engine.update_weights(wdir, version)
                else:
                    await manager.update_weights(wdir, version)
                synced.set()
            elif kind == "eval":
                _, version, n = msg

                async def run_eval(version=version, n=n):
                    acc = await _evaluate(engine, fmt, cfg, n)
                    await loop.run_in_executor(None, batches.put, ("eval", version, acc))

                t = asyncio.create_task(run_eval())
                evals.add(t)
                t.add_done_callback(evals.discard)

    resampler, start_for = _ipa_start_hook(cfg, fmt)
    closing = threading.Event()
    try:
        orders_task = asyncio.create_task(take_orders())
        await synced.wait()  # the first weights (after SFT / from the checkpoint)
        # the trainer's version decides where the tasks resume (a node's own view of the checkpoint
        # directory may not be the trainer's)
        tasks = engine_task_seeds(engine.version, r.tasks_per_step, engine_index, n_engines)
        engine.idle_stats(reset=True)  # rates count from here, not from the engine's start
        manager = RolloutManager(engine, make_env_factory(cfg), fmt, tasks=tasks, config=rcfg, start_for=start_for,
                                 imitate_once_per_group=cfg.stabilizers.ipa.imitate_once_per_group)
        async with manager:
            while not stop.is_set():
                while manager.step > manager.version + r.staleness and not stop.is_set():
                    await asyncio.sleep(0.02)  # the trainer has not synced the weights this step needs
                if stop.is_set():
                    break
                get = asyncio.create_task(manager.get_batch())
                done, _ = await asyncio.wait({get, orders_task}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    break
                batch = await fill_batch(manager, get.result(), cfg.stabilizers.dynamic_sampling)
                batch.metrics.update(_rollout_rate(engine, batch))
                await loop.run_in_executor(None, batches.put, ("batch", engine_index, batch))
    finally:
        # on an error too: the order-taking thread returns, so asyncio.run's shutdown (which joins it)
        # ends and rollout_process reports the error; and vLLM's engine core must not outlive us
        closing.set()
        for t in list(evals):
            t.cancel()
        await engine.close()


# ---------------------------------------------------------------- trainer ranks
def _all_mean(metrics: dict) -> dict:
    """Average a rank's metric dict over the ranks that report each key (a rank whose micro-batches
    were all empty, or held no RL tokens under IPA, reports fewer keys; the union is agreed first)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return {k: float(v) for k, v in metrics.items()}
    key_sets = [None] * dist.get_world_size()
    dist.all_gather_object(key_sets, sorted(metrics))
    keys = sorted(set().union(*key_sets))
    t = torch.tensor([float(metrics.get(k, 0.0)) for k in keys] + [1.0 if k in metrics else 0.0 for k in keys],
                     dtype=torch.float64)
    dist.all_reduce(t)
    n = len(keys)
    return {k: float(t[i] / t[n + i]) for i, k in enumerate(keys) if t[n + i] > 0}


def _scatter(objs_rank0, rank: int):
    import torch.distributed as dist

    out = [None]
    dist.scatter_object_list(out, objs_rank0 if rank == 0 else None, src=0)
    return out[0]


def _bcast(obj, rank: int):
    import torch.distributed as dist

    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _engine_mismatch(mbs, old) -> dict:
    """``logp_abs_diff_vs_rollout``: mean |trainer logprob - engine logprob| over the trained tokens
    of this rank, before the update.  Precision mismatch plus the drift of stale samples; at
    staleness 0 it checks that the engine runs the trainer's weights.  IPA micro-batches (replayed
    expert tokens have no engine logprob) are left out."""
    num, den = 0.0, 0.0
    for mb, o in zip(mbs, old):
        if o is None or mb.ipa is not None:
            continue
        mask = mb.loss_mask.to(o.device, torch.float32)
        num += float(((o - mb.rollout_logp.to(o.device, o.dtype)).abs() * mask).sum())
        den += float(mask.sum())
    return {"logp_abs_diff_vs_rollout": num / den} if den > 0 else {}


def _engine_workers(cfg: TrainConfig) -> int:
    """Processes of ONE rollout engine that hold weights (its receivers in the weight-sync group)."""
    kw = _engine_kwargs(cfg)
    return kw.get("tensor_parallel_size", 1) * kw.get("data_parallel_size", 1)


def _latest_checkpoint(ckpt_dir: Path) -> Optional[int]:
    f = ckpt_dir / "latest_step"
    return int(f.read_text()) if f.exists() else None


def _reference_model(cfg: TrainConfig, model, model_dir: str, run_dir: Path, rank: int, fresh: bool, sft_done: bool,
                     dtype: torch.dtype):
    """The frozen reference policy for the KL term (``trainer.reference_model``): the policy RL starts
    from.  After an SFT warm start that is the SFT model, saved once to ``<run>/reference`` so a
    resumed run (whose policy has moved on) loads the same reference; without SFT it is the model
    directory itself."""
    if not cfg.trainer.reference_model:
        return None
    from transformers import AutoModelForCausalLM

    ref_dir = run_dir / "reference"
    if fresh and sft_done:
        if rank == 0:
            model.save_pretrained(str(ref_dir), safe_serialization=True)
        import torch.distributed as dist

        dist.barrier()
    saved = (ref_dir / "config.json").exists()
    sft_run = cfg.sft.enabled and cfg.sft.steps > 0
    if not fresh and sft_run and not saved:
        raise ValueError(f"--resume: the reference model of this run ({ref_dir}) is missing")
    # a fresh run without SFT starts from model_dir, whatever an earlier run left in output_dir
    src = ref_dir if saved and (sft_done or (not fresh and sft_run)) else Path(model_dir)
    return AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype)


def run_sft(cfg: TrainConfig, model, demos: list, rank: int, world: int) -> Tuple[dict, Optional[dict]]:
    """SFT warm start of ``model`` in place; returns the last step's metrics and, under ZeRO-3 (whose
    engine leaves ``model``'s parameters partitioned), the gathered state dict on every rank."""
    from . import PolicyTrainer

    s = cfg.sft
    optim = OptimConfig(lr=s.lr, grad_clip=cfg.trainer.optim.grad_clip)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.model.dtype]
    tr = PolicyTrainer(model, optim=optim, zero_stage=cfg.trainer.zero_stage, total_steps=max(s.steps, 1),
                       dtype=dtype, attn=cfg.model.attn_implementation)
    rng = random.Random(cfg.seed)
    per_step = max(world, min(len(demos), 32))
    last = {}
    for step in range(s.steps):
        batch = rng.sample(demos, per_step) if len(demos) >= per_step else demos
        packed = pack_step(batch, PackerConfig(token_budget=s.micro_batch_tokens, num_ranks=world, seed=step))
        last = tr.sft_step(packed.ranks[rank], normalizer=packed.normalizer)
    return last, (tr.full_state_dict(rank0_only=False) if tr.zero3 else None)


class _OrderedLog:
    """Step records wait for the held-out evaluation of their policy version (which runs in the
    rollout process, concurrently with training) and are written in step order."""

    def __init__(self, logger, eval_versions: set):
        self.logger, self.eval_versions, self.pending, self.evals = logger, eval_versions, [], {}

    def add(self, step: int, record: dict, wall_s: float) -> None:
        self.pending.append((step, record, wall_s))
        self.flush()

    def eval_result(self, version: int, success: float) -> None:
        self.evals[version] = success
        self.flush()

    def waiting(self) -> bool:
        return any(s in self.eval_versions and s not in self.evals for s, _, _ in self.pending)

    def flush(self, force: bool = False) -> None:
        while self.pending:
            step, rec, wall = self.pending[0]
            if step in self.eval_versions and step not in self.evals and not force:
                return
            if step in self.evals:
                rec["success/heldout"] = self.evals[step]
            self.logger.log(step, rec, wall_s=wall)
            self.pending.pop(0)


def trainer_rank(rank: int, world: int, port: Optional[int], cfg_dict: dict, model_dir: str, demos: list, batches,
                 orders, resume: bool, parent_pid: Optional[int] = None, sync_addr: Optional[tuple] = None) -> None:
    """One trainer rank.  ``port``: the trainers' rendezvous port on this machine (the spawn
    launcher), or None when the environment is already set (torchrun / deepspeed launcher).
    ``batches`` / ``orders`` (rank 0 only): the queue from the rollout processes and the list of
    queues to them, one per engine.  ``sync_addr``: (host, port) of the weight-sync group, for
    ``rollout.weight_sync: group``."""
    if parent_pid is not None:
        from .dist import die_with_parent

        die_with_parent(parent_pid)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..metrics import trajectory_metrics
    from ..rollout.engine import write_sync_weights
    from ..rollout.weight_sync import FromGroup, make_group, send, sender_backend, tensor_meta
    from ..stabilizers import Stabilizers
    from . import PolicyTrainer
    from .dist import init_distributed, set_rank_env

    cfg = TrainConfig.model_validate(cfg_dict)
    if port is not None:
        set_rank_env(rank, world, port)
    init_distributed(cfg.layout.device)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    if cfg.trainer.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    run_dir = Path(cfg.output_dir)
    ckpt_dir = run_dir / "checkpoints"
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    weights_dir = shm / f"arl-weights-{os.environ['MASTER_PORT']}"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.model.dtype]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def load_policy():
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        if cfg.model.gradient_checkpointing:  # activations of one layer at a time (the layout's estimate)
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m

    model = load_policy()
    t0 = time.perf_counter()
    steps = cfg.trainer.steps
    resume_step = _latest_checkpoint(ckpt_dir) if resume else None
    evals = set()
    if cfg.env.eval_tasks:
        evals = {v for v in range(0, steps + 1) if v % cfg.trainer.eval_every == 0 or v == steps}
    log = link = None
    if rank == 0:
        from ..metrics import MetricsLogger
        from .link import RolloutLink

        lg = cfg.logging
        log = _OrderedLog(MetricsLogger(run_dir, jsonl=lg.jsonl, tensorboard=lg.tensorboard, progress=lg.progress,
                                        total_steps=steps, resume_step=resume_step), evals)
        link = RolloutLink(batches, orders, on_eval=log.eval_result)

    sft_metrics = {}
    if cfg.sft.enabled and resume_step is None and cfg.sft.steps > 0:
        sft_out, sft_state = run_sft(cfg, model, demos, rank, world)
        sft_metrics = {f"sft/{k}": v for k, v in sft_out.items()}
        sft_metrics["sft/wall_s"] = time.perf_counter() - t0
        if sft_state is not None:  # ZeRO-3 partitioned the SFT model: the RL engine starts from a whole copy
            model = load_policy()
            model.load_state_dict(sft_state)

    ref_model = _reference_model(cfg, model, model_dir, run_dir, rank, fresh=resume_step is None,
                                 sft_done=bool(sft_metrics), dtype=dtype)
    tr = PolicyTrainer(model, optim=cfg.trainer.optim, zero_stage=cfg.trainer.zero_stage, total_steps=steps,
                       dtype=dtype, loss_backend=cfg.trainer.backend, temperature=cfg.rollout.temperature,
                       ref_model=ref_model, attn=cfg.model.attn_implementation)
    stab = Stabilizers(cfg.stabilizers, cfg.loss, decode=tokenizer.decode) if rank == 0 else None
    start_step, wall_offset = 0, 0.0
    if resume_step is not None:
        state = tr.load_checkpoint(str(ckpt_dir), tag=f"step{resume_step}")
        start_step, wall_offset = int(state["step"]), float(state.get("wall_s", 0.0))
        if stab is not None and state.get("stabilizers"):
            stab.load_state_dict(state["stabilizers"])

    def wall() -> float:
        return wall_offset + time.perf_counter() - t0

    sync_mode = cfg.rollout.sync_mode(cfg.layout.device)
    if sync_mode == "group" and sync_addr is None:
        raise ValueError("rollout.weight_sync: 'group' needs the launcher's weight-sync address")
    sync_group = None

    def sync_weights(version: int) -> None:
        nonlocal sync_group
        # a collective under ZeRO-3 (partitioned weights are gathered); for NCCL the tensors stay on the GPU
        state = tr.full_state_dict(to_cpu=sync_mode == "file" or tr.device.type != "cuda")
        if rank == 0:
            # the IPA resampler's schedule lives with the trainer (it advances on the step's success)
            ipa = stab.ipa.state_dict() if cfg.stabilizers.ipa.enabled else None
            if sync_mode == "group":
                if sync_group is None:  # first sync: the engines' workers join, then every sync is broadcasts
                    n, backend = 1 + link.engines * _engine_workers(cfg), sender_backend(tr.device)
                    link.broadcast(("join_sync", sync_addr[0], sync_addr[1], n, backend))  # rank 0 is the source
                    sync_group = make_group(sync_addr[0], sync_addr[1], 0, n, backend)
                link.broadcast(("weights", FromGroup(tensor_meta(state)), version, ipa))
                send(sync_group, state, tr.device)  # returns once every engine has received every tensor
            else:
                write_sync_weights(state, weights_dir)
                link.broadcast(("weights", str(weights_dir), version, ipa))
            if version in evals:  # one engine evaluates (the held-out tasks are not split)
                link.send(0, ("eval", version, cfg.env.eval_tasks))

    def checkpoint(version: int) -> None:
        client = {"step": version, "wall_s": wall(), "stabilizers": stab.state_dict() if stab is not None else None}
        tr.save_checkpoint(str(ckpt_dir), tag=f"step{version}", client_state=_bcast(client, rank))
        if rank == 0:
            (ckpt_dir / "latest_step").write_text(str(version))

    finished = False
    sync_weights(start_step)
    if rank == 0 and resume_step is None and (sft_metrics or 0 in evals):
        log.add(0, dict(sft_metrics), wall())
    success = None
    version = start_step
    try:
        for step in range(start_step, steps):
            ts = time.perf_counter()
            if rank == 0:
                batch = link.next_batch()
                prep = stab.prepare(batch.trainable())
                loss_cfg = stab.loss_config(step, success)
                packed = pack_step(prep.trajectories, PackerConfig(
                    token_budget=cfg.trainer.micro_batch_tokens, num_ranks=world, seed=cfg.seed + step), loss_cfg)
                stab.apply(packed, prep, loss_cfg)  # the step's (stabilized) advantages, IPA loss roles
                parts = packed.ranks
                extra = {**batch.metrics, **prep.metrics, **trajectory_metrics(
                    batch.trajectories, current_version=step, adv_norm=loss_cfg.adv_norm, adv_eps=loss_cfg.adv_eps)}
                success = extra.get("success/train")
            else:
                parts, loss_cfg, extra = None, None, None
            mbs = _scatter(parts, rank)
            loss_cfg = _bcast(loss_cfg, rank)
            wait_s = time.perf_counter() - ts
            old = tr.old_logprobs(mbs)
            ref = tr.ref_logprobs(mbs) if loss_cfg.kl_beta > 0 else None
            m = {}
            for _ in range(cfg.trainer.updates_per_batch):
                m = tr.rl_step(mbs, old, loss_cfg, ref_logps=ref)
            tokens = float(sum(mb.num_tokens for mb in mbs))
            m.update(_engine_mismatch(mbs, old))
            m = _all_mean(m)
            version = step + 1
            # one decision for every rank (each has its own clock: ranks that disagree would hang)
            out_of_time = _bcast(cfg.trainer.max_wall_s is not None and wall() > cfg.trainer.max_wall_s, rank)
            if out_of_time and cfg.env.eval_tasks:
                evals.add(version)  # the policy the run ends with is evaluated too
            sync_weights(version)
            step_s = time.perf_counter() - ts
            decision = None
            if rank == 0:
                rec = {"time/step_s": step_s, "time/wait_rollout_s": wait_s,
                       "perf/train_tokens_per_s": tokens * world / max(step_s - wait_s, 1e-9),
                       **{f"train/{k}": v for k, v in m.items()}, **extra}
                decision = stab.after_step(version, rec, success)
                rec.update(stab.stab_metrics())
                log.add(version, rec, wall())
            action = _bcast(decision.action if decision is not None else "continue", rank)
            if version % cfg.trainer.checkpoint_every == 0 or version == steps or out_of_time:
                checkpoint(version)
            if action == "stop":
                if rank == 0:
                    print(f"arl.train: stopped by the behaviour alarm at step {version}: {decision.reason}")
                break
            if action == "rollback":
                last = _latest_checkpoint(ckpt_dir)
                if last is not None:  # model + optimizer back to the last checkpoint; versions keep counting
                    state = tr.load_checkpoint(str(ckpt_dir), tag=f"step{last}")
                    if stab is not None and state.get("stabilizers"):
                        stab.load_state_dict(state["stabilizers"])
                    sync_weights(version)
            if out_of_time:
                break
        if rank == 0:  # wait for the outstanding evaluations, then write every record
            deadline = time.time() + 900
            while log.waiting() and time.time() < deadline:
                link.poll(5.0)
            log.flush(force=True)
            log.logger.close()
        tr.export_hf(str(run_dir / "hf"), tokenizer=tokenizer if rank == 0 else None)
        finished = True
    except BaseException:
        # the launcher reports only the first rank to fail, often a peer's "connection closed":
        # each rank prints its own cause
        print(f"arl.train: trainer rank {rank} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        raise
    finally:
        if rank == 0:
            link.broadcast(("stop",))
            if finished:  # under torchrun this rank serves the queues: stay until the rollout side is done
                link.wait_stopped(timeout_s=120)
            shutil.rmtree(weights_dir, ignore_errors=True)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------- launcher
def launch(cfg: TrainConfig, resume: bool = False) -> Path:
    """Run SFT + RL with ``cfg``; returns the run directory (metrics.jsonl, checkpoints, hf/)."""
    import torch.multiprocessing as mp

    from .dist import free_port

    if cfg.layout.device != "cpu":
        raise ValueError("layout.device: 'cuda' configs run one process per GPU: launch them with torchrun or "
                         "deepspeed (see README), not plain python")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model_dir = model_dir_for(cfg)
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    demos = expert_trajectories(cfg, model_dir, cfg.sft.episodes) if cfg.sft.enabled else []
    ctx = mp.get_context("spawn")
    batches, orders = ctx.Queue(), [ctx.Queue() for _ in range(cfg.num_engines())]
    me = os.getpid()  # children die with the launcher (die_with_parent), also when it is SIGKILLed
    rolls = [ctx.Process(target=rollout_process, args=(cfg.model_dump(), model_dir, batches, q, me, e),
                         daemon=False, name=f"arl-rollout-{e}")  # vLLM may start helper processes
             for e, q in enumerate(orders)]
    for roll in rolls:
        roll.start()
    try:
        sync_addr = ("127.0.0.1", free_port())  # used with rollout.weight_sync: group
        mp.start_processes(trainer_rank, args=(cfg.trainer.world_size, free_port(), cfg.model_dump(), model_dir, demos,
                                               batches, orders, resume, me, sync_addr),
                           nprocs=cfg.trainer.world_size, join=True, start_method="spawn")
    finally:
        for roll in rolls:
            roll.join(timeout=60)
            if roll.is_alive():
                roll.terminate()
    return run_dir
