"""The trainer's side of the weight sync: after every update, the new policy reaches every engine.

``file`` (the CPU default): trainer rank 0 writes the weights to shared memory (a directory per
version) and orders each engine to reload them.  ``group`` (the GPU default): trainer rank 0 broadcasts every tensor over a
process group straight into the engines' workers (arl/rollout/weight_sync.py), the first sync
having them join it.  Both can move flat buckets of ``rollout.sync_bucket_mb`` (one file or one
broadcast each; by default on GPU only: docs/weight_sync.md).  Either way the order carries the new policy version and the IPA start
chooser's state (it advances with the trainer's steps).  Colocated (``layout.colocate``) the file
path is the default: NCCL cannot pair trainer rank 0 and an engine worker on one GPU.

Under LoRA, ``rollout.lora_sync`` picks the sender (``SENDERS``): ``merged`` is this module's
``WeightSender`` over the merged weights; ``adapter`` writes only the adapter
(arl/trainer/adapter_sync.py, file path only).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

from ..config import TrainConfig
from ..model.tied import is_tied, untied_state
from ..rollout.colocate import trainer_turn_ends
from ..rollout.lora_sync import lora_sync_mode
from ..rollout.engine import write_sync_weights
from ..rollout.weight_sync import (Attendance, FromGroup, WeightSyncBroken, announce, make_group, plan_buckets,
                                   receivers_in, send, send_buckets, sender_backend, source_store, tensor_meta)
from ..rollout.worker import engine_workers
from . import faults
from .adapter_sync import AdapterSender
from .link import RolloutLink
from .policy import PolicyTrainer


GPU_BUCKET_MB = 256
JOIN_TIMEOUT_S = 1800.0  # the engines' workers join a weight-sync group within this (the group's own timeout)


def sync_bucket_mb(cfg: TrainConfig, device) -> int:
    """``rollout.sync_bucket_mb``, or when unset: buckets of ``GPU_BUCKET_MB`` on GPU (fewer NCCL
    calls; not measured yet), one per tensor on CPU (packing copies, and it measured slower on
    gloo and /dev/shm: docs/weight_sync.md)."""
    mb = cfg.rollout.sync_bucket_mb
    if mb is not None:
        return int(mb)
    return GPU_BUCKET_MB if str(device).startswith("cuda") else 0


OWNER = "owner"  # in a sync directory: "<pid> <start time>" of the trainer rank 0 that writes it


def sync_dir(rank: int = 0) -> Path:
    """Trainer rank 0's directory of synced weights: /dev/shm (nothing touches disk), per run.
    Rank 0 makes it, with its ``OWNER`` file, after removing the directories of runs whose rank 0
    is gone (SIGKILLed or OOM-killed: no exit hook removed them, and /dev/shm holds its files in
    memory until they are deleted)."""
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    d = shm / f"arl-weights-{os.environ['MASTER_PORT']}"
    if rank == 0:
        gone = drop_stale_sync_dirs(shm)
        if gone:
            print(f"arl.train: removed {len(gone)} weight directories of dead runs from {shm} "
                  f"({sum(b for _, b in gone) / 2**30:.2f} GiB)", flush=True)
        d.mkdir(parents=True, exist_ok=True)
        (d / OWNER).write_text(_me())
    return d


def _me() -> str:
    import psutil

    return f"{os.getpid()} {psutil.Process().create_time()!r}"


def _alive(owner: str) -> bool:
    """The process ``owner`` names (pid and start time: a reused pid is another process) runs."""
    import psutil

    pid, started = owner.split()
    try:
        return abs(psutil.Process(int(pid)).create_time() - float(started)) < 0.01
    except psutil.NoSuchProcess:
        return False


def drop_stale_sync_dirs(shm: Path) -> list:
    """Removes every ``arl-weights-*`` directory under ``shm`` whose owner has died; returns
    [(directory, bytes)].  One without an owner file (being made, or an older arl's) is left."""
    gone = []
    for d in sorted(shm.glob("arl-weights-*")):
        try:
            owner = (d / OWNER).read_text()
        except OSError:
            continue
        try:
            dead = not _alive(owner)
        except ValueError:  # not "<pid> <time>"
            continue
        if dead:
            size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            shutil.rmtree(d, ignore_errors=True)
            gone.append((d, size))
    return gone


class WeightSender:
    """The whole model per sync (full fine-tuning; LoRA's merged weights, ``rollout.lora_sync: merged``)."""

    def __init__(self, cfg: TrainConfig, trainer: PolicyTrainer, rank: int, link: Optional[RolloutLink],
                 sync_addr: Optional[tuple]):
        self.cfg, self.tr, self.rank, self.link, self.addr = cfg, trainer, rank, link, sync_addr
        self.mode = cfg.rollout.sync_mode(cfg.layout.device, cfg.layout.colocate)
        if self.mode == "group" and sync_addr is None:
            raise ValueError("rollout.weight_sync: 'group' needs the launcher's weight-sync address")
        self.weights_dir = sync_dir(rank)
        self.group = self.store = None
        self.epoch = 0  # group mode: the how-many-th group (a new one after an engine's restart)
        # group mode under ZeRO-3 with engine restarts: rank 0 keeps a host copy of the last synced
        # weights for a restarted engine (gathering them again is every rank's collective, and only
        # rank 0 hears of the restart); a model's size of host memory (docs/ray.md)
        self.restarts = cfg.launcher_used() == "ray" and cfg.ray.engine_restarts > 0  # Ray brings a dead engine back
        self.keep = self.mode == "group" and self.restarts and trainer.zero3
        self.kept: Optional[dict] = None
        # (source, version, chooser state) of the last sync; source: its directory (file mode) or None
        self.last: Optional[tuple] = None
        self.in_sync: Optional[int] = None  # the version being sent (a restart answered meanwhile: restarts.py)
        # tied embeddings: the head is the embedding, which the engines load under both names
        # (arl/rollout/weight_sync.py), so it is not sent twice
        self.tied = is_tied(trainer.module)
        self.bucket_bytes = sync_bucket_mb(cfg, trainer.device) << 20  # 0: one broadcast / file entry per tensor

    def _state(self) -> dict:
        # sent before the next update: no copy of what is already on the CPU
        return self.tr.full_state_dict(to_cpu=self.mode == "file" or self.tr.device.type != "cuda", copy=False)

    def __call__(self, version: int, chooser_state: Optional[dict]) -> None:
        """Every rank calls it (under ZeRO-3 gathering the weights is a collective); rank 0 sends.
        For NCCL the tensors stay on the GPU."""
        state = self._state()
        self.tr.park()  # trainer.offload.while_generating: the state to host memory, the engine's turn
        trainer_turn_ends(self.cfg, self.tr.device)  # every rank's GPU: colocated, the engine wakes on this sync
        if self.rank != 0:
            return
        state = untied_state(state, self.tied)
        if self.mode == "file":
            # one directory per version: an engine may take an order only after the trainer has
            # written newer weights (staleness > 0, a resumed run's held batches), and must load
            # the version the order names.  Orders older than staleness + 1 versions are taken
            # (the batch the trainer just trained on needed one of them), so their files go
            d = write_sync_weights(state, self.weights_dir / f"v{version}", self.bucket_bytes)
            for old in self.weights_dir.glob("v*"):
                if old.name[1:].isdigit() and int(old.name[1:]) < version - self.cfg.rollout.staleness - 1:
                    shutil.rmtree(old, ignore_errors=True)
            faults.reached("sync")  # test-only kill point (arl/trainer/faults.py)
            self.last = (str(d), version, chooser_state)
            self.link.broadcast(("weights", str(d), version, chooser_state))
            return
        self.last = (None, version, chooser_state)
        if self.keep:
            self.kept = {k: v.to("cpu", copy=True) for k, v in state.items()}
        self.in_sync = version
        try:
            self._broadcast(state, version, chooser_state)
        finally:
            self.in_sync = None

    def _broadcast(self, state: dict, version: int, chooser_state: Optional[dict], kill_point: bool = True) -> None:
        """Group mode: every engine's workers receive ``state`` (joining the group first when there is none)."""
        if self.group is None:  # the engines' workers join, then every sync is broadcasts
            epoch = self.epoch
            n, backend = 1 + self.link.engines * engine_workers(self.cfg), sender_backend(self.tr.device)
            if self.store is None:  # rank 0 hosts the store (and is the source) for the whole run
                self.store = source_store(self.addr[0], self.addr[1], n)
            announce(self.store, epoch)
            self.link.broadcast(("join_sync", self.addr[0], self.addr[1], n, backend, epoch))
            if not self._members_joined(epoch, n):
                return  # an engine restarted meanwhile: its newer group (``rejoin``) took these weights
            self.group = make_group(self.addr[0], self.addr[1], 0, n, backend, epoch=epoch, store=self.store)
        meta = tensor_meta(state)
        plan = plan_buckets(meta, self.bucket_bytes) if self.bucket_bytes > 0 else None
        self.link.broadcast(("weights", FromGroup(meta, plan), version, chooser_state))
        if kill_point:
            faults.reached("sync")
        # returns once every engine has received every tensor
        try:
            if plan is None:
                send(self.group, state, self.tr.device)
            else:
                send_buckets(self.group, state, plan, self.tr.device)
        except WeightSyncBroken as e:
            if not self.restarts:
                raise
            # an engine died: Ray restarts it, and its "restarted" brings every engine into a new
            # group with these weights (``rejoin``); leaving this one now closes its connections,
            # so that the engines still waiting on them fail and wait for that
            self.group = None
            print(f"arl.train: {e}: an engine died? the engines join a new group when Ray has restarted it",
                  flush=True)

    def _members_joined(self, epoch: int, n: int) -> bool:
        """Until the ``n - 1`` engine workers have taken their ranks in group ``epoch`` and are alive
        (``Attendance``; then they are let in), answering the engines meanwhile (``link.poll``): one
        that died before or after taking its rank comes back restarted, and its answer (``rejoin``)
        forms a newer group, so this one is given up (False); one that failed ends the run with its
        error instead of a wait for the rendezvous' timeout."""
        deadline, present = time.monotonic() + JOIN_TIMEOUT_S, Attendance(self.store, epoch, n)
        while not present.all_alive():
            if self.epoch != epoch:
                return False
            if time.monotonic() > deadline:
                raise RuntimeError(f"weight sync group {epoch}: {receivers_in(self.store, epoch)} of {n - 1} engine "
                                   f"workers joined and alive within {JOIN_TIMEOUT_S:.0f} s")
            self.link.poll(0.2)
        return self.epoch == epoch

    def rejoin(self) -> None:
        """Group mode, trainer rank 0, an engine was restarted (arl/trainer/restarts.py): its new
        workers cannot enter the group its former self was in, so every engine joins a new one
        and receives the last synced weights again (the trainer has not updated since: this runs
        while rank 0 waits for the next batch, or inside a sync while the engines join, nested in
        ``_members_joined``).  Rank 0 alone reads them, or under ZeRO-3 its host copy (``keep``)."""
        _, version, chooser_state = self.last
        self.group, self.epoch = None, self.epoch + 1
        if self.kept is not None:
            state = self.kept
        else:
            with self.tr.awake():
                state = untied_state(self._state(), self.tied)
        self._broadcast(state, version, chooser_state, kill_point=False)

    def close(self) -> None:
        shutil.rmtree(self.weights_dir, ignore_errors=True)


# rollout.lora_sync -> the sender of that mode (arl/rollout/lora_sync.py); full fine-tuning: merged
SENDERS = {
    "merged": WeightSender,
    "adapter": lambda cfg, tr, rank, link, addr: AdapterSender(cfg, tr, rank, link, sync_dir(rank),
                                                               is_tied(tr.module)),
}


def make_sender(cfg: TrainConfig, trainer: PolicyTrainer, rank: int, link: Optional[RolloutLink],
                sync_addr: Optional[tuple]):
    """The run's weight sender: one call per policy version, on every trainer rank."""
    return SENDERS[lora_sync_mode(cfg) or "merged"](cfg, trainer, rank, link, sync_addr)
