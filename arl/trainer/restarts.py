"""Restarts under Ray (``launcher: ray``, arl/cluster/launcher.py).

Trainer ranks (``ray.trainer_restarts``): when a trainer actor dies, the launcher ends the attempt
(every trainer rank, engine and the mailbox) and starts the run's actors again in the same
placement groups, resumed from the last complete checkpoint (its rollouts in flight, its weights
into the new engines; no checkpoint yet: from the start).  The new ranks get ``ATTEMPT_ENV`` and
``DEAD_RANK_ENV``; trainer rank 0 prints what is replayed and puts it in the first step record after
the restart (``restart_note``): ``restart/trainer_restarts`` (the attempt), ``restart/dead_rank``,
``restart/from_step`` (the checkpoint), ``restart/replayed_steps`` (steps logged after that
checkpoint, which the run trains again).

Engines: trainer rank 0's answer to an engine that Ray restarted (``launcher: ray``, arl/cluster): the
new engine ignores the orders meant for the one that died until it gets ``("start", step)``.

It is told to start at the next batch its former self owed (the batches that reached trainer
rank 0 stay; those it was generating are gone, never accepted, and their task seeds are not
reused), is sent the current weights (group mode: every engine joins a new weight-sync group, the
dead member having broken the old one: ``WeightSender.rejoin``), and, for engine 0, the held-out
evaluations it lost: the current version's is ordered again, an older one's is dropped with one
line (the engine no longer has those weights) and its step record is written without
``success/heldout``."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ..config import TrainConfig
from ..metrics.logger import read_metrics
from .faults import ATTEMPT_ENV

DEAD_RANK_ENV = "ARL_TRAINER_DEAD_RANK"  # the trainer rank whose death started this attempt


def restart_note(run_dir: Path, resume_step: Optional[int]) -> dict:
    """Trainer rank 0 of a restarted attempt, before its logger cuts metrics.jsonl back to the
    checkpoint: the record of the restart (empty in a first attempt), with one line saying it."""
    attempt = int(os.environ.get(ATTEMPT_ENV, "0") or 0)
    if attempt == 0:
        return {}
    dead = int(os.environ.get(DEAD_RANK_ENV, "-1"))
    path = run_dir / "metrics.jsonl"
    logged = max((r["step"] for r in read_metrics(path)), default=0) if path.exists() else 0
    start = resume_step or 0
    replayed = max(0, logged - start)
    what = f"steps {start + 1}-{logged} again" if replayed else "no step again"
    print(f"arl.train: trainer restart {attempt} (trainer rank {dead} died): from "
          f"{f'the step {resume_step} checkpoint' if resume_step is not None else 'the start (no checkpoint yet)'}, "
          f"training {what}", flush=True)
    return {"restart/trainer_restarts": float(attempt), "restart/dead_rank": float(dead),
            "restart/from_step": float(start), "restart/replayed_steps": float(replayed)}


def resync_engine(engine: int, link, sync, log, cfg: TrainConfig) -> None:
    """``link``: the RolloutLink; ``sync``: the weight sender (None before the first sync);
    ``log``: the OrderedLog."""
    step = link.next_index(engine)
    link.send(engine, ("start", step))
    last = getattr(sync, "last", None)
    print(f"arl.train: engine {engine} restarted: it makes batch {step} on, with the weights of version "
          f"{last[1] if last else 'to come'}", flush=True)
    if last is None:  # no sync yet: the first one's order reaches it after "start"
        return
    source, version, chooser = last
    if sync.mode == "group":  # every engine: a new group, and the weights again over it
        sync.rejoin()
    else:
        link.send(engine, ("weights", source, version, chooser))
    if engine != 0 or log is None:
        return
    # answered inside version's own sync (its group's join): its evaluation is ordered after that sync
    upto = version - 1 if getattr(sync, "in_sync", None) == version else version
    for v in log.unanswered(upto):
        if v == version:
            link.send(0, ("eval", v, cfg.env.eval_tasks))
        else:
            print(f"arl.train: held-out evaluation of version {v} lost with engine 0's restart; its record has none",
                  flush=True)
            log.drop_eval(v)
