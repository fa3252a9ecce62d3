"""bench/bench_soak.py's verdicts on hand-made step records (the soak itself is a bench run)."""
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_soak import check  # noqa: E402


def rec(step, **kw):
    r = {"step": step, "train/loss": 0.1, "train/grad_norm": 1.0, "rollout/reward_mean": 0.5,
         "rollout/num_trajectories": 16, "status/faults": 2, "status/masked": 1}
    r.update(kw)
    return r


def test_a_clean_soak_passes():
    lines = [rec(0), *[rec(s) for s in range(1, 5)]]
    lines[3]["restart/trainer_restarts"] = 1
    v = check(lines, 4, 16, "arl.train: engine 0 restarted: it makes batch 3 on", kill_rank_at=3)
    assert v["steps_logged_once"] and v["batches_whole"] and v["no_nan"] and v["engine_restarts"] == 1
    assert v["trainer_restart_recorded"] and v["restart_steps"] == [3]
    assert v["faults_total"] == 8 and v["trajectories_total"] == 64 and v["masked_total"] == 4


def test_each_failure_is_named():
    lines = [rec(1), rec(2, **{"train/loss": math.nan}), rec(2), rec(3, **{"rollout/num_trajectories": 12})]
    v = check(lines, 4, 16, "", kill_rank_at=2)
    assert not v["steps_logged_once"]  # step 2 twice, step 4 missing
    assert v["short_batches"] == [(3, 12)] and not v["batches_whole"]
    assert v["trainer_restart_recorded"] is False and v["engine_restarts"] == 0
    assert not v["no_nan"] and v["bad_numbers"][0][:2] == (2, "train/loss")  # any line, superseded or not
    v = check([rec(1, **{"train/grad_norm": None})], 1, 16, "", kill_rank_at=9)
    assert v["bad_numbers"] == [(1, "train/grad_norm", None)] and v["trainer_restart_recorded"] is None
