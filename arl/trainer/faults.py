"""Test-only fault injection: a precise kill point for the resume tests (tests/test_train_e2e.py).

``ARL_TEST_KILL_AT=<point>:<version>`` (never set in a real run) makes the first trainer rank that
reaches ``point``, in the step that makes policy ``version``, SIGKILL its process group (under the
spawn launcher: the launcher, every trainer rank and the rollout processes):

  ``backward``  after the first micro-batch's backward (the update half done)
  ``sync``      in the weight sync, the new weights written, the engines not yet told

A signal from outside lands wherever the processes happen to be; this lands mid-step every time.
"""
from __future__ import annotations

import os
import signal

KILL_ENV = "ARL_TEST_KILL_AT"
_version = None  # the policy version the running step makes


def step_started(version: int) -> None:
    global _version
    _version = version


def reached(point: str) -> None:
    spec = os.environ.get(KILL_ENV)
    if not spec or _version is None:
        return
    name, _, version = spec.partition(":")
    if name == point and version.isdigit() and int(version) == _version:
        os.killpg(os.getpgrp(), signal.SIGKILL)
