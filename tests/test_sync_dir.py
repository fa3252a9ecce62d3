"""Trainer rank 0's weight directories in /dev/shm (arl/trainer/sync.py): a run killed without an
exit hook leaves its directory, which holds memory until it is deleted; the next run's rank 0
removes those whose owner is gone, and nothing else."""
import os
import subprocess
import sys

from arl.trainer.sync import OWNER, _me, drop_stale_sync_dirs


def _dir(shm, name, owner=None, mib=1):
    d = shm / f"arl-weights-{name}"
    (d / "v3").mkdir(parents=True)
    (d / "v3" / "w.safetensors").write_bytes(b"\0" * (mib << 20))
    if owner is not None:
        (d / OWNER).write_text(owner)
    return d


def test_only_the_directories_of_dead_owners_go(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # exited: its pid is free (or another process's, with another start time)
    pid, started = _me().split()
    assert int(pid) == os.getpid()
    d_dead = _dir(tmp_path, "1", f"{dead_pid} {started}", mib=2)
    d_reused = _dir(tmp_path, "2", f"{os.getpid()} {float(started) - 100.0!r}")  # this pid, another process
    d_live = _dir(tmp_path, "3", _me())
    d_none = _dir(tmp_path, "4")  # no owner file: being made, or an older arl's
    d_bad = _dir(tmp_path, "5", "not an owner")
    gone = drop_stale_sync_dirs(tmp_path)
    assert sorted(str(d) for d, _ in gone) == sorted([str(d_dead), str(d_reused)])
    assert dict((str(d), b) for d, b in gone)[str(d_dead)] == (2 << 20) + len(f"{dead_pid} {started}")
    assert not d_dead.exists() and not d_reused.exists()
    assert d_live.exists() and d_none.exists() and d_bad.exists()
