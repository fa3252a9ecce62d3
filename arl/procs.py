"""Process helpers shared by every process of a run: free ports, and dying with the launcher."""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
from contextlib import closing

import psutil


class RunFailed(RuntimeError):
    """A run that cannot go on, for a reason one line says (``arl.train`` prints it, exit 1)."""


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(parent_pid: int, take_children: bool = False) -> None:
    """Linux: have the kernel send SIGTERM to this process when its parent (the launcher) dies, so a
    launcher killed with SIGKILL or SIGTERM leaves no trainer rank or rollout engine behind.  If the
    parent is already gone (it died before this call), exit now.  ``take_children``: on SIGTERM, first
    kill this process's own descendants (vLLM's engine-core process would outlive a plain exit)."""
    if not sys.platform.startswith("linux"):
        return
    if take_children:
        def _term(signum, frame):
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


def exit_process(code: int = 0) -> None:
    """End a distributed worker process now, skipping interpreter finalization and C++ static
    destructors.  After its process group is destroyed, a gloo rank's teardown at exit sometimes
    aborts in a native thread ("terminate called without an active exception", SIGABRT): the
    launcher would then report a finished run as failed.  Everything worth keeping is written and
    closed before this call; stdio is flushed here."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing more to save
            pass
    os._exit(code)


def adopt_orphans() -> None:
    """Linux: make this process the reaper of its descendants' orphans.  A rollout process killed
    from outside (OOM, SIGKILL) cannot take its vLLM engine-core process with it; that process is
    then re-parented here instead of to init, and ``kill_orphans`` can end it."""
    if sys.platform.startswith("linux"):
        PR_SET_CHILD_SUBREAPER = 36
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def kill_orphans(keep=()) -> None:
    """Kill every remaining descendant of this process, except the pids in ``keep``."""
    for c in psutil.Process().children(recursive=True):
        if c.pid in keep:
            continue
        try:
            c.kill()
        except psutil.NoSuchProcess:
            pass

