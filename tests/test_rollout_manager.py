"""Episodes and the async rollout manager on the real vLLM engine: exact masks and chunk ids,
mask & filter under injected faults, the staleness bound, reset determinism."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from arl.data.trajectory import TrajectoryStatus
from arl.env.base import Environment, Fault, StepResult
from arl.env.registry import make_env
from arl.config import RolloutConfig
from arl.rollout import (ChatFormat, EpisodeConfig, RolloutManager, SamplingConfig,
                         run_episode)

SAMPLING = SamplingConfig(max_tokens=4, stop=())  # a random tiny model: fixed-length turns


class ScriptedEnv(Environment):
    """Ignores the model; answers a fixed script.  Turn 2 is a tool error.  Records actions."""

    system_prompt = "You look keys up."
    max_turns = 8

    def __init__(self, script=("k03", "error: malformed tool call", "v42")):
        self.script = list(script)
        self.actions = []

    async def reset(self, seed):
        self.i = 0
        return f"Find the value for k{seed:02d}."

    async def step(self, action_text):
        self.actions.append(action_text)
        self.i += 1
        if self.i > len(self.script):
            return StepResult("", 1.0, True, {"tool": None})
        obs = self.script[self.i - 1]
        return StepResult(obs, 0.0, False, {"tool": "lookup", "tool_error": obs.startswith("error")})


class FaultyEnv(Environment):
    """Fault injection (test double): per task seed, 'ok', 'died' (unrecoverable at step 1),
    'nostart' (reset raises), 'flaky' (recoverable at step 1 on every attempt),
    'flaky_once' (recoverable only for the first attempt, sample < group size)."""

    system_prompt = "sys"
    max_turns = 4
    plan: dict = {}
    group_size = 2

    async def reset(self, seed, *, sample=0):
        self.kind, self.sample, self.i = self.plan.get(seed, "ok"), sample, 0
        if self.kind == "nostart":
            raise RuntimeError("sandbox failed to start")
        return f"task {seed}"

    async def step(self, action_text):
        self.i += 1
        await asyncio.sleep(0.01 * (self.i % 3))
        if self.i == 1 and self.kind == "died":
            return StepResult("error: tool server died", 0.0, True, {"fault": Fault.UNRECOVERABLE})
        if self.i == 1 and (self.kind == "flaky" or (self.kind == "flaky_once" and self.sample < self.group_size)):
            return StepResult("error: tool timed out", 0.0, False, {"fault": Fault.RECOVERABLE})
        if self.i == 2:
            return StepResult("", 1.0, True, {})
        return StepResult("obs", 0.0, False, {"tool": "t"})


@pytest.mark.slow  # the session vLLM engine
def test_scripted_episode_masks_and_chunk_ids_exact(vllm_engine, tiny_tokenizer, arun):
    fmt, env = ChatFormat(tiny_tokenizer), ScriptedEnv()
    cfg = EpisodeConfig(sampling=SAMPLING)
    t = arun(run_episode(vllm_engine, env, fmt, 5, cfg, group_id=9, sample_seed=11))
    assert t.reward == 1.0 and len(t.turns) == 4 and t.group_id == 9 and t.status is TrajectoryStatus.OK
    enc = lambda s: tiny_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    prompt = enc("<|im_start|>system\nYou look keys up.<|im_end|>\n<|im_start|>user\nFind the value for k05."
                 "<|im_end|>\n<|im_start|>assistant\n")
    exp_tokens, exp_chunks = list(prompt), [-1] * len(prompt)
    for k, (s, e) in enumerate(t.turns):
        assert s == len(exp_tokens)
        sampled = t.tokens[s:e].tolist()
        # token in / token out: replaying the exact prefix with the turn's seed gives the same ids
        replay = arun(vllm_engine.generate_one(exp_tokens, SamplingConfig(max_tokens=4, stop=(), seed=(11 * 7919 + k) % (1 << 31))))
        assert replay.token_ids == sampled
        np.testing.assert_allclose(t.rollout_logp[s:e], replay.logprobs, atol=1e-5)
        assert env.actions[k] == tiny_tokenizer.decode(sampled, skip_special_tokens=True)
        exp_tokens += sampled
        exp_chunks += [k] * len(sampled)
        if k < 3:
            obs = enc("<|im_end|>\n<|im_start|>tool\n" + env.script[k] + "<|im_end|>\n<|im_start|>assistant\n")
            exp_tokens += obs
            exp_chunks += [-1] * len(obs)
    assert t.tokens.tolist() == exp_tokens
    assert t.chunk_ids.tolist() == exp_chunks  # prompt, observations and the tool error all -1
    assert np.all(t.rollout_logp[t.chunk_ids < 0] == 0) and np.all(t.rollout_logp[t.chunk_ids >= 0] < 0)
    assert t.metadata["tool_errors"] == 1 and t.num_chunks == 4
    # one record per tool-call attempt (the final answer is none); this env reports no arguments
    assert t.metadata["calls"] == [{"tool": "lookup", "args": None, "error": False},
                                   {"tool": "lookup", "args": None, "error": True},
                                   {"tool": "lookup", "args": None, "error": False}]
    # one turn_info per model turn (shaping and monitors read it): tool, error, observation digest
    info = t.metadata["turn_info"]
    assert [(d["tool"], d["tool_error"]) for d in info] == [("lookup", False), ("lookup", True), ("lookup", False),
                                                            (None, False)]
    assert len({d["obs_digest"] for d in info[:3]}) == len(set(env.script[:3]))


def test_observation_after_eos_turn_has_no_double_turn_end(tiny_tokenizer):
    fmt = ChatFormat(tiny_tokenizer)
    enc = lambda s: tiny_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert fmt.observation_ids("x") == enc("<|im_end|>\n<|im_start|>tool\nx<|im_end|>\n<|im_start|>assistant\n")
    assert fmt.observation_ids("x", turn_ended_with_eos=True) == enc("\n<|im_start|>tool\nx<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow  # the session vLLM engine
def test_limits_max_turns_and_total_tokens(vllm_engine, tiny_tokenizer, arun):
    fmt = ChatFormat(tiny_tokenizer)
    t = arun(run_episode(vllm_engine, ScriptedEnv(["o"] * 10), fmt, 1, EpisodeConfig(max_turns=2, sampling=SAMPLING)))
    assert len(t.turns) == 2 and t.reward == 0.0 and t.metadata["truncated"] == "max_turns"
    t = arun(run_episode(vllm_engine, ScriptedEnv(["o"] * 10), fmt, 1, EpisodeConfig(max_total_tokens=60, sampling=SAMPLING)))
    assert len(t) <= 60 and t.reward == 0.0 and t.metadata["truncated"] == "max_total_tokens"


def _manager(engine, tok, env_factory, tasks, groups_per_step, seed=None, first_step=None, in_order=False,
             **rollout):
    """A manager on the ``rollout`` config section ``rollout`` (YAML key names)."""
    return RolloutManager(engine, env_factory, tok, tasks=tasks, config=RolloutConfig(**rollout),
                          groups_per_step=groups_per_step, episode=EpisodeConfig(max_turns=3, sampling=SAMPLING),
                          seed=seed, first_step=first_step, in_order=in_order)


class EvenSlowEnv(Environment):
    """Tasks with an even seed take longer per tool call: later groups finish first."""

    system_prompt = "sys"
    max_turns = 3

    async def reset(self, seed):
        self.seed, self.i = seed, 0
        return f"task {seed}"

    async def step(self, action_text):
        self.i += 1
        await asyncio.sleep(0.15 if self.seed % 2 == 0 else 0.0)
        return StepResult("obs", float(self.i == 3), self.i == 3, {"tool": "t"})


@pytest.mark.slow  # the session vLLM engine
@pytest.mark.parametrize("held", [0, 1])
def test_in_order_batches_sample_each_group_from_one_version(vllm_engine, tiny_tokenizer, arun, held):
    """trainer.deterministic's rollouts: batch k holds the groups started k-th, whatever finishes
    first, and new weights wait until the started groups are done, so every turn of a group samples
    from the version it started at: max(0, k - staleness) batches after the first.  A resumed
    manager whose checkpoint ``held`` the batch in flight starts after it (``first_step``), one batch
    ahead of its weights' version: the staleness it had."""
    G, n, k = 2, 2, 1

    async def go():
        v0 = vllm_engine.version
        m = _manager(vllm_engine, tiny_tokenizer, EvenSlowEnv, range(100), group_size=n, groups_per_step=G,
                     staleness=k, seed=5, first_step=v0 + held if held else None, in_order=True)
        out = []
        async with m:
            for _ in range(3):
                b = await m.get_batch()
                out.append((b, [t.metadata["turn_versions"] for t in b.trajectories]))
                await m.update_weights(vllm_engine.model_path)
        return v0, out

    v0, out = arun(go())
    lag = k - held  # the batches made here that started at v0 beyond the first
    for i, (b, versions) in enumerate(out):
        assert b.step == v0 + held + i
        assert [int(t.group_id) for t in b.trajectories] == sorted(int(t.group_id) for t in b.trajectories)
        assert {t.metadata["task_seed"] for t in b.trajectories} == set(range(i * G, (i + 1) * G))
        start = v0 + max(0, i - lag)
        assert all(vs and set(vs) == {start} for vs in versions), (i, versions)


@pytest.mark.slow  # the session vLLM engine
def test_faults_keep_batch_size_and_filter_cap(vllm_engine, tiny_tokenizer, arun):
    FaultyEnv.plan = {0: "ok", 1: "died", 2: "nostart", 3: "flaky", 4: "flaky_once", 5: "flaky", 6: "flaky", 7: "flaky"}

    async def go():
        m = _manager(vllm_engine, tiny_tokenizer, FaultyEnv, range(8), group_size=2, groups_per_step=4,
                     staleness=0, retries=1, filter_cap=0.5)
        async with m:
            b1 = await m.get_batch()
            await m.update_weights(vllm_engine.model_path)
            b2 = await m.get_batch()
        return b1, b2

    b1, b2 = arun(go())
    for b in (b1, b2):
        assert len(b.trajectories) == 8  # batch size kept
    by_task = {}
    for t in b1.trajectories + b2.trajectories:
        by_task.setdefault(t.metadata["task_seed"], []).append(t)
    assert all(t.status is TrajectoryStatus.OK and t.reward == 1.0 for t in by_task[0])
    for seed in (1, 2):  # unrecoverable: masked placeholders
        for t in by_task[seed]:
            assert t.status is TrajectoryStatus.MASKED and t.reward == 0.0 and np.all(t.chunk_ids == -1) and len(t) > 0
    assert all(t.status is TrajectoryStatus.FILTERED for t in by_task[3])  # 2 of 8 filtered: under the cap
    assert b1.metrics["rollout/num_masked"] == 4 and b1.metrics["rollout/num_filtered"] == 2
    assert b1.metrics["rollout/retries"] == 2 and len(b1.trainable()) == 6
    # retried once, then fine
    assert all(t.status is TrajectoryStatus.OK and t.metadata["attempts"] == 2 and t.reward == 1.0 for t in by_task[4])
    # batch 2: 6 would be filtered, only 4 (50%) may be: 2 are kept, with reward 0
    st = [t.status for t in b2.trajectories]
    assert st.count(TrajectoryStatus.FILTERED) == 4 and st.count(TrajectoryStatus.OK) == 4
    kept = [t for t in b2.trajectories if t.metadata.get("over_filter_cap")]
    assert len(kept) == 2 and all(t.status is TrajectoryStatus.OK and t.reward == 0.0 for t in kept)
    assert b2.metrics["rollout/num_over_filter_cap"] == 2 and b2.metrics["rollout/filtered_frac"] == 0.5


@pytest.mark.slow  # the session vLLM engine
@pytest.mark.parametrize("staleness", [0, 2])
def test_staleness_bound(vllm_engine, tiny_tokenizer, arun, staleness):
    G, n, steps = 2, 2, 4

    async def go():
        m = _manager(vllm_engine, tiny_tokenizer, lambda: make_env("toy_lookup"), range(100), group_size=n,
                     groups_per_step=G, staleness=staleness)
        seen = []
        async with m:
            for step in range(steps):
                b = await m.get_batch()
                await asyncio.sleep(0.3)  # the trainer is slow: generation must pause at the gate
                assert m._started <= (m.version - m._base + staleness + 1) * G
                seen.append((b.step, [t.policy_version for t in b.trajectories], b.metrics))
                if step == 1:  # a trainer that skips its sync is refused past the bound
                    for _ in range(staleness):
                        await m.get_batch()
                    with pytest.raises(ValueError, match="max_staleness"):
                        await m.get_batch()
                    # the rollout process waits for the weights instead, and goes on once they come
                    assert not m.due()
                    waiter = asyncio.create_task(m.wait_for_weights())
                    await asyncio.sleep(0.05)
                    assert not waiter.done()
                    await m.update_weights(vllm_engine.model_path)
                    await asyncio.wait_for(waiter, 5)
                    assert m.due()
                    return seen
                await m.update_weights(vllm_engine.model_path)
        return seen

    for step, versions, metrics in arun(go()):
        assert len(versions) == G * n
        assert all(0 <= step - v <= staleness for v in versions)
        assert metrics["rollout/staleness_max"] <= staleness
        if staleness == 0:
            assert set(versions) == {step}


@pytest.mark.slow  # the session vLLM engine
def test_env_reset_determinism_through_rollout(vllm_engine, tiny_tokenizer, arun):
    async def go():
        m = _manager(vllm_engine, tiny_tokenizer, lambda: make_env("toy_lookup"), [3, 4], group_size=2,
                     groups_per_step=2, staleness=0, seed=123)
        async with m:
            return await m.get_batch()

    a, b = arun(go()), arun(go())
    ta = {(t.metadata["task_seed"], t.metadata["sample"]): t for t in a.trajectories}
    tb = {(t.metadata["task_seed"], t.metadata["sample"]): t for t in b.trajectories}
    assert ta.keys() == tb.keys() == {(3, 0), (3, 1), (4, 0), (4, 1)}
    for key in ta:  # same task seed and sampling seed: the whole trajectory replays
        assert ta[key].tokens.tolist() == tb[key].tokens.tolist()
        assert ta[key].chunk_ids.tolist() == tb[key].chunk_ids.tolist()
    prompt = lambda t: t.tokens[: t.turns[0][0]].tolist()  # noqa: E731
    assert prompt(ta[(3, 0)]) == prompt(ta[(3, 1)]) != prompt(ta[(4, 0)])  # a group shares its task


@pytest.mark.slow  # the session vLLM engine
@pytest.mark.parametrize("staleness", [0, 1])
def test_get_groups_refills_the_step_within_the_staleness_bound(vllm_engine, tiny_tokenizer, arun, staleness):
    """Dynamic sampling's refill: extra groups for the step just taken, new task seeds, the step
    not advanced, staleness still bounded, and the next get_batch still full."""
    G, n = 2, 2

    async def go():
        m = _manager(vllm_engine, tiny_tokenizer, lambda: make_env("toy_lookup"), range(100), group_size=n,
                     groups_per_step=G, staleness=staleness)
        async with m:
            with pytest.raises(ValueError, match="get_batch first"):
                await m.get_groups(1)
            b = await m.get_batch()
            extra = await m.get_groups(3)
            with pytest.raises(ValueError, match="n must be"):
                await m.get_groups(0)
            step_after = m.step
            await m.update_weights(vllm_engine.model_path)
            nxt = await m.get_batch()
        return b, extra, step_after, nxt

    b, extra, step_after, nxt = arun(go())
    assert step_after == b.step + 1 and extra.step == b.step  # the refill belongs to b's step
    assert len(extra.trajectories) == 3 * n
    seeds = lambda batch: {t.metadata["task_seed"] for t in batch.trajectories}  # noqa: E731
    assert len(seeds(extra)) == 3 and not (seeds(extra) & seeds(b)) and not (seeds(nxt) & (seeds(b) | seeds(extra)))
    assert all(0 <= extra.step - t.policy_version <= staleness for t in extra.trajectories)
    assert len(nxt.trajectories) == G * n
    assert all(0 <= nxt.step - t.policy_version <= staleness for t in nxt.trajectories)


@pytest.mark.slow  # the session vLLM engine
def test_episode_start_from_expert_chunk_k(vllm_engine, tiny_tokenizer, arun):
    """IPA resampling's rollout hook: the env is replayed through the expert's first k turns, the
    trajectory starts with the expert's exact prefix tokens and chunk ids (logprob 0, not sampled)
    and the model samples from chunk k on; a prefix that cannot be replayed is a ValueError."""
    from arl.env.expert import expert_transcript
    from arl.env.toy import ToyLookupEnv
    from arl.data.expert import expert_trajectory, start_state, tag_resampled

    fmt = ChatFormat(tiny_tokenizer)
    env = ToyLookupEnv(min_hops=3, max_hops=3)
    seed = 11
    task, tr = arun(expert_transcript(env, seed))
    expert = expert_trajectory(fmt, env.system_prompt, task, tr, task_seed=seed)
    cfg = EpisodeConfig(sampling=SamplingConfig(max_tokens=24, temperature=1.0))
    for k in (0, 2, len(expert.turns) - 1):
        state = start_state(expert, k)
        t = arun(run_episode(vllm_engine, ToyLookupEnv(min_hops=3, max_hops=3), fmt, seed, cfg, start=state))
        P = state.prefix_len
        assert np.array_equal(t.tokens[:P], expert.tokens[:P]) and np.array_equal(t.chunk_ids[:P], expert.chunk_ids[:P])
        assert (t.rollout_logp[:P] == 0).all() and t.metadata["ipa_prefix_chunks"] == k
        # tool metrics count the sampled turns only; the replayed expert calls are set aside
        m = t.metadata
        assert m["ipa_prefix_tool_calls"] == k and len(m["turn_info"]) == len(t.turns)
        assert m["tool_calls"] == sum(1 for ti in m["turn_info"][k:] if ti["tool"]) == sum(m["tools"].values())
        assert len(m["calls"]) == sum(1 for ti in m["turn_info"][k:] if ti["tool"] or ti["tool_error"])
        versions = t.metadata["turn_versions"]  # one per turn; the replayed expert turns are -1
        assert versions[:k] == [-1] * k and min(versions[k:]) >= 0 and t.policy_version == versions[k]
        assert len(t.turns) >= k + 1 and (t.chunk_ids[t.turns[k][0]:t.turns[k][1]] == k).all()
        assert (t.rollout_logp[t.turns[k][0]:t.turns[k][1]] < 0).any()  # chunk k was sampled
        assert tag_resampled(state, t).metadata["ipa_prefix_chunks"] == k
    with pytest.raises(ValueError, match="task seed"):
        arun(run_episode(vllm_engine, ToyLookupEnv(min_hops=3, max_hops=3), fmt, seed + 1, cfg,
                         start=start_state(expert, 1)))
    # same seed, but an env whose chain differs (other key space): the replay diverges
    with pytest.raises(ValueError, match="diverges"):
        arun(run_episode(vllm_engine, ToyLookupEnv(min_hops=3, max_hops=3, num_keys=50), fmt, seed, cfg,
                         start=start_state(expert, 2)))


@pytest.mark.slow  # the session vLLM engine
def test_manager_start_for_hook_resamples_from_expert_prefixes(vllm_engine, tiny_tokenizer, arun):
    """The IPA hook in the manager: every sample of a group starts from the state ``start_for``
    gave its task, trajectories are tagged, and only sample 0 imitates the prefix."""
    from arl.env.expert import expert_transcript
    from arl.env.toy import ToyLookupEnv
    from arl.data.expert import expert_trajectory, start_state

    fmt = ChatFormat(tiny_tokenizer)
    seen = {}

    async def start_for(seed):
        env = ToyLookupEnv(min_hops=3, max_hops=3)
        task, tr = await expert_transcript(env, seed)
        seen[seed] = start_state(expert_trajectory(fmt, env.system_prompt, task, tr, task_seed=seed), 2)
        return seen[seed]

    cfg = RolloutConfig(group_size=3, staleness=0)
    episode = EpisodeConfig(sampling=SamplingConfig(max_tokens=24, temperature=1.0))

    async def go():
        async with RolloutManager(vllm_engine, lambda: ToyLookupEnv(min_hops=3, max_hops=3), fmt,
                                  tasks=iter([21, 22]), config=cfg, groups_per_step=2, episode=episode, seed=0,
                                  start_for=start_for) as m:
            return await m.get_batch()

    batch = arun(go())
    assert len(batch.trajectories) == 6 and set(seen) == {21, 22}
    for t in batch.trajectories:
        state = seen[t.metadata["task_seed"]]
        assert np.array_equal(t.tokens[:state.prefix_len], state.prefix_tokens)
        assert t.metadata["ipa_prefix_chunks"] == 2
        assert t.metadata["ipa_imitate"] == (t.metadata["sample"] == 0)


def test_ipa_start_hook_with_unsolvable_tasks(tiny_tokenizer, arun):
    """The trainer's IPA hook on a task set with unsolvable tasks (bench_stability's setting): the
    expert is played on the task as the rollout sees it, so an unsolvable task has no expert prefix
    (a fresh start) and every prefix it gives replays exactly in the rollout's env.  The expert once
    played the solvable variant of every task and its prefix diverged on the unsolvable ones, which
    killed the run."""
    from arl.config import load_config
    from arl.env import make_env
    from arl.rollout.episode import Episode
    from arl.rollout.expert import expert_start_hook
    from arl.stabilizers import IPAResampler

    cfg = load_config(None, ["env.kwargs.unsolvable_frac=0.5", "stabilizers.ipa.enabled=true",
                             "stabilizers.turn_credit.enabled=false", "stabilizers.ipa.steps_per_chunk=1"])
    fmt = ChatFormat(tiny_tokenizer)
    resampler = IPAResampler(cfg.stabilizers.ipa)
    start_for = expert_start_hook(cfg, fmt, resampler)
    resampler.offset = 2  # resume from two chunks before the end
    kinds = set()
    for seed in range(16):
        env = make_env(cfg.env.name, **cfg.env.kwargs)
        arun(env.reset(seed))
        state = arun(start_for(seed))
        kinds.add(env.solvable)
        if not env.solvable:
            assert state is None, seed
            continue
        assert state is not None, seed
        ep = Episode(make_env(cfg.env.name, **cfg.env.kwargs), fmt, EpisodeConfig(max_turns=cfg.env.max_turns), seed)
        arun(ep.start_from(state))  # raises if the replay diverges
        assert ep.meta["ipa_prefix_chunks"] == state.chunk
    assert kinds == {True, False}
