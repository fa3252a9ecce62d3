"""``share_prefix``'s step report (arl/data/share_report.py): a group whose sequences share no laid-out
prefix is counted and gets a one-line reason (different system prompts; split over micro-batches);
groups that share are not; the step log's line is one line."""
import numpy as np

from arl.data import Trajectory
from arl.data.packer import PackerConfig, pack_step
from arl.data.share_report import fallback_line, log_share, share_report, sharing_sequences

from test_share_prefix_step import tree_trajectories


def _traj(tokens, gid):
    L = len(tokens)
    chunk = np.full(L, -1, dtype=np.int32)
    chunk[L // 2:] = 0
    return Trajectory(tokens=np.asarray(tokens), chunk_ids=chunk, rollout_logp=np.zeros(L, np.float32), reward=1.0,
                      group_id=gid)


def test_a_group_with_different_system_prompts_falls_back_with_its_reason():
    rng = np.random.default_rng(0)
    trajs = tree_trajectories()  # groups 0-2 share the system block and their prompts; group 3 is one sequence
    # group 7: each member its own system prompt (first tokens differ), the same task prompt after it
    prompt = rng.integers(0, 64, 20)
    trajs += [_traj(np.concatenate([[k], rng.integers(0, 64, 15), prompt, rng.integers(0, 64, 8)]), 7)
              for k in range(3)]
    packed = pack_step(trajs, PackerConfig(token_budget=400, share_prefix=True))
    report = share_report(packed, 16)
    assert report["reasons"] == ["group 7: its 3 sequences share 0 leading tokens (< min_shared 16)"]
    m = report["metrics"]
    assert m["share_prefix/fallback_groups"] == 1.0 and m["share_prefix/groups"] == 4.0  # 0-2 and 7
    assert 0 < m["share_prefix/computed_frac"] < 1
    line = fallback_line(report)
    assert line == "share_prefix: 1 of 4 groups packed without sharing: " + report["reasons"][0]
    for mb in packed.all_micro_batches():  # the fallback group's sequences share nothing; the others do
        shares = sharing_sequences(mb)
        for g, s in zip(mb.group_ids.tolist(), shares):
            assert s == (g in (0, 1, 2)) or g < 0, (g, s)  # MASKED placeholders: groups of their own


def test_a_split_group_that_shares_nowhere_and_a_clean_step():
    rng = np.random.default_rng(1)
    head = rng.integers(0, 64, 30)  # common to the group, but one sequence fills a micro-batch
    trajs = [_traj(np.concatenate([head, rng.integers(0, 64, 20)]), 0) for _ in range(3)]
    packed = pack_step(trajs, PackerConfig(token_budget=60, share_prefix=True))
    assert packed.split_groups == [0]
    report = share_report(packed, 16)
    assert report["reasons"] == ["group 0: split over 3 micro-batches, no part shares a prefix there"]
    assert "\n" not in fallback_line(report)
    clean = share_report(pack_step(trajs, PackerConfig(token_budget=200, share_prefix=True)), 16)
    assert clean["reasons"] == [] and fallback_line(clean) == ""
    assert clean["metrics"]["share_prefix/fallback_groups"] == 0.0
    assert clean["metrics"]["share_prefix/computed_frac"] == (30 + 3 * 20) / 150


def test_many_fallbacks_stay_one_line():
    rng = np.random.default_rng(2)
    trajs = [_traj(np.concatenate([[g * 8 + k], rng.integers(0, 64, 20)]), g) for g in range(5) for k in range(2)]
    report = share_report(pack_step(trajs, PackerConfig(token_budget=400, share_prefix=True)), 16)
    line = fallback_line(report)
    assert line.startswith("share_prefix: 5 of 5 groups packed without sharing: group 0:") and line.endswith("; 2 more")
    assert "\n" not in line


def test_the_step_log_gets_the_line_and_the_record_the_metrics(capsys):
    rng = np.random.default_rng(3)
    trajs = [_traj(np.concatenate([[k], rng.integers(0, 64, 20)]), 4) for k in range(2)]
    packed = pack_step(trajs, PackerConfig(token_budget=400, share_prefix=True))
    metrics = log_share(packed, 16, version=12)
    assert metrics["share_prefix/fallback_groups"] == 1.0
    out = capsys.readouterr().out
    assert out == ("arl.train: step 12: share_prefix: 1 of 1 groups packed without sharing: group 4: its 2 "
                   "sequences share 0 leading tokens (< min_shared 16)\n")
    trajs = [_traj(np.concatenate([[9] * 20, rng.integers(0, 64, 20)]), 4) for k in range(2)]
    assert log_share(pack_step(trajs, PackerConfig(token_budget=400, share_prefix=True)), 16, 13)[
        "share_prefix/fallback_groups"] == 0.0
    assert capsys.readouterr().out == ""
