"""Data models of the guess environment: the player's message in, the game's answer out."""
from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class GuessAction(Action):
    """One turn of the player: free text; the last whole number in it is the guess."""

    message: str = Field(..., description="The player's turn (the last whole number in it is the guess)")


class GuessObservation(Observation):
    """The game's answer: the rules at reset, then "Higher.", "Lower." or "Correct."."""

    text: str = Field(default="", description="What the game says")
    guesses: int = Field(default=0, description="Guesses made so far")
