"""Trajectory data model: serialization round trips and one-line validation errors."""
import json
import pickle

import numpy as np
import pytest

from arl.data import Trajectory, TrajectoryStatus, load_trajectories, save_trajectories


def make(L=12, seed=0, **kw):
    rng = np.random.default_rng(seed)
    cid = np.full(L, -1, dtype=np.int32)
    cid[2:5] = 0
    cid[7:10] = 1
    args = dict(tokens=rng.integers(0, 50000, L), chunk_ids=cid, rollout_logp=-rng.random(L).astype(np.float32),
                reward=0.5, group_id=3, policy_version=7, turns=[(2, 5), (7, 10)],
                status=TrajectoryStatus.OK, metadata={"task": "t1", "tool_calls": ["search"], "latency_s": 0.25})
    args.update(kw)
    return Trajectory(**args)


def same(a: Trajectory, b: Trajectory):
    for name in ("tokens", "chunk_ids", "rollout_logp"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    for name in ("reward", "group_id", "policy_version", "status", "metadata"):
        assert getattr(a, name) == getattr(b, name), name
    assert [tuple(t) for t in a.turns] == [tuple(t) for t in b.turns]


def test_fields_and_derived():
    t = make()
    assert len(t) == 12 and t.num_trained_tokens == 6 and t.num_chunks == 2
    assert t.loss_mask.tolist() == (t.chunk_ids >= 0).tolist()
    assert t.tokens.dtype == np.int32 and t.rollout_logp.dtype == np.float32
    assert make(chunk_ids=np.full(12, -1), turns=[]).num_chunks == 0


@pytest.mark.parametrize("how", ["dict_json", "json", "pickle"])
def test_round_trip(how):
    t = make(status=TrajectoryStatus.MASKED)
    if how == "dict_json":
        back = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))
    elif how == "json":
        back = Trajectory.from_json(t.to_json())
    else:
        back = pickle.loads(pickle.dumps(t))
    same(t, back)


def test_safetensors_round_trip(tmp_path):
    trajs = [make(L=L, seed=L, group_id=L % 3, reward=float(L) / 7) for L in (12, 15, 40)]
    trajs.append(make(L=0, chunk_ids=[], turns=[], tokens=[], rollout_logp=[], status="filtered"))
    p = str(tmp_path / "step.safetensors")
    save_trajectories(p, trajs)
    back = load_trajectories(p)
    assert len(back) == len(trajs)
    for a, b in zip(trajs, back):
        same(a, b)
    save_trajectories(p, [])
    assert load_trajectories(p) == []


def test_load_rejects_other_files(tmp_path):
    from safetensors.numpy import save_file

    p = str(tmp_path / "x.safetensors")
    save_file({"a": np.zeros(2)}, p)
    with pytest.raises(ValueError, match="not an arl trajectories file"):
        load_trajectories(p)


@pytest.mark.parametrize("kw, match", [
    (dict(chunk_ids=np.zeros(11)), r"chunk_ids: shape \(11,\) does not match tokens \(12,\)"),
    (dict(rollout_logp=np.zeros(13)), r"rollout_logp: shape"),
    (dict(tokens=np.zeros((3, 4))), r"tokens: expected a 1-D array"),
    (dict(tokens=np.r_[np.zeros(5), -3, np.zeros(6)]), r"tokens: negative token id -3 at index 5"),
    (dict(chunk_ids=np.r_[np.full(4, -1), -2, np.full(7, -1)]), r"chunk_ids: value -2 at index 4"),
    (dict(chunk_ids=np.r_[np.full(3, -1), [1, 1, 0], np.full(6, -1)]), r"chunk_ids: goes backwards at index 5 \(0 after 1\)"),
    (dict(rollout_logp=np.r_[np.zeros(3), np.nan, np.zeros(8)]), r"rollout_logp: non-finite value nan at trained index 3"),
    (dict(reward=float("inf")), r"reward: must be finite"),
    (dict(turns=[(2, 5), (9, 13)]), r"turns\[1\]: span \(9, 13\)"),
    (dict(turns=[(5, 2)]), r"turns\[0\]"),
    (dict(status="lost"), r"lost"),
])
def test_validation_errors(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        make(**kw)
    assert "\n" not in str(e.value)


def test_untrained_rollout_logp_may_be_anything():
    lp = np.zeros(12, dtype=np.float32)
    lp[0], lp[5], lp[11] = np.nan, np.inf, -np.inf  # prompt / observation tokens: never sampled, never read
    t = make(rollout_logp=lp)
    np.testing.assert_array_equal(t.rollout_logp, lp)  # kept as given (NaN == NaN here), not cleaned
    assert t.num_trained_tokens == 6 and not np.isfinite(t.rollout_logp[~t.loss_mask]).all()
    lp[4] = np.nan  # the same value on a trained token is an error
    with pytest.raises(ValueError, match="non-finite value nan at trained index 4"):
        make(rollout_logp=lp)


def test_from_dict_key_errors():
    d = make().to_dict()
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['rewards'\]"):
        Trajectory.from_dict({**d, "rewards": 1.0})
    d.pop("tokens")
    with pytest.raises(ValueError, match=r"missing key\(s\) \['tokens'\]"):
        Trajectory.from_dict(d)
