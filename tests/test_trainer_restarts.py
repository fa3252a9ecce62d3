"""Trainer restarts under Ray (``ray.trainer_restarts``) without Ray: the launcher's attempts and
what ends them (arl/cluster/launcher.py), the record of a restart (arl/trainer/restarts.py) and the
test hook that kills a trainer rank (arl/trainer/faults.py).  The run on Ray with a rank killed:
tests/test_train_e2e.py::test_sigkill_mid_step_then_resume_reproduces_the_uninterrupted_run[ray] (its third leg)."""
import json
import signal

import pytest

from arl.cluster import launcher
from arl.cluster.actors import restart_env
from arl.config import TrainConfig
from arl.trainer import faults
from arl.trainer.restarts import DEAD_RANK_ENV, restart_note


class _Ray:
    """What ``_restarting`` and ``_trainer_death`` use of ray."""

    def __init__(self, results=None):
        self.killed, self.results = [], results or {}
        import ray.exceptions as exceptions

        self.exceptions = exceptions

    def kill(self, actor):
        self.killed.append(actor)

    def wait(self, refs, num_returns, timeout=None):
        done = [r for r in refs if r in self.results]
        return done, [r for r in refs if r not in done]

    def get(self, ref):
        err = self.results[ref]
        if err is not None:
            raise err


def _cfg(restarts):
    return TrainConfig.model_validate({"ray": {"trainer_restarts": restarts}})


def test_trainer_restarts_default():
    assert TrainConfig().ray.trainer_restarts == 3


def test_a_dead_rank_starts_every_actor_again_up_to_the_limit(capsys):
    ray, actors, seen = _Ray(), [], []

    def attempt(n, dead):
        seen.append((n, dead))
        actors.extend([f"rank0-{n}", f"rank1-{n}", f"engine-{n}"])
        if n < 2:
            raise launcher.TrainerDied(1, "ActorDiedError: the actor died unexpectedly")

    launcher._restarting(ray, _cfg(3), actors, attempt)
    assert seen == [(0, None), (1, 1), (2, 1)]
    assert ray.killed == ["rank0-0", "rank1-0", "engine-0", "rank0-1", "rank1-1", "engine-1"]
    out = capsys.readouterr().out
    assert "ray: trainer rank 1 died (ActorDiedError: the actor died unexpectedly); trainer restart 1 of 3" in out
    assert "trainer restart 2 of 3" in out


@pytest.mark.parametrize("limit", [0, 1])
def test_past_the_limit_a_death_ends_the_run_in_one_line(limit):
    def attempt(n, dead):
        raise launcher.TrainerDied(0, "ActorDiedError: killed")

    with pytest.raises(RuntimeError) as e:
        launcher._restarting(_Ray(), _cfg(limit), [], attempt)
    msg = str(e.value)
    assert "\n" not in msg and "trainer rank 0 died" in msg and f"{limit} of ray.trainer_restarts = {limit}" in msg


def test_an_error_of_the_run_is_not_restarted():
    calls = []

    def attempt(n, dead):
        calls.append(n)
        raise RuntimeError("ray: trainer rank 0 failed: CheckpointError: no space left on device")

    with pytest.raises(RuntimeError, match="no space left"):
        launcher._restarting(_Ray(), _cfg(3), [], attempt)
    assert calls == [0]


def test_which_failure_is_a_death():
    """A rank that died is one; a rank that failed on the broken group is one when a peer's death
    shows (that peer named), else an error of the run."""
    import ray.exceptions as ex

    died = ex.ActorDiedError()
    group = ex.RayTaskError("run", "trace", RuntimeError("[gloo] Connection closed by peer"))
    assert launcher._trainer_death(_Ray(), "trainer rank 1", died, {}).rank == 1
    oom = ex.OutOfMemoryError("2 worker(s) were killed due to the node running low on memory")  # Ray's monitor
    assert launcher._trainer_death(_Ray(), "trainer rank 0", oom, {}).rank == 0
    assert launcher._trainer_death(_Ray(), "engine 0", died, {}) is None  # engines: ray.engine_restarts
    ray = _Ray({"r1": died, "e0": None})
    found = launcher._trainer_death(ray, "trainer rank 0", group, {"r1": "trainer rank 1", "e0": "engine 0"})
    assert found.rank == 1 and str(found).startswith("trainer rank 1 died")
    ray = _Ray({"r1": group})
    assert launcher._trainer_death(ray, "trainer rank 0", group, {"r1": "trainer rank 1"}) is None


def test_the_record_of_a_restart(tmp_path, monkeypatch, capsys):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 1, 2, 3)))
    monkeypatch.delenv(faults.ATTEMPT_ENV, raising=False)
    assert restart_note(tmp_path, 2) == {}  # a first attempt: nothing
    monkeypatch.setenv(faults.ATTEMPT_ENV, "2")
    monkeypatch.setenv(DEAD_RANK_ENV, "1")
    assert restart_note(tmp_path, 2) == {"restart/trainer_restarts": 2.0, "restart/dead_rank": 1.0,
                                         "restart/from_step": 2.0, "restart/replayed_steps": 1.0}
    assert "trainer restart 2 (trainer rank 1 died): from the step 2 checkpoint, training steps 3-3 again" in \
        capsys.readouterr().out
    assert restart_note(tmp_path, None)["restart/replayed_steps"] == 3.0  # no checkpoint yet: from the start
    assert "from the start (no checkpoint yet)" in capsys.readouterr().out


def test_the_kill_rank_hook_fires_once_in_the_first_attempt(monkeypatch):
    kills = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: kills.append(sig))
    monkeypatch.setenv(faults.KILL_RANK_ENV, "1@3")
    monkeypatch.setenv("RANK", "1")
    for attempt, version, rank in [("0", 2, "1"), ("0", 3, "0"), ("1", 3, "1"), ("0", 3, "1")]:
        monkeypatch.setenv(faults.ATTEMPT_ENV, attempt)
        monkeypatch.setenv("RANK", rank)
        faults.step_started(version)
    assert kills == [signal.SIGKILL]
    monkeypatch.setattr(faults, "_version", None)


def test_the_attempt_reaches_the_ranks(monkeypatch):
    monkeypatch.delenv(faults.KILL_ENV, raising=False)
    monkeypatch.setenv(faults.KILL_RANK_ENV, "1@3")
    assert restart_env(0, None) == {faults.ATTEMPT_ENV: "0", faults.KILL_RANK_ENV: "1@3"}
    assert restart_env(2, 1)[DEAD_RANK_ENV] == "1"


def test_the_kill_at_hook_kills_the_launcher_alone_or_names_a_bad_field(monkeypatch):
    """``<point>:<version>:launcher``: SIGKILL to the launcher's pid only (then the hook waits);
    another third field is one line naming it."""
    kills = []
    monkeypatch.setattr(faults, "_version", 3)
    monkeypatch.setenv(faults.LAUNCHER_PGID_ENV, "4242")
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    monkeypatch.setattr(faults.os, "killpg", lambda pgid, sig: pytest.fail("the launcher alone, not a group"))

    class Waited(Exception):
        pass

    def wait(_):
        raise Waited

    monkeypatch.setattr(faults.time, "sleep", wait)
    monkeypatch.setenv(faults.KILL_ENV, "backward:3:launcher")
    faults.reached("sync")  # another point: nothing
    assert kills == []
    with pytest.raises(Waited):
        faults.reached("backward")
    assert kills == [(4242, signal.SIGKILL)]
    monkeypatch.setenv(faults.KILL_ENV, "backward:3:launchr")
    with pytest.raises(ValueError, match="the third field is 'launcher' or absent, not 'launchr'"):
        faults.reached("backward")
