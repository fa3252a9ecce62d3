"""pytest plugin for the by-hand runs of docs/ray.md: every ``python -m arl.train`` a test starts
(not under torchrun, not ``--dry-run``) gets ``launcher=ray`` appended, and the overrides in
``ARL_RAY_EXTRA`` (space-separated) after it.  Not loaded by default:

    PYTHONPATH=$PWD/tests:$PWD python -m pytest -p on_ray tests/test_gym_env.py::test_three_rl_steps_with_held_out_evaluation
"""
import os
import subprocess

_run, _popen_init = subprocess.run, subprocess.Popen.__init__


def _on_ray(cmd):
    if isinstance(cmd, list) and "arl.train" in cmd and "--dry-run" not in cmd and "torchrun" not in str(cmd[0]):
        return [*cmd, "launcher=ray", *os.environ.get("ARL_RAY_EXTRA", "").split()]
    return cmd


def _run_on_ray(cmd, *args, **kwargs):
    return _run(_on_ray(cmd), *args, **kwargs)


def _popen_init_on_ray(self, cmd, *args, **kwargs):
    _popen_init(self, _on_ray(cmd), *args, **kwargs)


subprocess.run = _run_on_ray
subprocess.Popen.__init__ = _popen_init_on_ray
