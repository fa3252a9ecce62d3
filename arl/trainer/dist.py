"""The trainer ranks' process group (gloo on CPU, NCCL on GPU, always through DeepSpeed) and every
collective the trainer runs."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def set_rank_env(rank: int, world_size: int, port: int) -> None:
    """The environment torch.distributed/DeepSpeed read (what torchrun would set; the launchers set it)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def init_distributed(device: str) -> None:
    """Initialize the default process group once (no-op if it exists)."""
    import deepspeed

    if dist.is_available() and dist.is_initialized():
        return
    if device == "cpu":
        # the shared-memory comm op would be JIT-compiled at start (minutes); gloo needs none
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl", verbose=False)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


# ---------------------------------------------------------------- collectives of the trainer ranks
# Every collective the trainer runs goes through these functions, so the backend's device rule is
# kept in one place: NCCL moves CUDA tensors only, gloo CPU tensors only.  A tensor reaches a
# collective only through ``to_comm``, which puts it on the communication device of the trainer's
# device.  With ARL_CHECK_COLLECTIVES=1 (the test suite sets it) a collective refuses any tensor
# that did not come through ``to_comm``: the mistake NCCL would refuse on a GPU, caught on CPU.
CHECK_ENV = "ARL_CHECK_COLLECTIVES"


def comm_device(device) -> torch.device:
    """Where a collective's tensors must live: the trainer's CUDA device, else the CPU."""
    d = torch.device(device) if device is not None else torch.device("cpu")
    return d if d.type == "cuda" else torch.device("cpu")


def to_comm(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on the communication device of ``device`` (a copy: the collective may change it)."""
    out = t.to(comm_device(device), copy=True)
    out._arl_comm = True  # what the check mode looks for
    return out


def _checked(t: torch.Tensor, what: str) -> torch.Tensor:
    if os.environ.get(CHECK_ENV) == "1" and not getattr(t, "_arl_comm", False):
        raise RuntimeError(f"{what}: a {t.device} tensor not placed by to_comm() (an NCCL group would refuse a CPU "
                           "tensor here)")
    return t


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place, like ``dist.all_reduce``, on a tensor from ``to_comm``."""
    dist.all_reduce(_checked(t, "all_reduce"), op=op)
    return t


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def all_mean(metrics: dict, device, sums: tuple = ()) -> dict:
    """Average a rank's metric dict over the ranks that report each key (a rank whose micro-batches
    were all empty, or held no RL tokens under IPA, reports fewer keys; the union is agreed first);
    the keys in ``sums`` (counts) are added up instead."""
    if not _distributed():
        return {k: float(v) for k, v in metrics.items()}
    key_sets = [None] * dist.get_world_size()
    dist.all_gather_object(key_sets, sorted(metrics))
    keys = sorted(set().union(*key_sets))
    t = torch.tensor([float(metrics.get(k, 0.0)) for k in keys] + [1.0 if k in metrics else 0.0 for k in keys],
                     dtype=torch.float64)
    t = all_reduce(to_comm(t, device)).cpu()
    n = len(keys)
    return {k: float(t[i] if k in sums else t[i] / t[n + i]) for i, k in enumerate(keys) if t[n + i] > 0}


def all_sum(t: torch.Tensor, device) -> torch.Tensor:
    """The sum over ranks of ``t`` (a copy, on ``t``'s device)."""
    if not _distributed():
        return t.clone()
    return all_reduce(to_comm(t, device)).to(t.device)


def all_max_int(x: int, device) -> int:
    if not _distributed():
        return int(x)
    return int(all_reduce(to_comm(torch.tensor([int(x)], dtype=torch.int64), device), op=dist.ReduceOp.MAX).item())


def any_rank(flag: bool, device) -> bool:
    """True on every rank when ``flag`` is true on any."""
    return all_max_int(1 if flag else 0, device) > 0


def scatter_from_rank0(objs_rank0, rank: int):
    """Rank r receives ``objs_rank0[r]`` (a list on rank 0, ignored elsewhere).  Object collectives
    stage through the current CUDA device under NCCL: ``init_distributed`` sets it."""
    if not _distributed():
        return objs_rank0[0]
    out = [None]
    dist.scatter_object_list(out, objs_rank0 if rank == 0 else None, src=0)
    return out[0]


class ScatterParts:
    """How each rank gets its part of rank 0's per-rank objects (a step's micro-batches): over the
    trainers' own ``torch.distributed`` group.  A Ray run's ranks fetch theirs from Ray's object
    store instead (arl/cluster/mailbox.py::RankParts), through the same ``scatter``."""

    def scatter(self, objs_rank0, rank: int):
        return scatter_from_rank0(objs_rank0, rank)


def broadcast_from_rank0(obj, rank: int):
    """Rank 0's ``obj`` on every rank."""
    if not _distributed():
        return obj
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
