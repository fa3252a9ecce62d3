"""Trainer rank 0's end of the rollout processes: one ``batches`` queue that every rollout process
writes to, one ``orders`` queue to each of them.

Each engine ``e`` of ``E`` generates ``tasks_per_step / E`` groups of every batch (its own task
seeds, its own staleness gate) and sends ``("batch", e, RolloutBatch)``; the trainer's step ``k``
takes the ``k``-th batch of every engine and merges them (``merge_batches``).  Orders about the
weights and the end of the run go to every engine; held-out evaluation to engine 0 only.

Messages on ``batches``: ``("batch", e, batch)``, ``("eval", version, success, samples)`` (samples:
a few episodes for the W&B table, ``logging.wandb.samples``),
``("error", text)``, ``("stopped", e)``, ``("restarted", e)`` (Ray restarted engine ``e``: its
next batch is ``next_index(e)``; ``on_restart`` brings it up to date, arl/trainer/restarts.py).
"""
from __future__ import annotations

import queue as queue_mod
import time
from collections import deque
from typing import Callable, List, Optional, Sequence

from ..data.batch import merge_batches
from ..rollout.channel import Channel

class RolloutLink:
    """The queues of trainer rank 0 (``orders``: one queue per engine)."""

    def __init__(self, batches: Channel, orders: Sequence[Channel], on_eval: Callable[..., None],
                 on_restart: Optional[Callable[[int], None]] = None):
        if not orders:
            raise ValueError("RolloutLink: needs at least one engine's orders queue")
        self.batches, self.orders, self.on_eval = batches, list(orders), on_eval
        self._pending: List[deque] = [deque() for _ in self.orders]
        self._stopped: set = set()
        self._ready: deque = deque()  # merged batches received ahead of their step (checkpoint, resume)
        self.on_restart = on_restart
        self.first_index = 0  # the engines' first batch ("start": a resumed run's)
        self.received = [0] * len(self.orders)  # batches received from each engine

    @property
    def engines(self) -> int:
        return len(self.orders)

    def broadcast(self, msg: tuple) -> None:
        for q in self.orders:
            q.put(msg)

    def send(self, engine: int, msg: tuple) -> None:
        self.orders[engine].put(msg)

    def _take(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "batch":
            self._pending[msg[1]].append(msg[2])
            self.received[msg[1]] += 1
        elif kind == "eval":
            self.on_eval(*msg[1:])
        elif kind == "stopped":
            self._stopped.add(msg[1])
        elif kind == "restarted" and self.on_restart is not None:
            self.on_restart(msg[1])
        elif kind == "error":
            raise RuntimeError(f"rollout process failed: {msg[1]}")
        else:
            raise RuntimeError(f"rollout link: unknown message {kind!r}")

    def next_batch(self):
        """The next step's batch: one from every engine, merged (waits for the slowest)."""
        return self._ready.popleft() if self._ready else self._receive()

    def ahead(self, n: int) -> list:
        """The next ``n`` steps' batches, received now (waiting for them) and kept for
        ``next_batch``: the rollouts in flight, which a checkpoint holds."""
        while len(self._ready) < n:
            self._ready.append(self._receive())
        return list(self._ready)[:n]

    def start(self, step: int) -> None:
        """The engines make batch ``step`` first (a resumed run: the checkpoint holds those before)."""
        self.first_index = step
        self.broadcast(("start", step))

    def next_index(self, engine: int) -> int:
        """The index of the next batch engine ``engine`` owes: a restarted engine starts there."""
        return self.first_index + self.received[engine]

    def preload(self, batches: Sequence) -> None:
        """Batches a resumed run's checkpoint held: the next steps take them first."""
        self._ready.extend(batches)

    def _receive(self):
        while not all(self._pending):
            self._take(self.batches.get())
        return merge_batches([d.popleft() for d in self._pending])

    def poll(self, timeout_s: float) -> bool:
        """Handle one message if one comes within ``timeout_s``; False if none did."""
        try:
            msg = self.batches.get(timeout=timeout_s)
        except queue_mod.Empty:
            return False
        self._take(msg)
        return True

    def wait_stopped(self, timeout_s: float) -> bool:
        """After ``stop``: wait until every engine has said it stopped (an error report ends the
        wait too: the run's work is saved by then).  True when all did."""
        deadline = time.time() + timeout_s
        while len(self._stopped) < self.engines and time.time() < deadline:
            try:
                self.poll(1.0)
            except RuntimeError:
                return False
        return len(self._stopped) >= self.engines
