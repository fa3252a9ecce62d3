"""arl.metrics: exact trajectory statistics on scripted batches, token-level helpers on real packed
micro-batches, the JSONL/TensorBoard/W&B logger (round trip, resume, NaN) and the curves plot."""
import json
import math
import re
import runpy
import struct
import sys
import warnings

import numpy as np
import pytest
import torch

from arl.data.packer import PackerConfig, pack_step
from arl.data.trajectory import Trajectory, TrajectoryStatus
from arl.ops.policy_loss.config import LossConfig
from arl.algo.advantages import group_advantages
from arl.config import AlgoConfig
from arl.metrics import per_turn_mean, per_turn_sums, success_logprob_mean, success_rate, trajectory_metrics, turn_means
from arl.config import WANDB_PIN, WandbConfig
from arl.metrics.logger import MetricsLogger, read_metrics
from arl.plot import main as plot_main
from arl.algo.step import group_step_advantages, step_advantages
from estimator_ref import ref as ref_group_advantages

OK, MASKED, FILTERED = TrajectoryStatus.OK, TrajectoryStatus.MASKED, TrajectoryStatus.FILTERED


def traj(n, turns, reward=0.0, group=0, version=0, status=OK, tokens=None, **meta):
    cid = np.full(n, -1, np.int32)
    if status is not MASKED:
        for k, (a, b) in enumerate(turns):
            cid[a:b] = k
    toks = np.arange(n) % 50 if tokens is None else tokens
    return Trajectory(tokens=toks, chunk_ids=cid, rollout_logp=np.zeros(n), reward=reward, group_id=group,
                      policy_version=version, turns=[] if status is MASKED else turns, status=status, metadata=meta)


def call(tool, args, error=False):
    return {"tool": tool, "args": args, "error": error}


@pytest.fixture
def batch():
    return [
        traj(12, [(2, 5), (7, 12)], 1.0, 0, 5, calls=[call("lookup", {"key": "a"})], tools={"lookup": 1},
             gen_s=1.0, tool_s=0.5, fault="none"),
        traj(20, [(2, 6), (8, 12), (14, 20)], 0.0, 0, 4, tools={"lookup": 2}, truncated="max_turns", gen_s=3.0,
             calls=[call("lookup", {"key": "a"}), call("lookup", {"key": "a"}), call(None, None, True)]),
        traj(8, [(3, 8)], 0.0, 1, 5, tool_calls=1, tool_errors=0, tools={"search": 1}),  # no "calls": counters
        traj(6, [], 0.0, 1, 3, MASKED, fault="unrecoverable"),
        traj(4, [(1, 4)], 0.5, 2, 5, FILTERED, fault="recoverable", tools={"lookup": 9}),
        traj(10, [(4, 10)], 0.5, 2, 5, calls=[]),
    ]


def test_trajectory_metrics_exact(batch):
    m = trajectory_metrics(batch, rollout_s=2.0)
    r = np.array([1.0, 0.0, 0.0, 0.5])  # the OK trajectories
    expected = {
        "status/ok": 4, "status/masked": 1, "status/filtered": 1, "status/truncated": 1, "status/faults": 2,
        "reward/mean": 0.375, "reward/std": math.sqrt(0.171875), "reward/min": 0.0, "reward/max": 1.0,
        "reward/q10": 0.0, "reward/q25": 0.0, "reward/q50": 0.25, "reward/q75": 0.625, "reward/q90": 0.85,
        "reward/pos_frac": 0.5, "success/train": 0.25,
        "len/tokens_mean": 12.5, "len/tokens_max": 20, "len/gen_tokens_mean": 33 / 4, "len/gen_tokens_max": 14,
        "len/turns_mean": 1.75, "len/turns_max": 3,
        "len/failed_count": 3, "len/failed_tokens_mean": 38 / 3, "len/failed_tokens_max": 20,
        "len/success_count": 1, "len/success_tokens_mean": 12, "len/success_tokens_max": 12,
        # attempts: 1 + 3 + (counters: 1 named, 0 errors) + 0 = 5; valid 1 + 2 + 1 = 4
        "tools/calls": 5, "tools/calls_per_traj": 1.25, "tools/valid_rate": 0.8,
        "tools/repeat_rate": 1 / 5, "tools/repeat_trajs_frac": 1 / 4,
        "tools/count/lookup": 3, "tools/per_traj/lookup": 0.75, "tools/count/search": 1, "tools/per_traj/search": 0.25,
        "rollout/tokens_per_s": 60 / 2, "rollout/gen_tokens_per_s": (33 + 0 + 3) / 2,
        "time/gen_s_mean": 2.0, "time/tool_s_mean": 0.5,
    }
    assert set(m) == set(expected)
    for k, v in expected.items():
        assert m[k] == pytest.approx(v, abs=1e-12), k
    assert float(np.std(r)) == pytest.approx(m["reward/std"])


def test_step_advantage_figures_exact(batch):
    """The step's advantages and their figures, computed once (arl/algo/step.py)."""
    g0 = 0.5 / (math.sqrt(0.5) + 1e-6)  # group 0: rewards (1, 0), unbiased std sqrt(0.5)
    adv = step_advantages(batch, LossConfig())
    # non-FILTERED: g0 (1, 0) -> +-g0; g1 (0, 0 masked) and g2 (0.5 alone) have zero variance;
    # the FILTERED trajectory is not packed: 0, in no group
    np.testing.assert_allclose(adv.advantages, [g0, -g0, 0, 0, 0, 0], rtol=0, atol=1e-12)
    expected = {"adv/nonzero_frac": 2 / 5, "adv/negative_frac": 1 / 5, "adv/zero_var_group_frac": 2 / 3,
                "stab/neg_adv_share": 1 / 4, "stab/adv_mean": 0.0, "stab/adv_abs_mean": 2 * g0 / 4}
    for k, v in expected.items():
        assert adv.metrics[k] == pytest.approx(v, abs=1e-12), k
    # the loss's own group_advantages over the same population
    kept = [t for t in batch if t.status is not FILTERED]
    ref, nz, G = group_advantages([t.reward for t in kept], [t.group_id for t in kept], "grpo", 1e-6)
    assert adv.advantages[0] == pytest.approx(ref[0], abs=0) and (nz, G) == (2, 3)


def test_metrics_optional_keys_and_empty_sets():
    t = traj(5, [(1, 5)], 0.0, tool_calls=3, tool_errors=1)  # counters only, no tokenizer: no repeat keys
    m = trajectory_metrics([t])
    assert m["tools/valid_rate"] == pytest.approx(2 / 3) and m["tools/calls"] == 3
    assert not any(k.startswith(("tools/repeat", "staleness/", "rollout/", "time/")) for k in m)
    assert m["len/success_count"] == 0 and m["len/success_tokens_max"] == 0.0
    empty = trajectory_metrics([])
    assert all(math.isfinite(v) for v in empty.values()) and empty["reward/mean"] == 0.0
    # per-tool counts from the call records when the episode kept no "tools" counter
    u = traj(5, [(1, 5)], 1.0, calls=[call("lookup", {"k": 1}), call("run", {}), call(None, None, True)])
    assert {k: v for k, v in trajectory_metrics([u]).items() if k.startswith("tools/count/")} == {
        "tools/count/lookup": 1.0, "tools/count/run": 1.0}
    assert success_rate([u, t, traj(2, [], 1.0, status=MASKED)]) == 0.5 and success_rate([]) == 0.0
    only_masked = trajectory_metrics([traj(3, [], status=MASKED)])
    assert only_masked["status/masked"] == 1 and only_masked["success/train"] == 0.0
    assert all(math.isfinite(v) for v in only_masked.values())


def test_metrics_bad_input():
    t = traj(3, [(1, 3)])
    with pytest.raises(ValueError, match=r"trajs\[1\]"):
        trajectory_metrics([t, "x"])
    with pytest.raises(ValueError, match="rollout_s"):
        trajectory_metrics([t], rollout_s=0.0)
    with pytest.raises(ValueError, match="rewards: shape"):
        group_step_advantages([t], [1.0, 0.0], AlgoConfig())
    with pytest.raises(ValueError, match="non-finite"):
        group_step_advantages([t], [float("nan")], AlgoConfig())


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "none"])
def test_step_advantages_match_the_estimator(estimator):
    rng = np.random.default_rng(0)
    rewards, groups = rng.integers(0, 3, 24).astype(float) - 1, np.repeat(np.arange(6), 4)
    # an independent computation (plain floats, one group at a time), not the registry's own code
    adv = np.array(ref_group_advantages(estimator, rewards.tolist(), groups.tolist(), 1e-6))
    by_group = [rewards[groups == g] for g in range(6)]
    nz, G = sum(1 for v in by_group if v.max() == v.min()), len(by_group)
    assert 0 < (adv != 0).sum() < adv.size and 0 < nz < G  # the draw exercises every branch
    trajs = [traj(4, [(1, 4)], float(r), int(g)) for r, g in zip(rewards, groups)]
    s = step_advantages(trajs, LossConfig(), algo=AlgoConfig(advantage=estimator))
    np.testing.assert_allclose(s.advantages, adv, rtol=1e-12, atol=1e-15)
    assert s.metrics["adv/nonzero_frac"] == pytest.approx(float((adv != 0).mean()))
    assert s.metrics["adv/negative_frac"] == pytest.approx(float((adv < 0).mean()))
    assert s.metrics["adv/zero_var_group_frac"] == pytest.approx(nz / G)


def test_repeated_calls_from_decoded_turns():
    """Without ``calls`` metadata, repeats are read back from the turns with a real tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    pieces = ["user: find a\n", 'hmm <tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>', "obs\n",
              '<tool_call>{"arguments":{"key":"a"},"name":"lookup"}</tool_call>', "obs\n",
              "<tool_call>{oops</tool_call>", "obs\n", "<answer>v</answer>"]
    tok.train_from_iterator(pieces, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    ids, turns = [], []
    for i, p in enumerate(pieces):
        enc = tok.encode(p).ids
        if i % 2:
            turns.append((len(ids), len(ids) + len(enc)))
        ids += enc
    t = traj(len(ids), turns, tokens=np.array(ids), tool_calls=2, tool_errors=1)
    m = trajectory_metrics([t], tokenizer=tok)
    assert m["tools/repeat_trajs_frac"] == 1.0
    assert m["tools/repeat_rate"] == pytest.approx(1 / m["tools/calls"])
    assert "tools/repeat_rate" not in trajectory_metrics([t])


def test_per_turn_entropy_and_success_logp_on_packed_batches():
    ts = [traj(9, [(1, 3), (5, 9)], 1.0, 0), traj(7, [(2, 4), (5, 6)], 0.0, 0), traj(6, [(3, 6)], 1.0, 1)]
    step = pack_step(ts, PackerConfig(token_budget=16, keep_groups=False))
    mbs = [mb for mb in step.all_micro_batches() if not mb.is_empty]
    assert len(mbs) >= 2  # the helpers sum over several micro-batches
    # per-token value = 10 * trajectory index + local chunk id: the turn means are known exactly
    vals = []
    for mb in mbs:
        v = torch.zeros(mb.num_tokens)
        for s, ti in enumerate(mb.traj_indices.tolist()):
            a, b = int(mb.cu_seqlens[s]), int(mb.cu_seqlens[s + 1])
            v[a:b] = 10.0 * ti + torch.from_numpy(ts[ti].chunk_ids).float()
        vals.append(v)
    cids, cus = [mb.chunk_ids for mb in mbs], [mb.cu_seqlens for mb in mbs]
    # turn 0: 2 tokens of t0 (0), 2 of t1 (10), 3 of t2 (20); turn 1: 4 of t0 (1), 1 of t1 (11)
    assert per_turn_mean(vals, cids, cus) == pytest.approx({"entropy/turn_0": (0 + 20 + 60) / 7,
                                                            "entropy/turn_1": (4 + 11) / 5})
    sums, counts = per_turn_sums(vals, cids, cus, num_turns=4)
    assert counts.tolist() == [7, 5, 0, 0] and set(turn_means(sums, counts, "e/")) == {"e/0", "e/1"}
    succ = [torch.tensor([ts[i].reward >= 1.0 for i in mb.traj_indices.tolist()]) for mb in mbs]
    # successful: t0 (2 x 0, 4 x 1) and t2 (3 x 20)
    assert success_logprob_mean(vals, cids, cus, succ) == {"logp/success_mean": pytest.approx(64 / 9)}
    assert success_logprob_mean(vals, cids, cus, [torch.zeros_like(s) for s in succ]) == {}
    with pytest.raises(ValueError, match="micro-batch 0"):
        per_turn_sums([vals[0][:-1]], cids[:1], cus[:1])
    with pytest.raises(ValueError, match="success flags"):
        success_logprob_mean(vals[:1], cids[:1], cus[:1], [torch.ones(99, dtype=torch.bool)])
    with pytest.raises(ValueError, match="one per micro-batch"):
        per_turn_sums(vals, cids[:1], cus)


# ------------------------------------------------------------------ logger
def test_logger_jsonl_roundtrip_resume_and_nan(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, progress=False) as lg:
        for s in range(5):
            lg.log(s, {"reward/mean": s / 10, "loss": {"clip_frac": np.float32(0.25)}, "n": np.int64(s),
                       "ok": True, "kl": torch.tensor(0.5)}, wall_s=float(s))
        with pytest.raises(ValueError, match="step 4 is not after"):
            lg.log(4, {}, 0.0)
        with pytest.raises(ValueError, match=r"metrics\['bad'\]"):
            lg.log(5, {"bad": "x"}, 0.0)
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(5))
    assert recs[3] == {"step": 3, "wall_s": 3.0, "reward/mean": 0.3, "loss/clip_frac": 0.25, "n": 3, "ok": 1, "kl": 0.5}

    # crash: a torn last line, then resume from the step-2 checkpoint
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "rew')
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with MetricsLogger(tmp_path, tensorboard=False, progress=False, resume_step=2) as lg:
            assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
            with pytest.raises(ValueError, match="not after"):
                lg.log(2, {}, 0.0)
            for s in (3, 4, 5):
                rec = lg.log(s, {"loss": float("nan"), "gn": float("inf") if s == 4 else 1.0, "x": 1.0}, wall_s=s)
    assert rec == {"step": 5, "wall_s": 5.0, "loss": None, "gn": 1.0, "x": 1.0}
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    assert len(msgs) == 2 and "'loss'" in msgs[0] and "'gn'" in msgs[1]  # once per key
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2, 3, 4, 5]
    assert "NaN" not in "".join(lines) and json.loads(lines[4])["gn"] is None

    # a fresh run (no resume_step) starts the file over
    MetricsLogger(tmp_path, tensorboard=False, progress=False).close()
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def test_logger_tensorboard_and_progress(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, total_steps=3, progress=True) as lg, pytest.warns(RuntimeWarning, match="'bad'"):
        for s in range(3):
            lg.log(s, {"reward/mean": float(s), "train/clip_frac": 0.125, "bad": float("nan")}, wall_s=s)
    err = capsys.readouterr().err
    assert "3/3" in err and "reward=2" in err and "clip=0.125" in err
    with MetricsLogger(tmp_path, total_steps=5, resume_step=1) as lg:  # 2 steps kept: the bar resumes at 2/5
        lg.log(2, {"reward/mean": 5.0}, wall_s=3.0)
    assert "3/5" in capsys.readouterr().err
    ev = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert ev, "no TensorBoard event file"
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()  # the resumed run purged step 2 of the first run and rewrote it
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(0, 0.0), (1, 1.0), (2, 5.0)]
    assert "bad" not in acc.Tags()["scalars"]


def _wandb_records(path):
    """The records of a ``run-<id>.wandb`` file: a LevelDB-style log (a 7-byte file header, 32 KiB
    blocks of records, each with a 7-byte header: crc32, length, type full/first/middle/last) of
    ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # full, or the last fragment
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def _wandb_history(run_dir):
    """{offline run dir name: [(step, {key: value})]} of every offline W&B run under ``run_dir``."""
    out = {}
    for f in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        steps = []
        for r in _wandb_records(f):
            if r.WhichOneof("record_type") == "history":
                items = ((i.key or "/".join(i.nested_key), i.value_json) for i in r.history.item)
                vals = {k: json.loads(v) for k, v in items if not k.startswith("_")}
                steps.append((r.history.step.num, vals))
        out[f.parent.name] = steps
    return out


def test_logger_wandb_offline_run_and_resume(tmp_path, monkeypatch):
    """logging.wandb in offline mode (no network, no account): the W&B run under the run dir holds
    the flattened records at their steps (non-finite values left out), and a resume continues the
    run with the same id."""
    pytest.importorskip("wandb", reason=f"wandb is optional: pip install {WANDB_PIN}")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = WandbConfig(project="arl-test", tags=["unit"])
    with MetricsLogger(tmp_path, tensorboard=False, progress=False, wandb=cfg, run_config={"seed": 3}) as lg:
        lg.log(0, {"sft": {"nll": 1.5}}, wall_s=0.5)
        with pytest.warns(RuntimeWarning, match="'loss'"):
            lg.log(1, {"reward/mean": 0.25, "loss": float("nan"), "ok": True}, wall_s=1.0)
    run_id = (tmp_path / "wandb_run_id").read_text()
    (first,) = _wandb_history(tmp_path).values()
    assert first == [(0, {"wall_s": 0.5, "sft/nll": 1.5}), (1, {"wall_s": 1.0, "reward/mean": 0.25, "ok": 1})]
    with MetricsLogger(tmp_path, tensorboard=False, progress=False, wandb=cfg, resume_step=1) as lg:
        lg.log(2, {"reward/mean": 0.5}, wall_s=2.0)
    assert (tmp_path / "wandb_run_id").read_text() == run_id
    runs = _wandb_history(tmp_path)
    # one W&B run, two sessions (W&B adds "-1" to a second session's directory begun in the same second)
    assert len(runs) == 2 and all(re.search(rf"-{re.escape(run_id)}(-\d+)?$", name) for name in runs), list(runs)
    assert [(2, {"wall_s": 2.0, "reward/mean": 0.5})] in runs.values()
    MetricsLogger(tmp_path, tensorboard=False, progress=False, wandb=cfg).close()  # a fresh run: a new W&B run
    assert (tmp_path / "wandb_run_id").read_text() != run_id


def test_evaluated_samples_become_a_wandb_table_at_their_step(tmp_path, monkeypatch):
    """``logging.wandb.samples``: the few episodes an evaluation sends with its result are logged
    as the table ``heldout/samples`` at the evaluated step, after that step's record."""
    pytest.importorskip("wandb", reason=f"wandb is optional: pip install {WANDB_PIN}")
    from arl.trainer.step_log import OrderedLog

    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = [{"seed": 1000000 + i, "success": i == 0, "reward": float(i == 0), "transcript": f"--- task {i}"}
            for i in range(2)]
    with MetricsLogger(tmp_path, tensorboard=False, progress=False, wandb=WandbConfig(project="arl-test")) as lg:
        log = OrderedLog(lg, eval_versions={0, 2})
        log.add(0, {"reward/mean": 0.1}, 0.5)
        log.eval_result(0, 0.5, rows)
        log.add(1, {"reward/mean": 0.2}, 1.0)
        log.add(2, {"reward/mean": 0.3}, 1.5)
        log.eval_result(2, 1.0, [])  # samples off (0) or none: no table
    (hist,) = _wandb_history(tmp_path).values()
    tables = [(step, {k.split("/")[-1]: v for k, v in vals.items() if k.startswith("heldout/samples/")})
              for step, vals in hist if any(k.startswith("heldout/samples/") for k in vals)]
    assert [step for step, _ in tables] == [0], hist
    assert tables[0][1]["_type"] == "table-file" and tables[0][1]["nrows"] == 2 and tables[0][1]["ncols"] == 4, tables
    assert [r["success/heldout"] for r in read_metrics(tmp_path / "metrics.jsonl") if "success/heldout" in r] == [0.5, 1.0]


# ------------------------------------------------------------------ plot
def _synthetic_run(d, n=12, speed=4.0):
    with MetricsLogger(d, tensorboard=False, progress=False) as lg:
        for s in range(n):
            p = 1 - math.exp(-s / speed)
            lg.log(s, {"reward/mean": p, "success/train": p, "success/heldout": 0.9 * p, "train/approx_kl": 0.01,
                       "train/clip_frac": 0.1, "grad_norm": 1.0 + p, "len/tokens_mean": 100 + s,
                       "tools/valid_rate": p, "staleness/mean": 0.5, "rollout/tokens_per_s": 900.0,
                       "entropy/turn_0": 2 - p}, wall_s=2.0 * s)


def test_plot_png_from_run_dirs(tmp_path, capsys):
    _synthetic_run(tmp_path / "ipa")
    _synthetic_run(tmp_path / "grpo", speed=8.0)
    out = tmp_path / "cmp" / "curves.png"
    assert plot_main([str(tmp_path / "ipa"), str(tmp_path / "grpo"), "--out", str(out), "--x", "wall"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert capsys.readouterr().out.strip() == str(out)


def test_plot_errors(tmp_path, capsys, monkeypatch):
    assert plot_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no metrics.jsonl" in err
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "wall_s": 0.0, "foo": 1}\n')
    assert plot_main([str(tmp_path)]) == 2 and "no plottable metric" in capsys.readouterr().err
    # the `python -m arl.plot` entry point (run in-process: a subprocess costs a 10 s import)
    monkeypatch.setattr(sys, "argv", ["arl.plot", str(tmp_path / "nope")])
    monkeypatch.delitem(sys.modules, "arl.plot")  # run as __main__, not as the module imported above
    with pytest.raises(SystemExit) as e:
        runpy.run_module("arl.plot", run_name="__main__")
    assert e.value.code == 2 and "no metrics.jsonl" in capsys.readouterr().err


def test_plot_groups_mean_and_band(tmp_path, capsys):
    from arl.plot import _group_curve

    for i, speed in enumerate((3.0, 6.0)):
        _synthetic_run(tmp_path / f"ipa{i}", speed=speed)
    _synthetic_run(tmp_path / "grpo0", speed=9.0)
    out = tmp_path / "groups.png"
    args = ["--group", f"ipa={tmp_path / 'ipa0'},{tmp_path / 'ipa1'}", "--group", f"grpo={tmp_path / 'grpo0'}",
            "--x", "wall", "--out", str(out)]
    assert plot_main(args) == 0 and out.read_bytes()[:4] == b"\x89PNG"
    xs, mean, lo, hi, n = _group_curve([tmp_path / "ipa0", tmp_path / "ipa1"], "success/heldout", "wall_s")
    assert n == 2 and xs == [2.0 * s for s in range(12)]
    p = [0.9 * (1 - math.exp(-s / 3.0)) for s in range(12)], [0.9 * (1 - math.exp(-s / 6.0)) for s in range(12)]
    assert mean == pytest.approx([(a + b) / 2 for a, b in zip(*p)])
    assert lo == pytest.approx(p[1]) and hi == pytest.approx(p[0])
    capsys.readouterr()
    assert plot_main(["--group", "broken", "--out", str(out)]) == 2
    assert "NAME=DIR" in capsys.readouterr().err
    assert plot_main([str(tmp_path / "ipa0"), "--group", f"x={tmp_path / 'ipa0'}"]) == 2
    assert plot_main(["--group", f"x={tmp_path / 'ipa0'}", "--key", "nope/none", "--out", str(out)]) == 2


def test_plot_groups_zero_aligns_each_run_at_its_first_record(tmp_path):
    """``--zero``: a run whose first evaluation came after a warm start (continued SFT's clock
    starts at the replayed SFT) is drawn from x = 0, like the runs that evaluated at once."""
    from arl.plot import _group_curve

    with MetricsLogger(tmp_path / "late", tensorboard=False, progress=False) as lg:
        for s, (w, v) in enumerate([(1000.0, 0.0), (1010.0, 0.5), (1030.0, 1.0)]):
            lg.log(800 + 5 * s, {"success/heldout": v, "train/loss": 1.0}, wall_s=w)
    xs, mean, *_ = _group_curve([tmp_path / "late"], "success/heldout", "wall_s", zero=True)
    assert xs == [0.0, 10.0, 30.0] and mean == [0.0, 0.5, 1.0]
    assert _group_curve([tmp_path / "late"], "success/heldout", "step", zero=True)[0] == [0, 5, 10]
    assert _group_curve([tmp_path / "late"], "success/heldout", "wall_s")[0] == [1000.0, 1010.0, 1030.0]
    out = tmp_path / "z.png"
    assert plot_main(["--group", f"late={tmp_path / 'late'}", "--x", "wall", "--zero", "--out", str(out)]) == 0
    assert plot_main([str(tmp_path / "late"), "--zero", "--out", str(out)]) == 2  # not silently ignored
