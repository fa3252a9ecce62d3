"""Test-only fault injection: a precise kill point for the resume tests (tests/test_train_e2e.py).

``ARL_TEST_KILL_AT=<point>:<version>`` (never set in a real run) makes the first trainer rank that
reaches ``point``, in the step that makes policy ``version``, SIGKILL its process group (under the
spawn launcher: the launcher, every trainer rank and the rollout processes);
``<point>:<version>:launcher`` SIGKILLs the launcher process alone (the leader of its process group,
as a shell or ``start_new_session`` makes it) and then waits there: every other process of the run
must die with the launcher, none by noticing a step that stopped:

  ``backward``  after the first micro-batch's backward (the update half done)
  ``sync``      in the weight sync, the new weights written, the engines not yet told

Under ``launcher: ray`` a trainer rank is a Ray worker in a process group of its own; the launcher's
group (the driver, with the local cluster's GCS and raylet) is in ``LAUNCHER_PGID_ENV``: the hook
kills that group first, as a user's kill of the job would, then its own (the other actors exit
when their raylet is gone: docs/ray.md).
A signal from outside lands wherever the processes happen to be; this lands mid-step every time.

The checkpoint writer's stages are kill points too (``ckpt-<stage>``, ``CKPT_STAGES``, in the
checkpoint of ``version``; arl/trainer/checkpoints.py): ``deepspeed`` (every rank's DeepSpeed files
staged), ``hf`` (the HF export staged), ``extras`` (the rollouts and config staged, not yet
renamed), ``published`` (renamed to ``step<N>``, ``latest_step`` not moved), ``latest``
(``latest_step`` moved, DeepSpeed's ``latest`` and the rotation not done), ``rotating`` (an older
checkpoint renamed away, its files not yet removed).

``ARL_TEST_KILL_RANK=<rank>@<version>`` (Ray's trainer restarts, arl/cluster/launcher.py): trainer
rank ``rank`` SIGKILLs its own process (only it: a dead trainer actor) when the step that makes
``version`` starts, in the run's first attempt only (``ATTEMPT_ENV``: the launcher's count).
"""
from __future__ import annotations

import os
import signal
import time

KILL_ENV = "ARL_TEST_KILL_AT"
LAUNCHER_PGID_ENV = "ARL_LAUNCHER_PGID"  # set by the Ray launcher for its actors
KILL_RANK_ENV = "ARL_TEST_KILL_RANK"
ATTEMPT_ENV = "ARL_TRAINER_ATTEMPT"  # 0, then 1, 2, ... for each restart of the trainer ranks
CKPT_STAGES = ("deepspeed", "hf", "extras", "published", "latest", "rotating")
_version = None  # the policy version the running step makes


def step_started(version: int) -> None:
    global _version
    _version = version
    spec = os.environ.get(KILL_RANK_ENV)
    if not spec or os.environ.get(ATTEMPT_ENV, "0") != "0":
        return
    rank, _, at = spec.partition("@")
    if rank == os.environ.get("RANK") and at.isdigit() and int(at) == version:
        print(f"arl.train: test hook: trainer rank {rank} kills itself at step {version} ({KILL_RANK_ENV})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def checkpoint_stage(stage: str) -> None:
    """A stage of the checkpoint writer done (``CKPT_STAGES``): kill point ``ckpt-<stage>``."""
    reached(f"ckpt-{stage}")


def reached(point: str) -> None:
    spec = os.environ.get(KILL_ENV)
    if not spec or _version is None:
        return
    name, version, whom = (spec.split(":") + [""])[:3]
    if whom not in ("", "launcher"):
        raise ValueError(f"{KILL_ENV}={spec!r}: the third field is 'launcher' or absent, not {whom!r}")
    if name == point and version.isdigit() and int(version) == _version:
        launcher = int(os.environ.get(LAUNCHER_PGID_ENV) or os.getpgrp())
        if whom == "launcher":
            os.kill(launcher, signal.SIGKILL)
            while True:
                time.sleep(60)
        if launcher != os.getpgrp():
            os.killpg(launcher, signal.SIGKILL)
        os.killpg(os.getpgrp(), signal.SIGKILL)
