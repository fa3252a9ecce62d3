"""``env.name: gym``: Gymnasium-style text environments through arl's door.  The game of
examples/gym/guess.py (written as Gymnasium documents custom envs) is played by a scripted engine
through arl's own episode code: its answers reach the model in the ``user`` role; the episode's
return is the reward.  What the adapter cannot carry fails in one line; so does a missing package."""
from __future__ import annotations

import asyncio
import sys

import pytest

gym = pytest.importorskip("gymnasium")  # the gym extra (bash install.sh --gym)

from arl.env import make_env  # noqa: E402
from arl.rollout import ChatFormat, EpisodeConfig, SamplingConfig  # noqa: E402
from arl.rollout.episode import run_episode  # noqa: E402
from example_runs import BinarySearch, three_rl_steps  # noqa: E402

GUESS = "examples.gym.guess:GuessNumber-v0"


def test_the_game_answers_as_the_user_and_the_return_is_the_reward(tiny_tokenizer, arun):
    fmt = ChatFormat(tiny_tokenizer)
    env = make_env("gym", env_id=GUESS, make_kwargs={"high": 20}, system_prompt="Play.", max_turns=6)
    assert env.observation_role == "user" and env.stop == ()
    cfg = EpisodeConfig(max_turns=6, max_total_tokens=1024, sampling=SamplingConfig(max_tokens=8, stop=()))
    t = arun(run_episode(BinarySearch(tiny_tokenizer), env, fmt, seed=3, config=cfg))
    # seed 3's number is 17: 10, 15, 18, 16, then 17
    assert t.reward == 1.0 and t.metadata["fault"] == "none" and len(t.turns) == 5
    text = tiny_tokenizer.decode(t.tokens)  # the game's answers are user messages, as the template renders them
    assert "<|im_start|>user\nHigher.<|im_end|>" in text and "<|im_start|>user\nLower.<|im_end|>" in text
    assert "<|im_start|>tool" not in text
    # same seed, same number: a deterministic task per seed
    again = arun(run_episode(BinarySearch(tiny_tokenizer), env, fmt, seed=3, config=cfg))
    assert len(again.turns) == len(t.turns)


class ArrayGame(gym.Env):
    """Documented Gymnasium style, but a Box observation: not text."""

    def __init__(self):
        self.observation_space = gym.spaces.Box(0, 1, (2,))
        self.action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, True, False, {}


gym.register(id="ArlTestArrayGame-v0", entry_point=ArrayGame)


def test_what_the_adapter_cannot_carry_fails_in_one_line(monkeypatch):
    env = make_env("gym", env_id="ArlTestArrayGame-v0")
    with pytest.raises(ValueError) as e:
        asyncio.run(env.reset(0))
    assert str(e.value) == "gym env 'ArlTestArrayGame-v0' reset: observation must be text (a gymnasium.spaces.Text env), got ndarray"
    with pytest.raises(ValueError, match=r"^env.kwargs.env_id: gymnasium.make\('NoSuchGame-v0'\) failed \(NameNotFound"):
        make_env("gym", env_id="NoSuchGame-v0")
    monkeypatch.setitem(sys.modules, "gymnasium", None)  # not installed
    with pytest.raises(ValueError) as e:
        make_env("gym", env_id=GUESS)
    assert "gym needs the gymnasium package, which is not installed" in str(e.value)
    assert "bash install.sh --gym" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow  # a whole training run (vLLM engine, trainer rank): ~3.5 min on 2 CPU cores
def test_three_rl_steps_with_held_out_evaluation(tmp_path, tiny_model_dir):
    """examples/gym/config.yaml as shipped but on the tests' tiny model: 3 RL steps, held-out
    evaluations before and after, the game's answers in the user role of the transcripts."""
    import json

    out = three_rl_steps("gym", tmp_path, tiny_model_dir, "env.pool_size=8")
    row = json.loads((out / "transcripts" / "heldout_step3.jsonl").read_text().splitlines()[0])
    obs = [t["text"] for t in row["transcript"]["turns"] if t["role"] == "observation"]
    assert obs and all("user" in o and "tool" not in o for o in obs)
