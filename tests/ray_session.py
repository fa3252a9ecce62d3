"""One Ray cluster per pytest process (each xdist worker) that the suite's Ray runs join through
RAY_ADDRESS (arl/cluster/launcher.py::join_address), started before the first test marked ``slow``
and stopped at the end of the session.  A run's own local cluster (GCS, raylet, Ray's agents and
their start-up) costs seconds of this 2-core machine's CPU per run; joined, a run pays only for its
actors.  The tests of a user's own cluster (its start, token and kills) drop RAY_ADDRESS
(``own_cluster``).  The runs' actors get the driver's ARL_* settings through their runtime env."""
import os
import secrets
import shutil
import sys
import tempfile

import pytest

CPUS = 16  # logical: every test's placement fits (Ray does not pin them to cores)
GPUS = 2  # logical too, for the colocated placement's test (no run of the suite asks for a GPU)
_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS", "RAY_TMPDIR")


@pytest.fixture(scope="session")
def ray_session():
    """The session's cluster: (address, token).  Set in the environment only around slow tests
    (``_join_ray_session``): the others see no RAY_ADDRESS."""
    from arl.cluster.placement import Node
    from arl.cluster.sim import start_cluster

    saved = {k: os.environ.get(k) for k in _ENV}
    token = secrets.token_hex(32)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    os.environ.pop("RAY_ADDRESS", None)
    _refresh_auth()
    temp = tempfile.mkdtemp(prefix="arl-rs-", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        cluster, _ = start_cluster([Node(0, CPUS, GPUS)], temp, roles=False)
    finally:
        _restore(saved)
    try:
        yield cluster.address, token
    finally:
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _restore(saved: dict) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _refresh_auth()


def _refresh_auth() -> None:
    """Ray, if imported in this process, re-reads RAY_AUTH_MODE / RAY_AUTH_TOKEN."""
    if "ray" in sys.modules:
        from arl.cluster.launcher import _refresh_auth_if_imported

        _refresh_auth_if_imported()


@pytest.fixture(autouse=True)
def _join_ray_session(request, monkeypatch):
    """A slow test runs with the session's cluster in RAY_ADDRESS and its token in RAY_AUTH_*."""
    if request.node.get_closest_marker("slow") is None:
        yield
        return
    address, token = request.getfixturevalue("ray_session")
    monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    _refresh_auth()
    yield
    monkeypatch.undo()
    _refresh_auth()
