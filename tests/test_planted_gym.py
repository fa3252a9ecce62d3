"""Planted-bug tests (issue #54) for the Gymnasium adapter (arl/env/gym_env.py): when an episode
ends and what it earns.  Expectations written out by hand."""
import asyncio

import pytest

gym = pytest.importorskip("gymnasium")


class _Steps(gym.Env):
    """Rewards 0.5, 0.25, 1.0, ... per step; terminates at step ``end`` (never: 0)."""

    def __init__(self, end=0, rewards=(0.5, 0.25, 1.0, 2.0)):
        self.observation_space = gym.spaces.Text(64)
        self.action_space = gym.spaces.Text(64)
        self.end, self.rewards = end, rewards

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return "go", {}

    def step(self, action):
        self.t += 1
        return f"obs{self.t}", self.rewards[self.t - 1], self.t == self.end, False, {}


gym.register(id="ArlPlantedSteps-v0", entry_point=_Steps, max_episode_steps=3)


def _play(env, turns):
    async def run():
        await env.reset(0)
        return [await env.step("a") for _ in range(turns)]
    return asyncio.run(run())


def test_a_time_limit_ends_the_episode_with_its_return():
    """Plants: a truncated (TimeLimit) episode not ending; the episode's reward the last step's
    reward instead of the return.  Three steps then the TimeLimit: 0.5 + 0.25 + 1.0 = 1.75."""
    from arl.env import make_env

    env = make_env("gym", env_id="ArlPlantedSteps-v0")
    r = _play(env, 3)
    assert [s.done for s in r] == [False, False, True]
    assert [s.reward for s in r] == [0.0, 0.0, 1.75]
    assert r[0].observation == "obs1" and r[2].info["truncated"] is True


def test_terminated_at_the_time_limit_is_not_truncated():
    """Plant: an episode both terminated and truncated (the env ends on the TimeLimit's step)
    flagged truncated; it reached its end, so it is an ordinary outcome.  0.5 + 0.25 + 1.0."""
    from arl.env import make_env

    env = make_env("gym", env_id="ArlPlantedSteps-v0", make_kwargs={"end": 3})
    r = _play(env, 3)
    assert r[2].done and r[2].reward == 1.75 and r[2].info["truncated"] is False
    early = _play(make_env("gym", env_id="ArlPlantedSteps-v0", make_kwargs={"end": 2}), 2)
    assert early[1].done and early[1].reward == 0.75 and early[1].info["truncated"] is False
