"""A text game written as Gymnasium documents custom environments ("Create a Custom Environment"):
a ``gymnasium.Env`` subclass with ``observation_space``/``action_space`` (``spaces.Text``),
``reset(seed=, options=)`` seeding ``self.np_random`` through ``super().reset``, ``step`` returning
``(obs, reward, terminated, truncated, info)``, and ``gymnasium.register`` so ``gymnasium.make``
finds it.  arl plays it through ``env.name: gym`` (arl/env/gym_env.py).

The game: guess a whole number from 1 to ``high``; after a wrong guess the game says "Higher." or
"Lower.".  Reward 1 for the right number, 0 otherwise; ``max_episode_steps`` guesses at most.
"""
from __future__ import annotations

import re
import string

import gymnasium as gym
from gymnasium import spaces

_NUMBER = re.compile(r"-?\d+")


class GuessNumber(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, high: int = 20):
        if high < 2:
            raise ValueError(f"high: must be >= 2, got {high}")
        self.high = int(high)
        self.observation_space = spaces.Text(max_length=200, charset=string.printable)
        self.action_space = spaces.Text(max_length=4096, charset=string.printable)
        self._target = 1

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._target = int(self.np_random.integers(1, self.high + 1))
        return (f"I am thinking of a whole number from 1 to {self.high}. Guess it: answer with one number; "
                "I will say higher or lower."), {}

    def step(self, action):
        found = _NUMBER.findall(action)
        if not found:
            return "Answer with one number.", 0.0, False, False, {"invalid": 1}
        guess = int(found[-1])
        if guess == self._target:
            return "Correct.", 1.0, True, False, {"invalid": 0}
        return ("Higher." if guess < self._target else "Lower."), 0.0, False, False, {"invalid": 0}


gym.register(id="GuessNumber-v0", entry_point=GuessNumber, max_episode_steps=6)
