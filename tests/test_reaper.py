"""arl/cluster/reaper.py: a SIGKILLed driver's descendants -- in process groups of their own, as
Ray's workers are, and a grandchild, as vLLM's engine core is -- are killed within seconds, the
watcher outlives a kill of the driver's process group, and it exits once it has reaped."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from arl.cluster import reaper

# a stand-in driver: starts the watcher, then a "raylet" (own process group) with a "worker" child
# that has a child of its own; prints their pids and sleeps
_DRIVER = """
import os, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from arl.cluster import reaper
w = reaper.start()
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
worker = [sys.executable, "-c", "import subprocess, sys, time; p = subprocess.Popen(%r); print(p.pid, flush=True); "
          "time.sleep(600)" % (sleeper,)]
raylet = subprocess.Popen(worker, stdout=subprocess.PIPE, text=True, process_group=0)
grandchild = raylet.stdout.readline().strip()
print(w.pid, raylet.pid, grandchild, flush=True)
time.sleep(600)
"""


def _alive(pids):
    out = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _gone(pids, timeout_s):
    """The pids still running after ``timeout_s`` (at once when all are gone)."""
    deadline = time.time() + timeout_s
    while (alive := _alive(pids)) and time.time() < deadline:
        time.sleep(0.2)
    return alive


def test_a_killed_drivers_descendants_are_reaped(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    root = str(Path(reaper.__file__).resolve().parents[2])
    driver = subprocess.Popen([sys.executable, str(script), root], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        watcher, raylet, grandchild = map(int, driver.stdout.readline().split())
        time.sleep(3 * reaper.POLL_S)  # the watcher has seen them
        assert _alive([raylet, grandchild]) == [raylet, grandchild]
        os.killpg(driver.pid, signal.SIGKILL)  # the driver's group: not the watcher's, nor the "raylet"'s
        driver.wait(timeout=10)
        assert _gone([raylet, grandchild], 10) == []
        assert _gone([watcher], 10) == []  # done: it exits
    finally:
        for pid in (driver.pid,):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_reap_spares_the_watcher_and_survives_vanished_processes():
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    kid, spared = subprocess.Popen(sleep), subprocess.Popen(sleep)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    known = {p.pid: psutil.Process(p.pid) for p in (kid, spared, gone)}
    gone.wait()
    try:
        assert reaper.reap(known, spared.pid) == [kid.pid]  # ``spared`` stands for the watcher itself
        assert kid.wait(timeout=10) == -signal.SIGKILL and spared.poll() is None
    finally:
        spared.kill()
        kid.kill()
    assert reaper.main(["x"]) == 2
