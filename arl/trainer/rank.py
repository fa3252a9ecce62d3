"""A trainer rank: set-up (model, SFT warm start, reference, resume), then the RL steps.

One step, as ``TrainerRank.step`` reads:

    batch -> advantages -> pack -> loss roles (arl/algo)      trainer rank 0, then scattered
    [old] / reference logprobs -> update                      every rank (DeepSpeed)
    weight sync -> log -> checkpoint                          every rank joins; rank 0 sends and writes

Trainer rank 0 also holds the stabilizers' state and the link to the rollout processes.
Determinism: with ``trainer.deterministic: true`` and fixed seeds, step k is generated from version
max(0, k - staleness) on tasks [k*G, (k+1)*G) with per-sample seeds (arl/rollout/manager.py,
``in_order``); a checkpoint holds the batches in flight, so a resumed run reproduces an
uninterrupted one (tests/test_train_e2e.py says where bitwise and where not).
"""
from __future__ import annotations

import os
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from transformers import AutoTokenizer

from ..algo.step import prepare_step
from ..config import TrainConfig
from ..data.packer import PackerConfig
from ..data.share_report import log_share
from ..metrics import MetricsLogger, trajectory_metrics
from ..model.lora import merge_and_rewrap
from ..procs import die_with_parent
from ..stabilizers import Stabilizers
from . import faults
from .checkpoints import CONFIG_FILE, checkpoint_tag, latest_checkpoint, load_rollouts, save_rollouts, write_checkpoint
from .dist import (ScatterParts, all_mean, barrier, broadcast_from_rank0, init_distributed, set_rank_env,
                   shutdown)
from .link import RolloutLink
from .memory import release_freed_memory
from .restarts import restart_note, resync_engine
from .models import dtype_of, load_policy, reference_model
from .policy import COUNT_METRICS, PolicyTrainer
from .sft import run_sft
from .step_log import OrderedLog
from .sync import make_sender


def trainer_rank(rank: int, world: int, port: Optional[int], cfg_dict: dict, model_dir: str, demos: list, batches,
                 orders, resume: bool, parent_pid: Optional[int] = None, sync_addr: Optional[tuple] = None,
                 parts=None) -> None:
    """Entry point of one trainer rank.  ``port``: the trainers' rendezvous port on this machine (the
    local launcher), or None when the environment is already set (a Ray trainer actor).
    ``batches`` / ``orders`` (rank 0 only): the queue from the rollout processes and the list of
    queues to them, one per engine.  ``sync_addr``: (host, port) of the weight-sync group.
    ``parts``: how each rank gets its micro-batches from rank 0 (``scatter``); None: over the
    trainers' group (``ScatterParts``)."""
    if parent_pid is not None:
        die_with_parent(parent_pid)
    cfg = TrainConfig.model_validate(cfg_dict)
    if port is not None:
        set_rank_env(rank, world, port)
    if cfg.trainer.release_host_memory:  # before the model: every later block follows the fixed threshold
        release_freed_memory()
    if cfg.layout.device == "cpu" and cfg.trainer.cpu_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(cfg.trainer.cpu_threads)  # init_distributed applies it
    init_distributed(cfg.layout.device)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    if cfg.trainer.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    run = TrainerRank(cfg, rank, world, model_dir, batches, orders, parts)
    try:
        run.setup(demos, resume, sync_addr)
        run.train()
        run.finish()
    except BaseException:
        # the launcher reports only the first rank to fail, often a peer's "connection closed":
        # each rank prints its own cause
        print(f"arl.train: trainer rank {rank} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        raise
    finally:
        run.close()
        shutdown()


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports ``ru_maxrss`` in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def engine_mismatch(mbs, old) -> dict:
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


def checkpoint_due(version: int, every: int, steps: int, out_of_time: bool, action: str) -> bool:
    """Whether step ``version`` is checkpointed: every ``every`` steps, the last step, and the step the
    wall budget ran out; never a step the stabilizers roll back, whose state is the fault's (saved, it
    would be the very checkpoint the rollback restores)."""
    if action == "rollback":
        return False
    return version % every == 0 or version == steps or out_of_time


def update_on_batch(tr: PolicyTrainer, mbs, loss_cfg, updates: int) -> dict:
    """The ``updates`` optimizer steps on one batch, and this rank's metrics.  The old logprobs come
    from a no-grad pass over the batch only when they can differ from the first gradient pass's
    (``PolicyTrainer.old_pass_needed``: several updates, or dropout); else ``rl_step`` takes them
    from its own forward, and the mismatch metric reads those.  The critic's old values follow the
    same rule: from that pass when it runs, else from each gradient pass."""
    old = old_v = None
    if tr.old_pass_needed(updates):
        old_v = [] if tr.objective.needs_hidden else None
        old = tr.old_logprobs(mbs, values=old_v)
    ref = tr.ref_logprobs(mbs) if loss_cfg.kl_beta > 0 else None
    m = {}
    for _ in range(updates):
        m = tr.rl_step(mbs, old, loss_cfg, ref_logps=ref, old_values=old_v)
    m.update(engine_mismatch(mbs, tr.last_old_logps))  # the old logprobs the updates used
    return m


class TrainerRank:
    def __init__(self, cfg: TrainConfig, rank: int, world: int, model_dir: str, batches, orders, parts=None):
        self.cfg, self.rank, self.world, self.model_dir = cfg, rank, world, model_dir
        self.parts = parts or ScatterParts()  # each rank's micro-batches from rank 0
        self.run_dir = Path(cfg.output_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.t0, self.wall_offset = time.perf_counter(), 0.0  # reset once the model is loaded
        self.rss_base = peak_rss_bytes()  # before the model: the process's libraries (mem/ records subtract it)
        self.steps = cfg.trainer.steps
        self.evals = set()  # policy versions evaluated on the held-out tasks
        if cfg.env.eval_tasks:
            self.evals = {v for v in range(0, self.steps + 1) if v % cfg.trainer.eval_every == 0 or v == self.steps}
        self.log = self.link = self.stab = self.tr = self.sync = None
        self.batches, self.orders = batches, orders
        self.start_step, self.success, self.finished = 0, None, False
        self.decision = None  # rank 0: the stabilizers' decision of the last step
        self.restart = {}  # rank 0 after a trainer restart: the first step record says so (restarts.py)

    # ------------------------------------------------------------ set-up
    def setup(self, demos: list, resume: bool, sync_addr: Optional[tuple]) -> None:
        cfg, rank = self.cfg, self.rank
        resume_step = latest_checkpoint(self.ckpt_dir) if resume else None
        if rank == 0:
            self.restart = restart_note(self.run_dir, resume_step)  # before the logger cuts the records back
            lg = cfg.logging
            logger = MetricsLogger(self.run_dir, jsonl=lg.jsonl, tensorboard=lg.tensorboard, progress=lg.progress,
                                   total_steps=self.steps, resume_step=resume_step, wandb=lg.wandb,
                                   run_config=cfg.model_dump(mode="json"))
            self.log = OrderedLog(logger, self.evals)
            self.link = RolloutLink(self.batches, self.orders, on_eval=self.log.eval_result,
                                    on_restart=lambda e: resync_engine(e, self.link, self.sync, self.log, self.cfg))
        model = load_policy(cfg, self.model_dir)
        self.t0 = time.perf_counter()  # the run's clock (SFT included) starts with the model loaded
        sft_metrics = {}
        if cfg.sft.enabled and resume_step is None and cfg.sft.steps > 0:
            sft_out, sft_state = run_sft(cfg, model, demos, rank, self.world)
            sft_metrics = {f"sft/{k}": v for k, v in sft_out.items()}
            sft_metrics["sft/wall_s"] = time.perf_counter() - self.t0
            if sft_state is not None:  # ZeRO-3 partitioned the SFT model: RL starts from a whole copy
                model = load_policy(cfg, self.model_dir, state=sft_state)
            elif cfg.model.lora is not None:  # the SFT adapters go into the base: adapters off = the SFT model
                model = merge_and_rewrap(model, cfg.model.lora)
        ref = reference_model(cfg, model, self.model_dir, rank, fresh=resume_step is None, sft_done=bool(sft_metrics))
        self.tr = PolicyTrainer(model, optim=cfg.trainer.optim, zero_stage=cfg.trainer.zero_stage,
                                total_steps=self.steps, dtype=dtype_of(cfg), loss_backend=cfg.trainer.backend,
                                temperature=cfg.rollout.temperature, ref_model=ref, attn=cfg.model.attn_implementation,
                                objective=cfg.algo.objective_name(cfg.stabilizers.ipa.enabled), critic=cfg.critic,
                                head_grad_in_forward=cfg.trainer.head_grad_in_forward, offload=cfg.trainer.offload,
                                park_while_generating=cfg.trainer.offload.while_generating,
                                sequence_parallel=cfg.trainer.sequence_parallel)
        if rank == 0:
            self.stab = Stabilizers(cfg.stabilizers, cfg.loss, decode=self.tokenizer.decode, algo=cfg.algo)
        if resume_step is not None:
            self._restore(resume_step, restore_clock=True)
            if rank == 0:  # the rollouts that were in flight come first; the engines start after them
                held = load_rollouts(self.ckpt_dir / checkpoint_tag(resume_step))
                self.link.preload(held)
                self.link.start(resume_step + len(held))
        self.sync = make_sender(cfg, self.tr, rank, self.link, sync_addr)
        self.sync_weights(self.start_step)
        if rank == 0 and resume_step is None and (sft_metrics or 0 in self.evals):
            self.log.add(0, dict(sft_metrics), self.wall())

    def _restore(self, step: int, restore_clock: bool) -> None:
        """Model, optimizer and stabilizer state of checkpoint ``step`` (resume, or an alarm's rollback)."""
        state = self.tr.load_checkpoint(str(self.ckpt_dir), tag=checkpoint_tag(step))
        if restore_clock:
            self.start_step, self.wall_offset = int(state["step"]), float(state.get("wall_s", 0.0))
        if self.stab is not None and state.get("stabilizers"):
            self.stab.load_state_dict(state["stabilizers"])

    def wall(self) -> float:
        return self.wall_offset + time.perf_counter() - self.t0

    # ------------------------------------------------------------ the RL steps
    def train(self) -> None:
        for step in range(self.start_step, self.steps):
            action, out_of_time = self.step(step)
            version = step + 1
            if action == "stop":
                break
            if action == "rollback":
                last = latest_checkpoint(self.ckpt_dir)
                if last is not None:  # model + optimizer back to the last checkpoint; versions keep counting
                    with self.tr.awake():
                        self._restore(last, restore_clock=False)
                    self.sync_weights(version)
                if self.rank == 0:  # the alarm's or the stall guard's reason, one line
                    what = (f"rolled back at step {version} to the step {last} checkpoint" if last is not None
                            else f"no checkpoint to roll back to at step {version}, going on")
                    print(f"arl.train: {what}: {self.decision.reason}", flush=True)
            if out_of_time:
                break

    def step(self, step: int):
        """One RL step; returns ``(stabilizers' action, out of time)``, the same on every rank."""
        ts = time.perf_counter()
        faults.step_started(step + 1)
        mbs, loss_cfg, extra = self.next_batch(step)  # batch -> prepare (advantages) -> pack, scattered
        wait_s = time.perf_counter() - ts
        self.tr.unpark()  # trainer.offload.while_generating: the engine is asleep now, the state comes back
        m = all_mean(update_on_batch(self.tr, mbs, loss_cfg, self.cfg.trainer.updates_per_batch), self.tr.device,
                     sums=COUNT_METRICS)
        version = step + 1
        # one decision for every rank (each has its own clock: ranks that disagree would hang)
        max_wall = self.cfg.trainer.max_wall_s
        out_of_time = broadcast_from_rank0(max_wall is not None and self.wall() > max_wall, self.rank)
        if out_of_time and self.cfg.env.eval_tasks:
            self.evals.add(version)  # the policy the run ends with is evaluated too
        t_sync = time.perf_counter()
        self.sync_weights(version)
        sync_s = time.perf_counter() - t_sync
        decision = None
        if self.rank == 0:
            step_s = time.perf_counter() - ts
            tokens = float(sum(mb.num_tokens for mb in mbs))
            rec = {"time/step_s": step_s, "time/wait_rollout_s": wait_s, "time/sync_s": sync_s,
                   **self.memory_record(),
                   "perf/train_tokens_per_s": tokens * self.world / max(step_s - wait_s, 1e-9),
                   **{f"train/{k}": v for k, v in m.items()}, **extra, **self.restart}
            self.restart = {}
            decision = self.stab.after_step(version, rec, self.success)
            rec.update(self.stab.stab_metrics())
            if decision.action == "stop":  # in the record too: a table reading metrics.jsonl sees why it ended
                rec["stab/stopped"] = 1.0
            self.log.add(version, rec, self.wall())
            self.decision = decision  # train() prints a rollback's reason
            for note in decision.notes:
                print(f"arl.train: step {version}: {note}", flush=True)
            if decision.action == "stop":  # the alarm's or the stall guard's reason, one line
                print(f"arl.train: stopped at step {version}: {decision.reason}", flush=True)
        action = broadcast_from_rank0(decision.action if decision is not None else "continue", self.rank)
        if checkpoint_due(version, self.cfg.trainer.checkpoint_every, self.steps, out_of_time, action):
            self.checkpoint(version)
        return action, out_of_time

    def memory_record(self) -> dict:
        """This trainer rank's memory: its peak resident set so far (weights, gradients, optimizer
        state, activations, and the libraries), the same less the resident set before the model was
        loaded, and the parameter counts behind it."""
        peak = peak_rss_bytes()
        params = list(self.tr.module.parameters())
        parks = {} if self.tr.parking is None else {"mem/trainer_parks": float(self.tr.parking.num_parks)}
        return {**parks, "mem/trainer_rss_peak_gib": peak / 2**30, "mem/trainer_peak_over_base_gib": (peak - self.rss_base) / 2**30,
                "mem/params": float(sum(getattr(p, "ds_numel", p.numel()) for p in params)),
                "mem/params_trainable": float(sum(getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad))}

    def next_batch(self, step: int):
        """This rank's micro-batches of the step, the step's loss config, and (rank 0) the batch's
        metrics.  Rank 0 takes the batch, computes the step's advantages once and packs for all ranks;
        each rank gets its part through ``self.parts`` (on Ray: from the object store)."""
        parts = loss_cfg = extra = None
        if self.rank == 0:
            batch = self.link.next_batch()
            loss_cfg = self.stab.loss_config(step, self.success)
            trajs = batch.trainable()
            # one plan per data-parallel replica: a sequence-parallel group shares its micro-batches
            packer = PackerConfig(token_budget=self.cfg.trainer.micro_batch_tokens, num_ranks=self.tr.sp.dp,
                                  seed=self.cfg.seed + step, share_prefix=self.cfg.shares_prefix())
            # the step's advantages, packed, with each micro-batch's loss roles (arl/algo/step.py)
            packed, prep = prepare_step(trajs, loss_cfg, packer, self.cfg.stabilizers, self.cfg.algo)
            parts = self.tr.sp.replica_parts(packed.ranks)
            extra = {**batch.metrics, **self.stab.observe(trajs), **prep.metrics,
                     **trajectory_metrics(batch.trajectories)}
            if packer.share_prefix:  # what was shared; a one-line reason when a group fell back
                extra.update(log_share(packed, packer.min_shared, step + 1))
            self.success = extra.get("success/train")
        return self.parts.scatter(parts, self.rank), broadcast_from_rank0(loss_cfg, self.rank), extra

    def sync_weights(self, version: int) -> None:
        """The new policy into every engine; then the held-out evaluation of this version, when due
        (one engine evaluates: the held-out tasks are not split)."""
        chooser = self.stab.ipa.state_dict() if self.rank == 0 and self.cfg.stabilizers.ipa.enabled else None
        self.sync(version, chooser)
        if self.rank == 0 and version in self.evals:
            self.link.send(0, ("eval", version, self.cfg.env.eval_tasks))

    def checkpoint(self, version: int) -> None:
        """DeepSpeed's checkpoint (every rank's files), its HF export, (rank 0) the rollouts in flight
        and the config, made visible whole by one rename; then ``latest_step`` and the rotation
        (arl/trainer/checkpoints.py: a writer killed at any point leaves the previous one to resume)."""
        client = {"step": version, "wall_s": self.wall(),
                  "stabilizers": self.stab.state_dict() if self.stab is not None else None}
        client = broadcast_from_rank0(client, self.rank)
        export = None
        if self.cfg.trainer.checkpoint_hf:  # a collective under ZeRO-3; rank 0 writes
            def export(path):
                self.tr.export_hf(path, tokenizer=self.tokenizer if self.rank == 0 else None)

        # rank 0: the next steps' batches, generated while this one trained (this state's), waited for
        # before anything is written: a rollout failure here is not a failed write
        held = self.link.ahead(min(self.cfg.rollout.staleness, self.steps - version)) if self.rank == 0 else []

        def extras(staged: Path):
            save_rollouts(staged, held)
            (staged / CONFIG_FILE).write_text(self.cfg.model_dump_json(indent=2))

        write_checkpoint(self.ckpt_dir, version, self.rank,
                         lambda d, tag: self.tr.save_checkpoint(d, tag=tag, client_state=client), export, extras,
                         self.cfg.trainer.keep_last, barrier)

    # ------------------------------------------------------------ the end
    def finish(self) -> None:
        """Every record written (after the outstanding evaluations), the HF export."""
        if self.rank == 0:
            deadline = time.time() + 900
            while self.log.waiting() and time.time() < deadline:
                self.link.poll(5.0)
            self.log.flush(force=True)
            self.log.logger.close()
        self.tr.export_hf(str(self.run_dir / "hf"), tokenizer=self.tokenizer if self.rank == 0 else None)
        self.finished = True

    def close(self) -> None:
        if self.rank != 0 or self.link is None:
            return
        self.link.broadcast(("stop",))
        if self.finished:  # the engines stop on this order: their last reports land before the run ends
            self.link.wait_stopped(timeout_s=120)
        if self.sync is not None:
            self.sync.close()
