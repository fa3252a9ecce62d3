"""Trainer rank 0's answer to an engine that Ray restarted (``launcher: ray``, arl/cluster): the
new engine ignores the orders meant for the one that died until it gets ``("start", step)``.

It is told to start at the next batch its former self owed (the batches that reached trainer
rank 0 stay; those it was generating are gone, never accepted, and their task seeds are not
reused), is sent the current weights (group mode: every engine joins a new weight-sync group, the
dead member having broken the old one: ``WeightSender.rejoin``), and, for engine 0, the held-out
evaluations it lost: the current version's is ordered again, an older one's is dropped with one
line (the engine no longer has those weights) and its step record is written without
``success/heldout``."""
from __future__ import annotations

from ..config import TrainConfig


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
