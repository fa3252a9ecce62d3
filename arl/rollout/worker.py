"""The rollout process: one vLLM engine, its environments and the async ``RolloutManager``, in one
asyncio loop.

It hands its share of every batch to trainer rank 0 on ``batches`` and takes orders on its own
``orders`` queue (trainer rank 0's end is ``arl.trainer.link.RolloutLink``):

  ``("join_sync", host, port, world, backend, epoch)``  the engine's workers join the weight-sync
                                                 group (number ``epoch``: a new one after a restart);
  ``("weights", source, version, chooser_state)`` new weights (a directory, or ``FromGroup``);
  ``("eval", version, n)``                       greedy held-out evaluation on ``n`` tasks;
  ``("start", step)``                            (before the first weights) the first batch to make:
                                                 a resumed run's checkpoint holds the ones before it;
  ``("stop",)``.

It sends ``("batch", engine, RolloutBatch)``, ``("eval", version, success, samples)``, ``("stopped", engine)``
or ``("error", text)``.  Tasks start at the policy version of the trainer's first weight sync (a
resumed run's step).  The stabilizers' judges reach this process as ``RolloutHooks`` built by the
launcher; the rollout side only acts on what they decide.
"""
from __future__ import annotations

import asyncio
import functools
import json
import os
import queue as queue_mod
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from transformers import AutoTokenizer

from ..config import TrainConfig
from ..data import EVAL_SEED_BASE, TaskSet
from ..data.trajectory import Trajectory
from ..env import env_kwargs, make_env
from ..metrics import rollout_rates
from ..procs import die_with_parent
from .channel import Channel
from .colocate import make_schedule, mark_ready, sleep_mode_kwargs
from .engine import RolloutEngine, SamplingConfig, make_engine
from .engine_args import build_engine_args, check_engine_kwargs
from .lora_sync import engine_lora_kwargs, lora_sync_mode
from .episode import ChatFormat, EpisodeConfig, run_episode
from .transcript import format_transcript, transcript
from .weight_sync import WeightSyncBroken
from .expert import StartChooser, expert_start_hook
from .manager import REWARD_EXCEPTIONS_SHOWN, RolloutManager, fill_batch


@dataclass
class RolloutHooks:
    """What the stabilizers decide for the rollout side (picklable: built by the launcher).
    ``make_sampler(target_groups)``: dynamic sampling's judge (None: off); ``start_chooser``: IPA's
    start-chunk schedule (None: off)."""

    make_sampler: Optional[Callable] = None
    start_chooser: Optional[StartChooser] = None


def engine_kwargs(cfg: TrainConfig, serve_adapters: bool = True) -> dict:
    """vLLM arguments of the layout, then the user's ``rollout.engine_kwargs``: on GPU a node's
    rollout GPUs as tensor parallel x data parallel (colocated: all of its GPUs, with sleep mode);
    vLLM's LoRA when the run syncs adapters (``rollout.lora_sync: adapter``) unless
    ``serve_adapters`` is off (an engine over an exported, merged model: ``arl.eval``)."""
    kw = {}
    if cfg.layout.device == "cuda":
        tp = cfg.rollout.tensor_parallel
        gpus = (cfg.ray.gpus_per_engine if cfg.launcher_used() == "ray" else None) or cfg.layout.rollout_gpus
        kw = {"tensor_parallel_size": tp, "data_parallel_size": max(1, gpus // tp),
              "gpu_memory_utilization": cfg.rollout.gpu_memory_utilization, **sleep_mode_kwargs(cfg)}
        if cfg.launcher_used() == "ray" and gpus > 1:  # the engine's workers: processes of its actor, on its
            kw["distributed_executor_backend"] = "mp"  # bundle's GPUs (in a placement group vLLM would pick Ray)
    if serve_adapters and lora_sync_mode(cfg) == "adapter":
        kw.update(engine_lora_kwargs(cfg.model.lora.r))
    return {**kw, **cfg.rollout.engine_kwargs}


def engine_max_model_len(cfg: TrainConfig) -> int:
    return max(cfg.rollout.max_total_tokens + 64, 256)


def engine_args(cfg: TrainConfig, model_dir: Optional[str] = None) -> dict:
    """Every argument a rollout engine of this config is made with (what ``run_engine`` passes to
    vLLM; the dry run prints it).  ``model_dir``: None shows ``model.name_or_path``."""
    return build_engine_args(model_dir or cfg.model.name_or_path, device=cfg.layout.device, seed=cfg.seed,
                             dtype=cfg.model.dtype, max_model_len=engine_max_model_len(cfg), extra=engine_kwargs(cfg))


def engine_workers(cfg: TrainConfig) -> int:
    """Processes of ONE engine that hold weights (its receivers in the weight-sync group)."""
    kw = engine_kwargs(cfg)
    return kw.get("tensor_parallel_size", 1) * kw.get("data_parallel_size", 1)


def episode_config(cfg: TrainConfig, greedy: bool = False) -> EpisodeConfig:
    """Episode limits and per-turn sampling of the run (``greedy``: evaluation)."""
    r = cfg.rollout
    sampling = (SamplingConfig(max_tokens=r.max_turn_tokens, temperature=0.0) if greedy else
                SamplingConfig(max_tokens=r.max_turn_tokens, temperature=r.temperature, top_p=r.top_p))
    return EpisodeConfig(max_turns=cfg.env.max_turns, max_total_tokens=r.max_total_tokens, sampling=sampling)


def env_factory(cfg: TrainConfig, model_dir: Optional[str] = None) -> Callable:
    """Makes the run's environment (``model_dir``: the tokenizer of a vLLM tool-call parser)."""
    name, kwargs = cfg.env.name, env_kwargs(cfg.env, model_dir)
    return lambda: make_env(name, **kwargs)


def task_set(cfg: TrainConfig) -> Optional[TaskSet]:
    """The run's tasks from data (``env.dataset``), or None when the env makes tasks from seeds."""
    return TaskSet.from_config(cfg.env.dataset, cfg.seed) if cfg.env.dataset is not None else None


def engine_task_seeds(step: int, tasks_per_step: int, engine: int, engines: int):
    """Task seeds of engine ``engine`` from batch ``step`` on: batch ``s`` of the whole run holds
    the seeds ``s * tasks_per_step ...`` and engine ``e`` takes the ``e``-th equal share of them."""
    share = tasks_per_step // engines
    s = step
    while True:
        base = s * tasks_per_step + engine * share
        yield from range(base, base + share)
        s += 1


def run_engine(cfg: TrainConfig, model_dir: str, serve_adapters: bool = True) -> RolloutEngine:
    """The run's rollout engine over the weights in ``model_dir`` (also ``python -m arl.eval``'s,
    over a merged export: ``serve_adapters=False``, no vLLM LoRA, see ``engine_kwargs``)."""
    r = cfg.rollout
    check_engine_kwargs(r.engine_kwargs)  # launchers checked it already (preflight); cached, cheap
    return make_engine(r.engine, model=model_dir, seed=cfg.seed, dtype=cfg.model.dtype,
                       max_model_len=engine_max_model_len(cfg), engine_kwargs=engine_kwargs(cfg, serve_adapters),
                       device=cfg.layout.device)


def eval_record(task: int, t: Trajectory) -> dict:
    """One held-out episode as a row: a success is a positive reward without a fault."""
    m = t.metadata
    fault = m.get("fault", "none")
    return {"task": task, "seed": EVAL_SEED_BASE + task, "reward": float(t.reward),
            "success": bool(t.reward > 0 and fault == "none"), "turns": len(t.turns),
            "tool_calls": int(m.get("tool_calls", 0)), "tool_errors": int(m.get("tool_errors", 0)), "fault": fault,
            "fault_reason": m.get("fault_reason") if fault != "none" else None, "truncated": m.get("truncated"),
            "reward_exception": m.get("reward_exception")}


async def evaluate_tasks(engine, fmt: ChatFormat, cfg: TrainConfig, n: int, tasks: Optional[TaskSet] = None,
                         transcripts: bool = False) -> list:
    """Greedy episodes on the ``n`` held-out tasks (seeds ``EVAL_SEED_BASE + i``; with a dataset,
    its held-out rows, at most ``tasks.n_eval``), ``eval_record`` rows in task order
    (``transcripts``: each with its ``transcript``, arl/rollout/transcript.py)."""
    factory, ep_cfg = env_factory(cfg, fmt.tokenizer.name_or_path), episode_config(cfg, greedy=True)
    sem = asyncio.Semaphore(cfg.env.pool_size)
    n = n if tasks is None else min(n, tasks.n_eval)  # a dataset has n_eval held-out rows

    async def one(i):
        seed = EVAL_SEED_BASE + i
        async with sem:
            env = factory()
            try:
                t = await run_episode(engine, env, fmt, seed, ep_cfg, task=tasks.row(seed) if tasks else None)
            finally:
                await env.close()
            rec = eval_record(i, t)
            if transcripts:
                rec["transcript"] = transcript(fmt, t)
            return rec

    rows = list(await asyncio.gather(*(one(i) for i in range(n))))
    raised = [r for r in rows if r["reward_exception"]]
    for r in raised[:REWARD_EXCEPTIONS_SHOWN]:  # a reward bug must not read as a model that never succeeds
        where = tasks.origin(r["seed"]) if tasks is not None else f"task seed {r['seed']}"
        print(f"arl: reward_fn raised {r['reward_exception']} ({where})", file=sys.stderr)
    if rows and len(raised) == len(rows):
        raise RuntimeError(f"reward_fn raised on every held-out episode ({len(rows)} of {len(rows)}; last: "
                           f"{raised[-1]['reward_exception']}); fix env.reward_fn (python -m arl.train --dry-run "
                           "runs it once)")
    return rows


async def evaluate(engine, fmt: ChatFormat, cfg: TrainConfig, n: int, tasks: Optional[TaskSet] = None,
                   save_to: Optional[str] = None) -> float:
    """Greedy success rate on the ``n`` held-out tasks (the run's ``success/heldout``).
    ``save_to``: also write every episode's row and transcript there (JSONL)."""
    res = await evaluate_tasks(engine, fmt, cfg, n, tasks, transcripts=save_to is not None)
    save_rows(res, save_to)
    return success_of(res)


def success_of(rows: list) -> float:
    return float(np.mean([r["success"] for r in rows])) if rows else float("nan")


def save_rows(rows: list, save_to: Optional[str]) -> None:
    """Every evaluated episode's row (and transcript) to ``save_to`` as JSONL; a failed write is one
    line on stderr (a full disk must not stop the run)."""
    if save_to is None:
        return
    try:
        os.makedirs(os.path.dirname(save_to), exist_ok=True)
        with open(save_to, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    except OSError as e:
        print(f"arl: held-out transcripts not written to {save_to}: {e}", file=sys.stderr)


def eval_samples(rows: list, k: int) -> list:
    """The first ``k`` evaluated episodes as W&B table rows (``logging.wandb.samples``)."""
    return [{"seed": r["seed"], "success": r["success"], "reward": r["reward"],
             "transcript": format_transcript(r)} for r in rows[:k] if "transcript" in r]


def rollout_rate(engine, batch) -> dict:
    """This engine's throughput since its previous batch (the first: since the first weights
    arrived): all tokens and model-turn tokens per second, and the fraction of that time the engine
    had no call in flight (evaluations count as busy).  Several engines' rates add up."""
    st = engine.idle_stats(reset=True)
    out = {**rollout_rates(batch.trajectories, max(st["wall_s"], 1e-9)), "rollout/engine_idle_frac": st["idle_frac"]}
    if st.get("load_s") is not None:  # the engine's last weight load (the engine side of the weight sync)
        out["rollout/weights_load_s_max"] = st["load_s"]
    return out


def rollout_process(cfg_dict: dict, model_dir: str, batches: Channel, orders: Channel, parent_pid: Optional[int] = None,
                    engine: int = 0, hooks: Optional[RolloutHooks] = None, ready_file=None,
                    restarted: bool = False) -> None:
    """Entry point of engine ``engine``'s rollout process (spawned by the local launcher, or a Ray actor).
    ``ready_file``: marked once the engine is up (colocated: and asleep), for the launcher: a path,
    or a Ray run's mailbox box (``mark_ready``).
    ``restarted``: a Ray restart of a dead engine: it says so on ``batches`` and ignores the orders
    meant for its former self until the trainer's ``("start", step)`` (arl/trainer/restarts.py)."""
    if parent_pid is not None:
        die_with_parent(parent_pid, take_children=True)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = TrainConfig.model_validate(cfg_dict)
    if restarted:  # trainer rank 0 answers with ("start", next batch) and the current weights
        batches.put(("restarted", engine))
    try:
        worker = RolloutWorker(cfg, model_dir, batches, orders, engine, hooks or RolloutHooks(), ready_file, restarted)
        asyncio.run(worker.run())
        batches.put(("stopped", engine))  # trainer rank 0 may now go
    except BaseException as e:  # tell the trainer instead of leaving it waiting
        where = f"engine {engine}: " if cfg.num_engines() > 1 else ""
        batches.put(("error", f"{where}{type(e).__name__}: {e}"))
        raise


class RolloutWorker:
    def __init__(self, cfg: TrainConfig, model_dir: str, batches, orders, index: int, hooks: RolloutHooks,
                 ready_file=None, restarted: bool = False):
        self.cfg, self.model_dir, self.batches, self.orders, self.index = cfg, model_dir, batches, orders, index
        self.hooks, self.ready_file = hooks, ready_file
        self.engine = self.fmt = self.manager = self.tasks = self.schedule = None
        self.synced, self.stop = asyncio.Event(), asyncio.Event()
        self.closing = threading.Event()  # the order-taking thread returns once this is set
        self.evals: set = set()
        self.first_step: Optional[int] = None  # None: the version of the first weights
        self.restarted = restarted  # until the trainer's "start": orders to the engine that died

    async def run(self) -> None:
        cfg, r = self.cfg, self.cfg.rollout
        self.engine = run_engine(cfg, self.model_dir)
        self.fmt = ChatFormat(AutoTokenizer.from_pretrained(self.model_dir))
        self.tasks = task_set(cfg)
        self.schedule = make_schedule(cfg, self.engine)  # who has the device when (arl/rollout/colocate.py)
        try:
            await self.schedule.started()
            mark_ready(self.ready_file, self.index)
            orders = asyncio.create_task(self._take_orders())
            await self.synced.wait()  # the first weights (after SFT / from the checkpoint)
            n_engines = cfg.num_engines()
            # the trainer's version decides where the tasks resume (this node's own view of the
            # checkpoint directory may not be the trainer's)
            first = self.engine.version if self.first_step is None else self.first_step
            tasks = engine_task_seeds(first, r.tasks_per_step, self.index, n_engines)
            self.engine.idle_stats(reset=True)  # rates count from here, not from the engine's start
            chooser = self.hooks.start_chooser
            self.manager = RolloutManager(
                self.engine, env_factory(cfg, self.model_dir), self.fmt, tasks=tasks, config=r,
                groups_per_step=r.tasks_per_step // n_engines, pool_size=cfg.env.pool_size,
                episode=episode_config(cfg), seed=cfg.seed, task_row=self.tasks.row if self.tasks else None,
                task_origin=self.tasks.origin if self.tasks else None,
                start_for=expert_start_hook(cfg, self.fmt, chooser) if chooser is not None else None,
                imitate_once_per_group=cfg.stabilizers.ipa.imitate_once_per_group, first_step=first,
                in_order=cfg.trainer.deterministic)
            async with self.manager:
                await self._produce(orders)
        finally:
            # on an error too: the order-taking thread returns, so asyncio.run's shutdown (which
            # joins it) ends and the error is reported; and vLLM's engine core must not outlive us
            self.closing.set()
            for t in list(self.evals):
                t.cancel()
            await self.engine.close()

    async def _produce(self, orders: asyncio.Task) -> None:
        """Batches until the trainer says stop: each waits for the weights its step needs, is
        filled up by dynamic sampling, and goes to trainer rank 0."""
        loop = asyncio.get_running_loop()
        while not self.stop.is_set():
            step = asyncio.create_task(self._next_batch())
            done, _ = await asyncio.wait({step, orders}, return_when=asyncio.FIRST_COMPLETED)
            if step not in done:  # stopped (or the order thread failed) while waiting
                step.cancel()
                if orders.done() and orders.exception() is not None:
                    raise orders.exception()
                return
            batch = step.result()
            batch.metrics.update({**rollout_rate(self.engine, batch), **self.schedule.metrics()})
            await self.schedule.batch_done()  # before the trainer has the batch: it may take the device
            await loop.run_in_executor(None, self.batches.put, ("batch", self.index, batch))

    async def _next_batch(self):
        await self.manager.wait_for_weights()
        batch = await self.manager.get_batch()
        return await fill_batch(self.manager, batch, self.hooks.make_sampler)

    def _next_order(self) -> Optional[tuple]:
        """One order, or None after a short wait (run in a thread): the thread must come back by
        itself, or asyncio's shutdown, which joins it, would hang on an error."""
        while not self.closing.is_set():
            try:
                return self.orders.get(timeout=0.5)
            except queue_mod.Empty:
                continue
        return None

    async def _take_orders(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stop.is_set():
            msg = await loop.run_in_executor(None, self._next_order)
            if msg is None:
                return
            kind = msg[0]
            if self.restarted and kind not in ("start", "stop"):
                continue
            if kind == "stop":
                self.stop.set()
                return
            if kind == "join_sync":
                if not await self.engine.join_weight_sync(*msg[1:]):  # host, port, world, backend, epoch
                    print(f"arl.train: engine {self.index}: weight-sync group {msg[5]} given up before it formed (an "
                          "engine restarted); joining the newer one", flush=True)
            elif kind == "start":
                self.first_step, self.restarted = int(msg[1]), False
            elif kind == "weights":
                await self._load_weights(*msg[1:])
            elif kind == "eval":
                t = asyncio.create_task(self._evaluate(*msg[1:]))
                self.evals.add(t)
                t.add_done_callback(self.evals.discard)
            else:
                raise RuntimeError(f"rollout worker: unknown order {kind!r}")

    async def _load_weights(self, source, version: int, chooser_state: Optional[dict]) -> None:
        if self.hooks.start_chooser is not None and chooser_state is not None:
            self.hooks.start_chooser.load_state_dict(chooser_state)
        if self.manager is None:
            load = functools.partial(self.engine.update_weights, source, version)
        else:  # opens the manager's generation gate by one step
            load = functools.partial(self.manager.update_weights, source, version)
        try:
            await self.schedule.load_weights(load)
        except WeightSyncBroken as e:  # the engine stays shut until the trainer's new group brings the weights
            print(f"arl.train: engine {self.index}: {e}; waiting for the trainer's new group", flush=True)
            return
        self.synced.set()

    async def _evaluate(self, version: int, n: int) -> None:
        path = os.path.join(self.cfg.output_dir, "transcripts", f"heldout_step{version}.jsonl") \
            if self.index == 0 else None  # one engine writes (the others evaluate the same tasks)
        k = self.cfg.logging.wandb.samples if self.cfg.logging.wandb is not None else 0
        rows = await evaluate_tasks(self.engine, self.fmt, self.cfg, n, self.tasks,
                                    transcripts=path is not None or k > 0)
        save_rows(rows, path)
        msg = ("eval", version, success_of(rows), eval_samples(rows, k))
        await asyncio.get_running_loop().run_in_executor(None, self.batches.put, msg)
