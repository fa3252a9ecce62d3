"""A guessing game written as verifiers 0.4 documents environments (``import verifiers.v1 as vf``):
a ``Taskset`` whose ``load()`` yields typed ``Task``s (the seeded number rides on the task data),
an ``Env`` whose ``run()`` plays the game as the run's user through ``agents.player.interaction``
(as verifiers' own TextArena env does), and the score recorded on the trace (a ``@vf.reward`` on the
task reads it).  Exported through ``__all__``, verifiers' plugin rule: ``taskset.id`` names this
package.  ``split`` picks the seeds: ``train`` counts up from 0, ``test`` from 10_000 (held out)."""
import random
import re
from typing import Literal

import verifiers.v1 as vf

HIGH, MAX_GUESSES = 20, 6
_NUMBER = re.compile(r"-?\d+")


class GuessConfig(vf.TasksetConfig):
    split: Literal["train", "test"] = "train"
    size: int = 1000


class GuessData(vf.TaskData):
    target: int


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def found(self, task, trace) -> float:
        """1.0 when the game ended on the number (the env records what the game said last)."""
        return 1.0 if trace.info.get("outcome") == "found" else 0.0


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self):
        base = 0 if self.config.split == "train" else 10_000
        for i in range(self.config.size):
            yield GuessTask(GuessData(
                name=f"guess#{base + i}", target=random.Random(base + i).randint(1, HIGH),
                prompt=f"I am thinking of a whole number from 1 to {HIGH}. Guess it: answer with one number; "
                       "I will say higher or lower.",
                system_prompt="You play a guessing game. Answer each turn with one number."), self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()  # the prompt speaks first: the model's opening guess
            for n in range(1, MAX_GUESSES + 1):
                if segment.terminated:
                    break
                found = _NUMBER.findall(segment.last_reply)
                if found and int(found[-1]) == task.data.target:
                    interaction.trace.info["outcome"] = "found"
                    break
                if n == MAX_GUESSES:
                    interaction.trace.info["outcome"] = "out of guesses"
                    break
                said = ("Answer with one number." if not found
                        else "Higher." if int(found[-1]) < task.data.target else "Lower.")
                segment = await interaction.turn(said)


__all__ = ["GuessTaskset", "GuessEnv"]
