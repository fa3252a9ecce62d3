"""The guess environment: guess a whole number from 1 to ``GUESS_HIGH`` (default 20) in at most
``GUESS_MAX_GUESSES`` (default 6) guesses; after a wrong guess the game says "Higher." or
"Lower.".  Reward 1.0 on the step that finds the number, 0.0 otherwise; the episode ends when the
number is found or the guesses are used up.  The number is drawn from ``reset``'s seed, so a seed
is a task.  Each WebSocket session gets its own instance (``SUPPORTS_CONCURRENT_SESSIONS``)."""
import os
import random
import re
from typing import Any, Optional
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

try:
    from ..models import GuessAction, GuessObservation
except ImportError:
    from models import GuessAction, GuessObservation

_NUMBER = re.compile(r"-?\d+")


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        self.high = int(os.environ.get("GUESS_HIGH", "20"))
        self.max_guesses = int(os.environ.get("GUESS_MAX_GUESSES", "6"))
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._target = 1

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._target = random.Random(seed).randint(1, self.high)
        return GuessObservation(text=f"I am thinking of a whole number from 1 to {self.high}. Guess it: answer "
                                     "with one number; I will say higher or lower.", done=False, reward=0.0)

    def step(self, action: GuessAction) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        n = self._state.step_count
        out_of_guesses = n >= self.max_guesses
        found = _NUMBER.findall(action.message)
        if not found:
            return GuessObservation(text="Answer with one number.", guesses=n, done=out_of_guesses, reward=0.0,
                                    metadata={"invalid": 1})
        guess = int(found[-1])
        if guess == self._target:
            return GuessObservation(text="Correct.", guesses=n, done=True, reward=1.0)
        return GuessObservation(text="Higher." if guess < self._target else "Lower.", guesses=n,
                                done=out_of_guesses, reward=0.0)

    @property
    def state(self) -> State:
        return self._state
