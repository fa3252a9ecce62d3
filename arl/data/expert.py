"""Expert prefixes: an expert demonstration rendered as a ``Trajectory``, the ``StartState`` a
rollout continues from (IPA chunk-initialization resampling: the expert's first k chunks, replayed,
then sampling from chunk k on), and the tag a resampled rollout carries.  Data only: the rollout
side plays from a start state, the IPA stabilizer decides which chunk k and trains on the tags.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import numpy as np

from .trajectory import Trajectory


class ChatFormatLike(Protocol):
    """What ``arl.rollout.episode.ChatFormat`` offers and ``expert_trajectory`` needs."""

    def prompt_ids(self, system: str, task: str) -> list: ...
    def encode(self, text: str) -> list: ...
    def observation_ids(self, observation: str, turn_ended_with_eos: bool = False) -> list: ...


def expert_trajectory(fmt: ChatFormatLike, system_prompt: str, task: str, transcript: Sequence,
                      *, group_id: int = 0, task_seed: Optional[int] = None) -> Trajectory:
    """Render ``(task, [(turn_text, StepResult), ...])`` of ``arl.env.expert.expert_transcript`` as a
    token-level Trajectory (rollout_logp 0: nothing was sampled)."""
    if not transcript:
        raise ValueError("transcript: empty (no expert turns)")
    tokens = list(fmt.prompt_ids(system_prompt, task))
    chunks = [-1] * len(tokens)
    turns, texts = [], []
    reward = 0.0
    for k, (text, res) in enumerate(transcript):
        ids = list(fmt.encode(text))
        turns.append((len(tokens), len(tokens) + len(ids)))
        tokens += ids
        chunks += [k] * len(ids)
        texts.append(text)
        if res.done:
            reward = float(res.reward)
            break
        obs = list(fmt.observation_ids(res.observation))
        tokens += obs
        chunks += [-1] * len(obs)
    return Trajectory(tokens=tokens, chunk_ids=chunks, rollout_logp=np.zeros(len(tokens), np.float32), reward=reward,
                      group_id=group_id, turns=turns,
                      metadata={"expert": True, "task_seed": task_seed, "expert_turns": texts})


@dataclass(frozen=True)
class StartState:
    expert: Trajectory
    chunk: int  # k: the first resampled chunk

    @property
    def prefix_len(self) -> int:
        """Tokens before chunk k's first token (the whole prompt when k = 0)."""
        return int(self.expert.turns[self.chunk][0])

    @property
    def prefix_tokens(self) -> np.ndarray:
        return self.expert.tokens[: self.prefix_len]

    @property
    def prefix_chunk_ids(self) -> np.ndarray:
        return self.expert.chunk_ids[: self.prefix_len]

    @property
    def replay_turns(self) -> list:
        """Expert turn texts the env must be stepped through before sampling."""
        return list(self.expert.metadata.get("expert_turns", []))[: self.chunk]

    @property
    def task_seed(self):
        return self.expert.metadata.get("task_seed")


def start_state(expert: Trajectory, k: int) -> StartState:
    K = len(expert.turns)
    if not 0 <= k < K:
        raise ValueError(f"k: start chunk {k} outside the expert's {K} chunks")
    return StartState(expert, int(k))


def tag_resampled(state: StartState, traj: Trajectory, imitate: bool = True) -> Trajectory:
    """A copy of a rollout from ``state`` tagged with its prefix length in chunks."""
    P = state.prefix_len
    if len(traj) < P or not np.array_equal(traj.tokens[:P], state.prefix_tokens):
        raise ValueError(f"traj: does not start with the expert prefix of {P} tokens (start chunk {state.chunk})")
    if not np.array_equal(traj.chunk_ids[:P], state.prefix_chunk_ids):
        raise ValueError("traj.chunk_ids: prefix chunk ids differ from the expert's")
    return dataclasses.replace(traj, metadata={**traj.metadata, "ipa_prefix_chunks": state.chunk,
                                               "ipa_imitate": bool(imitate)})
