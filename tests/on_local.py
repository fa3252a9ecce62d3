"""pytest plugin for the by-hand runs of docs/ray.md: every ``python -m arl.train`` a test starts
(not ``--dry-run``) gets ``launcher=local`` appended, and the overrides in ``ARL_LOCAL_EXTRA``
(space-separated) after it: the suite's runs on the local launcher instead of Ray (the tests skip
their checks of Ray's own lines: ARL_TESTS_LAUNCHER=local).  Not loaded by default:

    PYTHONPATH=$PWD/tests:$PWD python -m pytest -p on_local tests/test_gym_env.py::test_three_rl_steps_with_held_out_evaluation
"""
import os
import subprocess

_run, _popen_init = subprocess.run, subprocess.Popen.__init__
os.environ["ARL_TESTS_LAUNCHER"] = "local"


def _on_local(cmd):
    if isinstance(cmd, list) and "arl.train" in cmd and "--dry-run" not in cmd:
        return [*cmd, "launcher=local", *os.environ.get("ARL_LOCAL_EXTRA", "").split()]
    return cmd


def _run_on_local(cmd, *args, **kwargs):
    return _run(_on_local(cmd), *args, **kwargs)


def _popen_init_on_local(self, cmd, *args, **kwargs):
    _popen_init(self, _on_local(cmd), *args, **kwargs)


subprocess.run = _run_on_local
subprocess.Popen.__init__ = _popen_init_on_local
