"""Process-group set-up for trainer ranks: gloo on CPU, NCCL on GPU, always through DeepSpeed."""
from __future__ import annotations

import os
import socket
from contextlib import closing

import torch


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(parent_pid: int, take_children: bool = False) -> None:
    """Linux: have the kernel send SIGTERM to this process when its parent (the launcher) dies, so a
    launcher killed with SIGKILL or SIGTERM leaves no trainer rank or rollout engine behind.  If the
    parent is already gone (it died before this call), exit now.  ``take_children``: on SIGTERM, first
    kill this process's own descendants (vLLM's engine-core process would outlive a plain exit)."""
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    import ctypes

    if take_children:
        def _term(signum, frame):
            import psutil

            for c in psutil.Process().children(recursive=True):
                try:
                    c.kill()
                except psutil.NoSuchProcess:
                    pass
            os._exit(128 + signum)

        signal.signal(signal.SIGTERM, _term)
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def set_rank_env(rank: int, world_size: int, port: int) -> None:
    """The environment torch.distributed/DeepSpeed read (what torchrun would set)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def init_distributed(device: str) -> None:
    """Initialize the default process group once (no-op if it exists)."""
    import deepspeed
    import torch.distributed as dist

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
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1
