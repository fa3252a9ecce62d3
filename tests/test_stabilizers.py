"""Stabilizers on scripted batches: exact masks, weights, advantages, schedules, monitors, IPA."""
import asyncio
import functools

import numpy as np
import pytest
import torch

from arl.algo.advantages import group_advantages
from arl.data.batch import RolloutBatch
from arl.data.expert import expert_trajectory, start_state, tag_resampled
from arl.data.packer import PackerConfig, pack_step
from arl.data.trajectory import Trajectory, TrajectoryStatus as S
from arl.ops.policy_loss import LossConfig, available_backends, policy_loss
from arl.rollout.manager import fill_batch
from arl.algo.ipa import ipa_mixed_loss, ipa_normalizers, split_chunk_roles
from arl.algo.shaping import shape_rewards
from arl.stabilizers import (AdaptiveKLController, Alarm, AlarmRule, DynamicSampler, IPAResampler, StabilizerConfig,
                             Stabilizers, behaviour_metrics, entropy_coef, filter_zero_variance_groups)
from arl.config.stabilizers import (AdaptiveKLConfig, DynamicSamplingConfig, EntropyScheduleConfig,
                                    IPAResampleConfig, MonitorConfig, ShapingConfig)

EPS = 1e-6  # the step advantages' (and turn credit's) eps: GRPO, arl/algo/step.py


def traj(reward=0.0, group=0, turn_lens=(3, 3), prompt=2, obs=2, status=S.OK, **meta):
    """prompt (-1) | turn 0 | obs (-1) | turn 1 | ...; token ids are arbitrary positive ints."""
    tokens, chunks, turns = [1] * prompt, [-1] * prompt, []
    for k, n in enumerate(turn_lens):
        if k:
            tokens += [2] * obs
            chunks += [-1] * obs
        turns.append((len(tokens), len(tokens) + n))
        tokens += [10 + k] * n
        chunks += [k] * n
    return Trajectory(tokens=tokens, chunk_ids=chunks, rollout_logp=np.full(len(tokens), -1.0, np.float32),
                      reward=reward, group_id=group, turns=turns, status=status, metadata=dict(meta))


def group_std(r):
    r = np.asarray(r, dtype=np.float64)
    if r.max() == r.min():
        return np.zeros_like(r)
    return (r - r.mean()) / (r.std(ddof=1) + EPS)


# ---------------------------------------------------------------------------------------- config
def test_config_defaults_off_and_one_line_errors():
    cfg = StabilizerConfig()
    assert not any(getattr(cfg, k).enabled for k in type(cfg).model_fields if k != "stall")
    assert (cfg.stall.patience, cfg.stall.action) == (20, "stop")  # the one guard on by default
    for bad, key in [(dict(kl=dict(targt=1)), "kl.targt: unknown key"), (dict(shaping=dict(cap=1.0)), "cap"),
                     (dict(curriculum=dict(enabled=True)), "until_step"), (dict(entropy=dict(steps=0)), "entropy.steps"),
                     (dict(monitors=dict(alarms=[dict(z=1.0)])), "monitors.alarms.0.signal"),
                     (dict(stall=dict(patience=-1)), "stall.patience"), (dict(stall=dict(action="halt")), "stall.action"),
                     (dict(stall=dict(patiense=5)), "stall.patiense: unknown key")]:
        with pytest.raises(ValueError, match=key) as e:
            StabilizerConfig(**bad)
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------ dynamic sampling
def test_filter_zero_variance_groups_exact():
    b = [traj(1, 0), traj(1, 0), traj(0, 1), traj(1, 1), traj(0, 2), traj(0, 2),
         traj(1, 3), traj(0, 3, status=S.MASKED)]  # group 3: one OK member -> zero variance
    kept, m = filter_zero_variance_groups(b)
    assert [t.group_id for t in kept] == [1, 1]
    assert m["stab/zero_var_frac"] == 0.75 and m["stab/groups_kept"] == 1


def test_dynamic_sampler_fills_batch_with_bounded_retries():
    s = DynamicSampler(DynamicSamplingConfig(enabled=True, max_rounds=2), target_groups=3)
    assert s.groups_needed() == 3
    s.add([traj(1, 0), traj(0, 0), traj(0, 1), traj(0, 1), traj(1, 2), traj(1, 2)])
    assert s.groups_needed() == 2
    s.add([traj(1, 3), traj(0, 3), traj(0, 4), traj(0, 4)])
    assert s.groups_needed() == 1
    s.add([traj(0, 5), traj(1, 5), traj(1, 6), traj(0, 6)])
    assert s.groups_needed() == 0
    trajs, m = s.finish()
    assert sorted({t.group_id for t in trajs}) == [0, 3, 5]  # at most target groups, in arrival order
    assert m["stab/zero_var_frac"] == pytest.approx(3 / 7) and m["stab/sampling_rounds"] == 3
    # every sampled OK trajectory, dropped groups included: 6 of 14 succeeded; the kept ones hold 3 of 6
    assert m["stab/reward_mean_sampled"] == pytest.approx(6 / 14)


@pytest.mark.parametrize("on_short,expect", [("pad", [0, 1]), ("partial", [0])])
def test_dynamic_sampler_gives_up_after_max_rounds(on_short, expect):
    s = DynamicSampler(DynamicSamplingConfig(enabled=True, max_rounds=1, on_short=on_short), target_groups=2)
    s.add([traj(1, 0), traj(0, 0), traj(0, 1), traj(0, 1)])
    assert s.groups_needed() == 1
    s.add([traj(0, 2), traj(0, 2)])
    assert s.groups_needed() == 0  # retries spent
    trajs, m = s.finish()
    assert sorted({t.group_id for t in trajs}) == expect and m["stab/groups_short"] == 1


class _RefillManager:
    """Test double of RolloutManager.get_groups: hands out scripted groups, records the asks."""

    def __init__(self, groups):
        self.groups, self.asked = list(groups), []

    async def get_groups(self, n):
        self.asked.append(n)
        out, self.groups = self.groups[:n], self.groups[n:]
        return RolloutBatch(7, [t for g in out for t in g], {})


def test_fill_batch_asks_the_manager_for_replacements():
    first = RolloutBatch(7, [traj(1, 0), traj(0, 0), traj(0, 1), traj(0, 1), traj(1, 2), traj(1, 2)], {"rollout/x": 1})
    mgr = _RefillManager([[traj(0, 3), traj(0, 3)], [traj(1, 4), traj(0, 4)], [traj(0, 5), traj(1, 5)]])
    out = asyncio.run(fill_batch(mgr, first, functools.partial(DynamicSampler, DynamicSamplingConfig(enabled=True,
                                                                                                      max_rounds=3))))
    assert mgr.asked == [2, 1]  # two zero-variance groups dropped, then the one still missing
    assert out.step == 7 and sorted({t.group_id for t in out.trajectories}) == [0, 4, 5]
    assert out.metrics["rollout/x"] == 1 and out.metrics["stab/extra_trajectories"] == 6
    assert out.metrics["stab/zero_var_frac"] == pytest.approx(3 / 6)
    off = asyncio.run(fill_batch(mgr, first, None))
    assert off is first and mgr.asked == [2, 1]  # off: no extra sampling at all


def test_dynamic_sampler_off_passes_through_but_reports():
    s = DynamicSampler(DynamicSamplingConfig(), target_groups=2)
    s.add([traj(0, 0), traj(0, 0), traj(1, 1), traj(0, 1)])
    assert s.groups_needed() == 0
    trajs, m = s.finish()
    assert len(trajs) == 4 and m["stab/zero_var_frac"] == 0.5


# ----------------------------------------------------------------------------------------- shaping
def test_shaping_exact_and_capped():
    cfg = ShapingConfig(enabled=True, per_checkpoint=0.1, cap=0.5)
    info = [dict(tool="lookup", tool_error=False, call="a", observation="k1"),
            dict(tool="lookup", tool_error=False, call="a", observation="k1"),  # repeat: nothing
            dict(tool="lookup", tool_error=True, call="b"),  # error: nothing
            dict(tool=None, tool_error=False)]  # the answer
    spam = [dict(tool="lookup", tool_error=False, call=str(i), new_state=True) for i in range(20)]
    b = [traj(0, turn_info=info), traj(1, turn_info=info), traj(0, turn_info=spam), traj(1, turn_info=spam),
         traj(0, tool_calls=5, tool_errors=2), traj(0, status=S.MASKED, turn_info=spam)]
    r, m = shape_rewards(b, cfg)
    np.testing.assert_allclose(r, [0.2, 1.2, 0.5, 1.5, 0.3, 0.0])
    assert m["stab/shaping_capped_frac"] == pytest.approx(2 / 5)
    assert r[[1, 3]].min() > r[[0, 2, 4]].max()  # the outcome dominates any shaping
    texts = [call("k1"), "think " + call("k1"), call("k2")]  # identical calls found from the turn texts
    r, _ = shape_rewards([traj(0, turn_info=[dict(tool="lookup")] * 3, turn_texts=texts)],
                         ShapingConfig(enabled=True, checkpoints=("valid_tool_call",)))
    assert r[0] == pytest.approx(0.2)
    # the episode's record: observation digests, and the env's new_state verdict when it gives one
    dig = [dict(tool="lookup", tool_error=False, call=str(i), obs_digest=d) for i, d in enumerate("aab")]
    r, _ = shape_rewards([traj(0, turn_info=dig)], ShapingConfig(enabled=True, checkpoints=("new_state",)))
    assert r[0] == pytest.approx(0.2)
    r, _ = shape_rewards([traj(0, turn_info=[dict(d, new_state=False) for d in dig])],
                         ShapingConfig(enabled=True, checkpoints=("new_state",)))
    assert r[0] == 0.0
    # IPA-replayed expert turns earn nothing, and a sampled turn repeating them earns nothing either
    replay = traj(0, turn_info=dig, ipa_prefix_chunks=1)
    r, _ = shape_rewards([replay], ShapingConfig(enabled=True, checkpoints=("new_state",)))
    assert r[0] == pytest.approx(0.1)  # turn 1 repeats turn 0's observation "a": only turn 2 ("b") pays
    r_off, m_off = shape_rewards(b, ShapingConfig())
    np.testing.assert_array_equal(r_off, [0, 1, 0, 1, 0, 0])
    assert not m_off


# ------------------------------------------------------------------- extremes and advantages
def scripted_batch():
    # group 0: a success and three failures, one of them long (40 trained tokens); group 1: mixed
    return [traj(1, 0), traj(0, 0, turn_lens=(20, 20)), traj(0, 0), traj(0, 0),
            traj(1, 1), traj(0, 1), traj(0, 1, status=S.FILTERED)]


def test_extreme_mask_and_negative_reweighting_exact():
    cfg = StabilizerConfig(extreme=dict(enabled=True, max_failed_tokens=20, negative_weight=0.5))
    prep = Stabilizers(cfg).prepare(scripted_batch())
    assert [t.status for t in prep.trajectories] == [S.OK, S.MASKED, S.OK, S.OK, S.OK, S.OK, S.FILTERED]
    assert prep.trajectories[1].metadata["stab_masked"] == "long_failure"
    a0, a1 = group_std([1, 0, 0, 0]), group_std([1, 0])  # the masked reward stays in the baseline
    expect = [a0[0], 0.0, 0.5 * a0[2], 0.5 * a0[3], a1[0], 0.5 * a1[1], 0.0]
    np.testing.assert_allclose(prep.advantages, expect, rtol=0, atol=1e-12)
    m = prep.metrics
    assert (m["stab/failed_len_max"], m["stab/success_len_max"], m["stab/long_failures"]) == (44, 10, 1)
    assert m["stab/failed_len_mean"] == pytest.approx((44 + 10 + 10 + 10) / 4)
    assert m["stab/failure_share"] == pytest.approx(4 / 6)
    assert m["stab/neg_adv_share"] == pytest.approx(3 / 5)


def test_extreme_weight_mode_exact():
    cfg = StabilizerConfig(extreme=dict(enabled=True, max_failed_tokens=20, action="weight", long_weight=0.25))
    prep = Stabilizers(cfg).prepare(scripted_batch())
    assert prep.trajectories[1].status is S.OK
    a0 = group_std([1, 0, 0, 0])
    np.testing.assert_allclose(prep.advantages[:4], [a0[0], 0.25 * a0[1], a0[2], a0[3]], rtol=0, atol=1e-12)


def test_off_gives_the_spec_advantages_and_weights_reach_the_loss():
    b = scripted_batch()
    loss_cfg = LossConfig()
    pcfg = PackerConfig(token_budget=256, keep_groups=False)
    plain = Stabilizers(loss_cfg=loss_cfg).prepare(b)
    assert plain.trajectories == b and plain.metrics["stab/failed_len_max"] == 44
    a0, a1 = group_std([1, 0, 0, 0]), group_std([1, 0])  # the loss spec's group_std; FILTERED: 0
    np.testing.assert_allclose(plain.advantages, [*a0, *a1, 0.0], rtol=0, atol=1e-12)
    for mb in pack_step(b, pcfg, loss_cfg, advantages=plain.advantages).all_micro_batches():
        np.testing.assert_array_equal(mb.advantages.numpy(), plain.advantages[mb.traj_indices.numpy()])

    cfg = StabilizerConfig(extreme=dict(enabled=True, max_failed_tokens=20, action="weight", long_weight=0.0))
    stab = Stabilizers(cfg, loss_cfg)
    prep = stab.prepare(b)
    packed = pack_step(prep.trajectories, pcfg, loss_cfg, advantages=prep.advantages)
    stab.apply(packed, prep)
    assert all(m.ipa is None for m in packed.all_micro_batches())  # IPA off: plain policy loss
    # IPA on: every micro-batch carries its loss roles (no expert prefix here: nothing imitated,
    # every trained chunk reinforced) and the step-global normalizers
    ipa = Stabilizers(StabilizerConfig(ipa=dict(enabled=True)), loss_cfg)
    packed_ipa = pack_step(prep.trajectories, pcfg, loss_cfg, advantages=prep.advantages)
    ipa.apply(packed_ipa, prep)
    for m in packed_ipa.all_micro_batches():
        assert not m.ipa["il_mask"].any() and torch.equal(m.ipa["rl_chunk_ids"], m.chunk_ids)
        assert m.ipa["il_normalizer"] == 1.0 and m.ipa["rl_normalizer"] == m.normalizer
    (mb,) = packed.all_micro_batches()
    logp = torch.full((mb.num_tokens,), -1.0, requires_grad=True)
    out = policy_loss(logp, logp.detach() - 0.1, config=loss_cfg, **{**mb.loss_kwargs(), "advantages": mb.advantages.float()})
    out.loss.backward()
    cu = mb.cu_seqlens.tolist()
    j = mb.traj_indices.tolist().index(1)  # the long failure, weight 0: no gradient
    assert logp.grad[cu[j]:cu[j + 1]].abs().max() == 0
    assert logp.grad[cu[0]:cu[1]].abs().max() > 0


# -------------------------------------------------------------------- curriculum and schedules
def test_curriculum_switches_by_step_and_latches_by_success():
    st = Stabilizers(StabilizerConfig(curriculum=dict(enabled=True, until_step=3)))
    assert [st.loss_config(s).positive_only for s in range(5)] == [True, True, True, False, False]
    st = Stabilizers(StabilizerConfig(curriculum=dict(enabled=True, until_success=0.5)))
    flags = [st.loss_config(s, r).positive_only for s, r in enumerate([0.1, 0.4, 0.6, 0.1, None])]
    assert flags == [True, True, False, False, False] and st.curriculum.switched_at == 2
    base = LossConfig(positive_only=True, clip_high=0.28)
    assert Stabilizers(loss_cfg=base).loss_config(0) is base  # off: the loss config is untouched


def test_kl_controller_direction_and_bounds():
    cfg = AdaptiveKLConfig(enabled=True, target=0.05, horizon=10, init_beta=0.1, min_beta=0.01, max_beta=1.0)
    c = AdaptiveKLController(cfg)
    assert c.update(0.1) == pytest.approx(0.1 * 1.02)  # above target: up, by at most 20% / horizon
    b = c.beta
    assert c.update(0.04) < b  # below target: down
    assert c.update(float("nan")) == c.beta and c.skipped == 1  # ignored, counted
    for _ in range(2000):
        c.update(100.0)
    assert c.beta == 1.0
    for _ in range(2000):
        c.update(0.0)
    assert c.beta == 0.01


def test_entropy_schedule_endpoints_and_step_loss_config():
    e = EntropyScheduleConfig(enabled=True, start=1e-3, end=1e-4, steps=10)
    assert entropy_coef(e, 0) == 1e-3 and entropy_coef(e, 10) == pytest.approx(1e-4)
    assert entropy_coef(e, 50) == pytest.approx(1e-4) and entropy_coef(e, 5) == pytest.approx(5.5e-4)
    with pytest.raises(ValueError, match="step"):
        entropy_coef(e, -1)
    st = Stabilizers(StabilizerConfig(entropy=e.model_dump(), kl=dict(enabled=True, init_beta=0.2)),
                     LossConfig(clip_high=0.28))
    lc = st.loss_config(10)
    assert (lc.kl_beta, lc.entropy_coef, lc.clip_high) == (0.2, pytest.approx(1e-4), 0.28)
    st.after_step(10, {"train/kl_mean": 1.0})  # the loop's record name
    assert st.loss_config(11).kl_beta > 0.2


# -------------------------------------------------------------------------------------- monitors
def call(key):
    return f'<tool_call>{{"name": "lookup", "arguments": {{"key": "{key}"}}}}</tool_call>'


def test_behaviour_metrics_loops_and_destructive_commands():
    code = '<tool_call>{"name": "python", "arguments": {"code": "%s"}}</tool_call>'
    b = [traj(0, turn_texts=["think " + call("k1"), call("k2"), call("k1"), call("k2"), call("k1")],
              tools={"lookup": 5}),
         traj(1, turn_texts=[call("k7"), "<answer>v1</answer>"], tools={"lookup": 1}),
         traj(0, turn_texts=[code % "import shutil; shutil.rmtree('/')", code % "rm -rf /tmp/x",
                             "I will not rm -rf anything", code % "print('remove duplicates')"],
              tools={"python": 3})]
    m = behaviour_metrics(b, MonitorConfig(enabled=True, loop_min_repeats=3))
    assert m["monitor/tool_freq/lookup"] == 2.0 and m["monitor/tool_freq/python"] == 1.0
    assert m["monitor/repeat_call_frac"] == pytest.approx(3 / 9)
    assert m["monitor/looping_frac"] == pytest.approx(1 / 3)
    assert m["monitor/destructive_calls"] == 2 and m["monitor/destructive_traj_frac"] == pytest.approx(1 / 3)
    for bad in ("os.remove('/etc/passwd')", "kill -9 1", "os.kill(1, 9)"):
        assert behaviour_metrics([traj(0, turn_texts=[code % bad])], MonitorConfig())["monitor/destructive_calls"] == 1
    extra = MonitorConfig(destructive_patterns=[r"\bformat_disk\b"])
    assert behaviour_metrics([traj(0, turn_texts=[code % "format_disk()"])], extra)["monitor/destructive_calls"] == 1
    with pytest.raises(ValueError, match=r"destructive_patterns\[0\]"):
        Stabilizers(StabilizerConfig(monitors=dict(destructive_patterns=["(("])))


def test_alarm_fires_on_scripted_jump_not_on_noise():
    rng = np.random.default_rng(0)
    alarm = Alarm([AlarmRule(signal="monitor/tool_freq/lookup", z=4.0, min_delta=0.05)])
    for x in 2.0 + 0.1 * rng.standard_normal(200):
        assert alarm.observe({"monitor/tool_freq/lookup": float(x)}).ok
    d = alarm.observe({"monitor/tool_freq/lookup": 3.5})
    assert d.action == "rollback" and "tool_freq/lookup" in d.reasons[0]
    assert alarm.observe({"monitor/tool_freq/lookup": 2.0}).ok  # the jump did not enter the statistics


def test_alarm_actions_priority_bounds_and_rollback_budget():
    rules = [AlarmRule(signal="a", min_history=2, direction="down", action="rollback"),
             AlarmRule(signal="monitor/destructive_calls", above=0, action="stop")]
    alarm = Alarm(rules, max_rollbacks=1)
    for _ in range(3):
        assert alarm.observe({"a": 1.0, "monitor/destructive_calls": 0}).ok
    assert alarm.observe({"a": 5.0}).ok  # up, but the rule watches down
    assert alarm.observe({"a": float("nan")}).action == "rollback"
    d = alarm.observe({"a": -30.0, "monitor/destructive_calls": 1})
    assert d.action == "stop" and len(d.reasons) == 2  # both fire; stop wins
    assert d.reason == "; ".join(d.reasons)  # the loop's log line (it once raised AttributeError there)
    d = alarm.observe({"a": -30.0})
    assert d.action == "stop" and "max_rollbacks" in d.reasons[-1]  # second rollback > budget of 1


def test_facade_state_dict_roundtrip_keeps_rollback_count():
    cfg = StabilizerConfig(curriculum=dict(enabled=True, until_step=2), kl=dict(enabled=True),
                           monitors=dict(enabled=True, alarms=[dict(signal="x", min_history=2)]))
    st = Stabilizers(cfg)
    st.loss_config(0)
    for v in (1.0, 1.0, 1.0):
        st.after_step(0, {"x": v, "train/kl_mean": 0.5})
    saved = st.state_dict()
    assert st.after_step(1, {"x": 9.0}).action == "rollback"
    st.load_state_dict(saved)
    assert st.alarm.rollbacks == 1 and st.kl.beta == saved["kl"]["beta"]
    assert st.stab_metrics()["stab/rollbacks"] == 1


# ------------------------------------------------------------------------------------ stall guard
def no_signal(success=0.0, valid=0.0, **kw):
    """A step record as the loop logs it, of a step whose groups all had equal rewards."""
    return {"train/skipped_no_signal": 1.0, "success/train": success, "tools/valid_rate": valid,
            "adv/zero_var_group_frac": 1.0, **kw}


SIGNAL = {"train/skipped_no_signal": 0.0, "success/train": 0.3, "adv/zero_var_group_frac": 0.5}


def test_stall_streak_counts_and_resets_on_a_signal_step():
    st = Stabilizers(StabilizerConfig(stall=dict(patience=3)))
    assert st.after_step(1, no_signal()).ok and st.after_step(2, no_signal()).ok
    assert st.stab_metrics()["stab/no_signal_streak"] == 2
    assert st.after_step(3, SIGNAL).ok and st.stab_metrics()["stab/no_signal_streak"] == 0
    assert st.after_step(4, {}).ok and st.stall.streak == 0  # a record without the key is no evidence
    for s in (5, 6):
        assert st.after_step(s, no_signal()).ok
    assert st.after_step(7, no_signal()).action == "stop"  # 3 in a row again


def test_stall_collapse_stops_with_one_line_reason():
    st = Stabilizers()  # defaults: patience 20, stop; monitors off
    for s in range(1, 20):
        assert st.after_step(s, no_signal()).ok
    d = st.after_step(20, no_signal())
    assert d.action == "stop" and not d.notes
    assert d.reason == ("no learning signal for 20 steps (every group's rewards equal; success/train 0.00, "
                        "tools/valid_rate 0.00): the policy collapsed")
    st = Stabilizers(StabilizerConfig(stall=dict(patience=2)))  # some groups solved, no valid-rate key
    st.after_step(1, {"train/skipped_no_signal": 1.0, "success/train": 0.25})
    d = st.after_step(2, {"train/skipped_no_signal": 1.0, "success/train": 0.25})
    assert d.reason == "no learning signal for 2 steps (no trajectory had an advantage; success/train 0.25): " \
                       "the policy is stuck"
    st = Stabilizers(StabilizerConfig(stall=dict(patience=1)))  # success from the loop's argument
    assert st.after_step(1, {"train/skipped_no_signal": 1.0}, success_rate=0.0).action == "stop"


def test_stall_solved_continues_with_one_note():
    st = Stabilizers(StabilizerConfig(stall=dict(patience=2)))
    ds = [st.after_step(s, no_signal(success=1.0, valid=1.0)) for s in range(1, 9)]
    assert all(d.ok for d in ds) and [n for d in ds for n in d.notes] == ["every group solved for 2 steps: nothing left to learn from this task set"]
    assert st.stab_metrics()["stab/no_signal_streak"] == 8
    st = Stabilizers(StabilizerConfig(stall=dict(patience=1)))
    d = st.after_step(1, no_signal(success=0.75))
    assert d.ok and "success/train 0.75" in d.notes[0] and "nothing left to learn" in d.notes[0]


def test_stall_patience_null_or_zero_disables():
    for p in (None, 0):
        st = Stabilizers(StabilizerConfig(stall=dict(patience=p)))
        ds = [st.after_step(s, no_signal()) for s in range(100)]
        assert all(d.ok and not d.notes for d in ds)
        assert st.stab_metrics()["stab/no_signal_streak"] == 100  # still counted and logged


def test_stall_warn_and_rollback_actions():
    st = Stabilizers(StabilizerConfig(stall=dict(patience=2, action="warn")))
    ds = [st.after_step(s, no_signal()) for s in range(1, 5)]
    assert all(d.ok for d in ds) and [len(d.notes) for d in ds] == [0, 1, 0, 1]  # every `patience` steps
    assert "the policy collapsed" in ds[1].notes[0] and "for 4 steps" in ds[3].notes[0]
    # rollback: as an alarm's, within monitors.max_rollbacks (monitors off), merged with the alarm's
    st = Stabilizers(StabilizerConfig(stall=dict(patience=2, action="rollback"), monitors=dict(max_rollbacks=1)))
    st.after_step(1, no_signal())
    d = st.after_step(2, no_signal())
    assert d.action == "rollback" and "the policy collapsed" in d.reason and st.stab_metrics()["stab/rollbacks"] == 1
    st.after_step(3, no_signal())
    d = st.after_step(4, no_signal())
    assert d.action == "stop" and "max_rollbacks 1" in d.reasons[-1] and "no learning signal" in d.reasons[0]
    cfg = StabilizerConfig(stall=dict(patience=1, action="rollback"),
                           monitors=dict(enabled=True, alarms=[dict(signal="x", above=0, action="stop")]))
    d = Stabilizers(cfg).after_step(1, no_signal(x=1.0))
    assert d.action == "stop" and len(d.reasons) == 2  # both fire; stop wins
    st = Stabilizers(StabilizerConfig(stall=dict(patience=1, action="rollback"),
                                      monitors=dict(enabled=True, alarms=[dict(signal="x", above=0)])))
    assert st.after_step(1, no_signal(x=1.0)).action == "rollback" and st.alarm.rollbacks == 1  # one spent, not two


def test_stall_collapse_after_success_despite_a_trickle_of_signal():
    """Success 0 for ``patience`` steps once the run reached ``after_success`` is a collapse, even when
    some steps keep an advantage (turn credit's anchors) and so reset the no-signal streak."""
    trickle = {"train/skipped_no_signal": 0.0, "success/train": 0.0, "tools/valid_rate": 0.93}
    st = Stabilizers(StabilizerConfig(stall=dict(patience=3)))
    for s, v in enumerate([0.0, 0.0, 0.4, 0.0, 0.0, 0.0, 0.0]):  # below 0.5: zeros are no collapse yet
        assert st.after_step(s, {**trickle, "success/train": v}).ok
    assert st.stab_metrics()["stab/zero_success_streak"] == 0
    assert st.after_step(7, {**trickle, "success/train": 0.9}).ok
    assert st.after_step(8, trickle).ok and st.after_step(9, {**trickle, "success/train": 0.05}).ok  # reset
    assert st.after_step(10, trickle).ok and st.after_step(11, trickle).ok
    assert st.stab_metrics()["stab/zero_success_streak"] == 2
    d = st.after_step(12, trickle)
    assert d.action == "stop" and d.reason == ("success/train 0 for 3 steps after the run reached 0.90 "
                                               "(tools/valid_rate 0.93 on the last): the policy collapsed")
    assert st.after_step(13, {"train/skipped_no_signal": 0.0}).ok  # no success figure: the streak holds
    assert st.stab_metrics()["stab/zero_success_streak"] == 3
    # from the loop's argument; warn; off with after_success null or patience 0
    st = Stabilizers(StabilizerConfig(stall=dict(patience=1, action="warn")))
    st.after_step(0, {}, success_rate=0.6)
    d = st.after_step(1, {}, success_rate=0.0)
    assert d.ok and d.notes == ["success/train 0 for 1 steps after the run reached 0.60: the policy collapsed "
                                "(stabilizers.stall.action=warn: going on)"]
    for stall in (dict(patience=1, after_success=None), dict(patience=0)):
        st = Stabilizers(StabilizerConfig(stall=stall))
        assert all(st.after_step(s, {**trickle, "success/train": v}).ok for s, v in enumerate([1.0] + [0.0] * 30))
    with pytest.raises(ValueError, match="stall.after_success"):
        StabilizerConfig(stall=dict(after_success=0))


def test_stall_zero_success_without_ok_episodes_is_no_evidence():
    """A step where no episode finished OK (environment faults, all masked) reports success/train 0;
    it neither counts toward the collapse streak nor resets it."""
    st = Stabilizers(StabilizerConfig(stall=dict(patience=2)))
    lost = {"train/skipped_no_signal": 0.0, "success/train": 0.0, "status/ok": 12.0}
    outage = {"train/skipped_no_signal": 0.0, "success/train": 0.0, "status/ok": 0.0}
    assert st.after_step(0, {**lost, "success/train": 0.9}).ok
    assert all(st.after_step(s, outage).ok for s in range(1, 30))
    assert st.stab_metrics()["stab/zero_success_streak"] == 0
    assert st.after_step(30, lost).ok and st.after_step(31, outage).ok
    assert st.after_step(32, lost).action == "stop"


def test_checkpoint_due_skips_a_rolled_back_step():
    from arl.trainer.rank import checkpoint_due

    assert [v for v in range(1, 11) if checkpoint_due(v, 4, 10, False, "continue")] == [4, 8, 10]
    assert checkpoint_due(3, 4, 10, True, "continue") and checkpoint_due(3, 4, 10, True, "stop")
    assert not any(checkpoint_due(v, 4, 10, oot, "rollback") for v in (4, 8, 10) for oot in (False, True))


def test_stall_both_rules_fire_at_once():
    st = Stabilizers(StabilizerConfig(stall=dict(patience=2)))
    st.after_step(0, {**SIGNAL, "success/train": 1.0})
    st.after_step(1, no_signal())
    d = st.after_step(2, no_signal())
    assert d.action == "stop" and len(d.reasons) == 2 and "no learning signal" in d.reasons[0]


def test_stall_state_dict_roundtrip_and_old_checkpoints():
    st = Stabilizers(StabilizerConfig(stall=dict(patience=4)))
    for s in range(3):
        st.after_step(s, no_signal(valid=0.5))
    saved = st.state_dict()
    assert saved["stall"]["streak"] == 3 and saved["stall"]["lost"] == 0
    back = Stabilizers(StabilizerConfig(stall=dict(patience=4)))
    back.load_state_dict(saved)
    d = back.after_step(3, no_signal(valid=0.25))
    assert d.action == "stop" and "tools/valid_rate 0.44" in d.reason  # (3 * 0.5 + 0.25) / 4
    st = Stabilizers(StabilizerConfig(stall=dict(patience=3)))
    st.after_step(0, {"success/train": 0.8})
    st.after_step(1, {"success/train": 0.0})
    back = Stabilizers(StabilizerConfig(stall=dict(patience=3)))
    back.load_state_dict(st.state_dict())
    assert (back.stall.best, back.stall.lost) == (0.8, 1)
    back.after_step(2, {"success/train": 0.0})
    assert back.after_step(3, {"success/train": 0.0}).action == "stop"
    older = {**saved, "stall": {k: v for k, v in saved["stall"].items() if k not in ("best", "lost")}}
    back.load_state_dict(older)  # a checkpoint from before the second rule
    assert (back.stall.best, back.stall.lost) == (0.0, 0)
    old = {k: v for k, v in saved.items() if k != "stall"}  # a checkpoint from before the guard
    fresh = Stabilizers()
    fresh.load_state_dict(old)
    assert fresh.stall.streak == 0


# ------------------------------------------------------------------------------------------- IPA
class CharFormat:  # minimal ChatFormat protocol: one token per character
    def encode(self, text):
        return [ord(c) for c in text]

    def prompt_ids(self, system, task):
        return self.encode(f"S:{system}|U:{task}|A:")

    def observation_ids(self, observation, turn_ended_with_eos=False):
        return self.encode(f"|T:{observation}|A:")


@pytest.fixture(scope="module")
def expert():
    from arl.env.expert import expert_transcript
    from arl.env.toy import ToyLookupEnv

    env = ToyLookupEnv(min_hops=3, max_hops=3)
    task, tr = asyncio.run(expert_transcript(env, 5))
    return expert_trajectory(CharFormat(), "sys", task, tr, task_seed=5)


def test_expert_trajectory_layout(expert):
    K = len(expert.turns)
    assert K == 4 and expert.reward == 1.0 and expert.num_chunks == 4
    for k, (a, b) in enumerate(expert.turns):
        assert (expert.chunk_ids[a:b] == k).all()
        assert "".join(map(chr, expert.tokens[a:b])) == expert.metadata["expert_turns"][k]
    assert (expert.rollout_logp == 0).all()


def test_start_states_sequential_and_parallel(expert):
    r = IPAResampler(IPAResampleConfig(enabled=True, steps_per_chunk=2))
    ks = []
    for _ in range(10):
        ks.append(r.start_states([expert])[0].chunk)
        r.advance()
    assert ks == [3, 3, 2, 2, 1, 1, 0, 0, 0, 0]  # sequential rollback from the last chunk, floor at 0
    r = IPAResampler(IPAResampleConfig(enabled=True, steps_per_chunk=100, advance_at_success=0.8))
    r.advance(0.5)
    r.advance(0.9)
    assert r.start_chunks(4) == [2]
    p = IPAResampler(IPAResampleConfig(enabled=True, mode="parallel", anchors=(0.0, 0.25, 0.5, 0.9)))
    assert [s.chunk for s in p.start_states([expert])] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="k: start chunk 4"):
        start_state(expert, 4)


def test_start_state_replays_env_to_chunk_k(expert):
    from arl.env.toy import ToyLookupEnv

    s = start_state(expert, 2)
    assert s.prefix_len == expert.turns[2][0] and len(s.replay_turns) == 2

    async def play():
        env = ToyLookupEnv(min_hops=3, max_hops=3)
        await env.reset(s.task_seed)
        for t in s.replay_turns:  # the rollout hook: replay the prefix, then sample from turn k
            assert not (await env.step(t)).done
        res = None
        for t in expert.metadata["expert_turns"][2:]:
            res = await env.step(t)
        return res.reward

    assert asyncio.run(play()) == 1.0


def resampled(expert, k, cont_lens, reward, group, imitate):
    s = start_state(expert, k)
    P = s.prefix_len
    tokens = list(s.prefix_tokens) + [7] * sum(cont_lens)
    chunks = list(s.prefix_chunk_ids) + [k + i for i, n in enumerate(cont_lens) for _ in range(n)]
    t = Trajectory(tokens=tokens, chunk_ids=chunks, rollout_logp=np.zeros(len(tokens), np.float32), reward=reward,
                   group_id=group, turns=list(expert.turns[:k]) + [(P, P + sum(cont_lens))])
    return tag_resampled(s, t, imitate)


def test_chunk_roles_normalizers_and_mixed_loss_exact(expert):
    b = [resampled(expert, 2, (4, 3), 1.0, 0, True), resampled(expert, 2, (5,), 0.0, 0, False)]
    with pytest.raises(ValueError, match="expert prefix"):
        tag_resampled(start_state(expert, 3), b[1])
    loss_cfg = LossConfig(ratio_level="chunk", loss_agg="token-mean")
    il_norm, rl_norm = ipa_normalizers(b, loss_cfg)
    n_prefix = sum(b_ - a for a, b_ in expert.turns[:2])
    assert (il_norm, rl_norm) == (n_prefix, 12.0)  # prefix imitated once per group; RL on 7 + 5 tokens
    adv = group_advantages([t.reward for t in b], [t.group_id for t in b], "grpo", 1e-6)[0]  # the step's
    (mb,) = pack_step(b, PackerConfig(token_budget=1024), advantages=adv).all_micro_batches()
    il, rl_ids = split_chunk_roles(mb, b)
    cu = mb.cu_seqlens.tolist()
    assert int(il.sum()) == n_prefix and not il[cu[1]:].any()
    assert int((rl_ids >= 0).sum()) == 12 and sorted(set(rl_ids[rl_ids >= 0].tolist())) == [0, 1, 2]

    logp = torch.linspace(-3, -0.1, mb.num_tokens, dtype=torch.float64).requires_grad_()
    old = logp.detach() + 0.05
    loss, m = ipa_mixed_loss(logp, old, mb=mb, il_mask=il, rl_chunk_ids=rl_ids, loss_cfg=loss_cfg,
                             il_normalizer=il_norm, rl_normalizer=rl_norm, lambda_il=0.5, lambda_rl=2.0)
    loss.backward()
    kw = mb.loss_kwargs()
    kw.update(chunk_ids=rl_ids, normalizer=rl_norm)
    rl = policy_loss(logp.detach(), old, config=loss_cfg, **kw).loss
    nll = -(logp.detach() * il).sum() / il_norm
    assert float(loss.detach()) == pytest.approx(0.5 * float(nll) + 2.0 * float(rl), rel=1e-12)
    # (not torch.testing.assert_close: it imports torch.distributed.tensor, ~5 s here)
    np.testing.assert_allclose(logp.grad[il].numpy(), np.full(n_prefix, -0.5 / il_norm), rtol=1e-12)
    assert logp.grad[(rl_ids < 0) & ~il].abs().max() == 0  # prompt, observations, the non-imitating prefix
    assert m["ipa/il_tokens"] == n_prefix and m["ipa/rl_tokens"] == 12


# ---------------------------------------------------------------------------------- turn credit
def _tc_traj(turn_tokens, reward, new_states, group=0, status=S.OK):
    """prompt [1, 2] | turn 0 | obs [9] | turn 1 | ...; turns given as token lists (equal lists, equal context)."""
    tokens, chunks = [1, 2], [-1, -1]
    for k, tt in enumerate(turn_tokens):
        if k:
            tokens.append(9)
            chunks.append(-1)
        tokens += list(tt)
        chunks += [k] * len(tt)
    info = [{"tool": "lookup", "tool_error": False, "new_state": bool(x)} for x in new_states]
    return Trajectory(tokens=tokens, chunk_ids=chunks, rollout_logp=np.full(len(tokens), -1.0, np.float32),
                      reward=reward, group_id=group, status=status, metadata={"turn_info": info})


def _tc_batch():
    return [_tc_traj([[5, 6], [7, 8]], 1.0, [True, False]),  # right key, right answer
            _tc_traj([[5, 6], [7, 3]], 0.0, [True, False]),  # right key, wrong answer: shares a's turn-1 context
            _tc_traj([[4, 6], [7, 3]], 0.0, [False, False]),  # wrong key: its own turn-1 context
            _tc_traj([[5, 6]], 0.0, [True], group=1),  # a lone group: no comparison anywhere
            _tc_traj([[5, 6]], 1.0, [True], group=2, status=S.MASKED)]  # a placeholder trains nothing


def test_turn_credit_exact_chunk_advantages():
    gamma, w, pr = 0.9, 0.5, 0.1
    lc = LossConfig(ratio_level="chunk", gamma=gamma)
    stab = Stabilizers(StabilizerConfig(turn_credit=dict(enabled=True, weight=w, process_reward=pr)), lc)
    b = _tc_batch()
    prep = stab.prepare(b)
    A = group_std([1.0, 0.0, 0.0])  # the trajectories' advantages (group 0)
    np.testing.assert_allclose(prep.advantages[:3], A)
    # chunk returns: G_1 = outcome, G_0 = new-state reward + gamma * G_1
    step0 = group_std([pr + gamma * 1.0, pr, 0.0])  # turn 0: one anchor (the prompt) for the whole group
    step1 = group_std([1.0, 0.0])  # turn 1: a and b acted in the same context; c alone (0)
    want = [[gamma * A[0] + w * step0[0], A[0] + w * step1[0]],
            [gamma * A[1] + w * step0[1], A[1] + w * step1[1]],
            [gamma * A[2] + w * step0[2], A[2]],
            [0.0]]
    for got, exp in zip(prep.chunk_advantages, want):
        np.testing.assert_allclose(got, exp, rtol=1e-12, atol=1e-12)
    assert prep.chunk_advantages[4].size == 0
    assert prep.metrics["stab/turn_anchor_size_mean"] == pytest.approx(7 / 4)  # anchors {abc}, {ab}, {c}, {d}
    assert prep.metrics["stab/turn_step_adv_nonzero_frac"] == pytest.approx(5 / 7)


@pytest.mark.parametrize("level,mismatch", [("chunk", "chunk"), ("token", "token"), ("chunk", "none")])
def test_turn_credit_segments_equal_the_plain_loss_at_zero_weight(level, mismatch):
    """Weight 0: per-chunk advantages are gamma^Delta * A_i, so cutting sequences into one segment per
    chunk must give the plain loss and gradient exactly (what lets every kernel run turn credit)."""
    lc = LossConfig(ratio_level=level, gamma=0.9, mismatch_level=mismatch, mismatch_high=1.2, clip_high=0.28)
    stab = Stabilizers(StabilizerConfig(turn_credit=dict(enabled=True, weight=0.0)), lc)
    prep = stab.prepare(_tc_batch())
    packed = pack_step(prep.trajectories, PackerConfig(token_budget=256), lc, advantages=prep.advantages)
    stab.apply(packed, prep, lc)
    (mb,) = packed.all_micro_batches()
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(mb.num_tokens, generator=g, dtype=torch.float64) - 0.5
    new0 = old + 0.3 * torch.randn(mb.num_tokens, generator=g, dtype=torch.float64)
    mb.rollout_logp = (old + 0.1 * torch.randn(mb.num_tokens, generator=g, dtype=torch.float64)).float()
    for backend in available_backends():  # reference, C++; Triton under the interpreter; CUDA on a GPU
        grads = []
        for seg in (False, True):
            logp = new0.clone().requires_grad_(True)
            kw = mb.loss_kwargs()
            adv = kw.pop("advantages")
            if seg:
                kw.update(mb.segments)
                adv = kw.pop("advantages")
                assert kw["cu_seqlens"].numel() - 1 == 2 + 2 + 2 + 1 + 1  # a, b, c two chunks; d one; masked one
            out = policy_loss(logp, old, config=lc, advantages=adv.double(), backend=backend, **kw)
            out.loss.backward()
            grads.append((out.loss.detach(), logp.grad.clone()))
        # (gamma**Delta is evaluated in fp32 by some backends: agreement to ~1e-8, not to the last bit)
        torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-6, atol=1e-9)


def test_turn_credit_reaches_the_loss_per_chunk():
    """Each chunk's gradient follows its own advantage: at chunk ratio 1, d loss / d logp_t = -A_c / D."""
    lc = LossConfig(ratio_level="chunk", gamma=1.0)
    stab = Stabilizers(StabilizerConfig(turn_credit=dict(enabled=True, weight=1.0)), lc)
    prep = stab.prepare(_tc_batch())
    ca = prep.chunk_advantages
    assert ca[1][1] < ca[1][0] < 0  # b's wrong answer, compared with a's right one in the same context
    assert ca[2][0] < ca[1][0]  # c's wrong key is worse than b's right key
    assert ca[0][0] > 0 and ca[0][1] > 0  # a did everything right
    packed = pack_step(prep.trajectories, PackerConfig(token_budget=256), lc, advantages=prep.advantages)
    stab.apply(packed, prep, lc)
    (mb,) = packed.all_micro_batches()
    logp = torch.full((mb.num_tokens,), -1.0, dtype=torch.float64, requires_grad=True)
    kw = mb.loss_kwargs()
    kw.update(mb.segments)
    adv = kw.pop("advantages")
    policy_loss(logp, logp.detach(), config=lc, advantages=adv, **kw).loss.backward()
    # positive-only (the curriculum) acts per chunk: a failed trajectory's right key is still reinforced
    lp_pos = logp.detach().clone().requires_grad_(True)
    policy_loss(lp_pos, logp.detach(), config=lc.model_copy(update={"positive_only": True}), advantages=adv,
                **kw).loss.backward()
    D = mb.normalizer
    for j, i in enumerate(mb.traj_indices.tolist()):
        a = int(mb.cu_seqlens[j])
        t = prep.trajectories[i]
        for k in range(ca[i].size):
            idx = a + np.flatnonzero(t.chunk_ids == k)
            np.testing.assert_allclose(logp.grad[idx].numpy(), -ca[i][k] / D, rtol=1e-6)
            np.testing.assert_allclose(lp_pos.grad[idx].numpy(), -max(ca[i][k], 0.0) / D, rtol=1e-6, atol=1e-15)
    # two failures of one task: no trajectory-level signal, but the right key beats the wrong one
    both_fail = stab.prepare([_tc_traj([[5, 6], [7, 3]], 0.0, [True, False], group=3),
                              _tc_traj([[4, 6], [7, 3]], 0.0, [False, False], group=3)])
    np.testing.assert_array_equal(both_fail.advantages, [0.0, 0.0])
    assert both_fail.chunk_advantages[0][0] > 0 > both_fail.chunk_advantages[1][0]


def test_turn_credit_config_errors():
    from arl.config import load_config

    with pytest.raises(ValueError, match="turn_credit.enabled: True cannot be combined with ipa.enabled"):
        StabilizerConfig(turn_credit=dict(enabled=True), ipa=dict(enabled=True))
    with pytest.raises(ValueError, match="stabilizers.turn_credit.enabled needs loss.ratio_level"):
        load_config(None, ["stabilizers.turn_credit.enabled=true", "loss.ratio_level=sequence"])
    with pytest.raises(ValueError, match="needs loss.ratio_level token or chunk"):  # the facade checks it too
        Stabilizers(StabilizerConfig(turn_credit=dict(enabled=True)), LossConfig(loss_agg="seq-mean-token-mean"))
    with pytest.raises(ValueError, match="turn_credit.weight"):
        StabilizerConfig(turn_credit=dict(enabled=True, weight=-1))
