"""Several rollout engines feeding one trainer (arl/trainer/link.py): task shares
(arl/rollout/worker.py), batch merging (arl/data/batch.py)
and trainer rank 0's queue handling, without processes (the torchrun end-to-end test runs two
real engines)."""
import itertools
import queue
import threading

import numpy as np
import pytest

from arl.data.trajectory import Trajectory
from arl.data.batch import RolloutBatch, merge_batches
from arl.rollout.worker import engine_task_seeds
from arl.trainer.link import RolloutLink


def _take(it, n):
    return list(itertools.islice(it, n))


def test_one_engine_takes_every_seed_from_its_step():
    assert _take(engine_task_seeds(3, 16, 0, 1), 40) == _take(itertools.count(48), 40)


@pytest.mark.parametrize("engines", [2, 4])
def test_engine_shares_partition_the_steps(engines):
    T, steps = 16, 5
    share = T // engines
    per = [_take(engine_task_seeds(2, T, e, engines), share * steps) for e in range(engines)]
    for s in range(steps):  # batch s of the run = the union of every engine's s-th share
        got = sorted(x for e in range(engines) for x in per[e][s * share:(s + 1) * share])
        assert got == list(range((2 + s) * T, (3 + s) * T))


def _traj(gid, reward, n=5):
    return Trajectory(tokens=np.arange(n, dtype=np.int32), chunk_ids=np.zeros(n, np.int32),
                      rollout_logp=np.zeros(n, np.float32), reward=reward, group_id=gid)


def _batch(step, gids, metrics):
    return RolloutBatch(step, [_traj(g, float(g)) for g in gids for _ in range(2)], metrics)


def test_merge_renumbers_groups_and_combines_metrics():
    a = _batch(4, [0, 1], {"rollout/num_trajectories": 4, "rollout/reward_mean": 1.0, "rollout/staleness_max": 1,
                           "rollout/tokens": 20, "rollout/filtered_frac": 0.0, "rollout/env_pool_peak": 3})
    b = _batch(4, [0, 1], {"rollout/num_trajectories": 4, "rollout/reward_mean": 0.0, "rollout/staleness_max": 0,
                           "rollout/tokens": 30, "rollout/filtered_frac": 0.5, "rollout/env_pool_peak": 5})
    m = merge_batches([a, b])
    assert m.step == 4 and len(m.trajectories) == 8
    # engine e's group g becomes g * 2 + e: four distinct groups of two samples each
    assert [t.group_id for t in m.trajectories] == [0, 0, 2, 2, 1, 1, 3, 3]
    assert m.metrics["rollout/num_trajectories"] == 8 and m.metrics["rollout/tokens"] == 50
    assert m.metrics["rollout/reward_mean"] == pytest.approx(0.5)
    assert m.metrics["rollout/filtered_frac"] == pytest.approx(0.25)
    assert m.metrics["rollout/staleness_max"] == 1 and m.metrics["rollout/env_pool_peak"] == 5
    assert m.metrics["rollout/engines"] == 2


def test_merge_of_one_batch_is_that_batch_and_steps_must_agree():
    a = _batch(1, [0], {})
    assert merge_batches([a]) is a
    with pytest.raises(RuntimeError, match="batches of different steps \\[1, 2\\]"):
        merge_batches([a, _batch(2, [0], {})])


def test_link_waits_for_every_engine_and_routes_messages():
    batches, orders = queue.Queue(), [queue.Queue(), queue.Queue()]
    evals = []
    link = RolloutLink(batches, orders, on_eval=lambda v, acc: evals.append((v, acc)))
    link.broadcast(("weights", "dir", 1, None))
    link.send(0, ("eval", 1, 8))
    assert [orders[0].get_nowait(), orders[0].get_nowait()] == [("weights", "dir", 1, None), ("eval", 1, 8)]
    assert orders[1].get_nowait() == ("weights", "dir", 1, None) and orders[1].empty()

    # engine 0 runs ahead by a step; the step's batch waits for engine 1
    batches.put(("batch", 0, _batch(0, [0], {"rollout/num_trajectories": 2})))
    batches.put(("batch", 0, _batch(1, [1], {"rollout/num_trajectories": 2})))
    batches.put(("eval", 0, 0.25))
    threading.Timer(0.2, batches.put, (("batch", 1, _batch(0, [0], {"rollout/num_trajectories": 2})),)).start()
    first = link.next_batch()
    assert first.step == 0 and len(first.trajectories) == 4 and evals == [(0, 0.25)]
    batches.put(("batch", 1, _batch(1, [0], {"rollout/num_trajectories": 2})))
    assert link.next_batch().step == 1

    batches.put(("error", "engine 1: ValueError: bad env"))
    with pytest.raises(RuntimeError, match="rollout process failed: engine 1: ValueError: bad env"):
        link.next_batch()
    assert not link.poll(0.01)
    batches.put(("stopped", 1))
    assert not link.wait_stopped(0.5)  # engine 0 has not stopped
    batches.put(("stopped", 0))
    assert link.wait_stopped(5.0)
