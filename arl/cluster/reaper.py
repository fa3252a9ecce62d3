"""Reaps the local Ray cluster of a driver that died without shutting it down.

A SIGKILLed driver runs no exit hook.  Ray fate-shares its GCS and raylet with the driver, but each
worker (trainer ranks, engines, queue actors) and its children (vLLM's engine core) notice their
raylet's death in their own time, and Ray's agents first wait 60 s to report it to the dead driver:
measured, some outlived the driver by more than a minute on a loaded machine.  ``start`` launches
this watcher beside a driver that started its own local cluster: it notes the driver's descendants
twice a second and, once the driver is gone, SIGKILLs every one of them still running (and their
children), then exits.  It runs in a session of its own, so that a kill of the driver's process
group or session leaves it to do its work.  A driver that ends normally has shut Ray down first:
the watcher then finds nothing left, or only stragglers, and exits too.

    python arl/cluster/reaper.py DRIVER_PID
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

POLL_S = 0.5


def descendants(root) -> dict:
    """pid -> psutil.Process of ``root``'s descendants now (a vanished one is skipped)."""
    import psutil

    try:
        return {p.pid: p for p in root.children(recursive=True)}
    except psutil.Error:
        return {}


def reap(known: dict, me: int) -> list:
    """SIGKILL every process of ``known`` still running, with the children they have now; returns the
    pids killed.  psutil checks each process's start time, so a reused pid is never hit."""
    import psutil

    targets = dict(known)
    for p in list(known.values()):
        targets.update(descendants(p))
    targets.pop(me, None)
    killed = []
    for pid, p in targets.items():
        try:
            p.kill()
            killed.append(pid)
        except psutil.Error:
            pass
    return killed


def watch(driver_pid: int, poll_s: float = POLL_S) -> list:
    """Until the driver is gone, the union of its descendants over time; then reap them."""
    import psutil

    try:
        driver = psutil.Process(driver_pid)
    except psutil.Error:
        return []
    me, known = os.getpid(), {}
    while True:
        try:
            alive = driver.is_running() and driver.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        if not alive:
            return reap(known, me)
        # forget the ones that exited: a later process may take their pid
        known = {pid: p for pid, p in known.items() if p.is_running()}
        known.update(descendants(driver))
        time.sleep(poll_s)


def start(driver_pid: int | None = None) -> subprocess.Popen:
    """The watcher of ``driver_pid`` (default: this process), in its own session, quiet."""
    # run as a file, not ``-m arl...``: importing the arl package would load torch into the watcher
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), str(driver_pid or os.getpid())],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python arl/cluster/reaper.py DRIVER_PID", file=sys.stderr)
        return 2
    watch(int(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
