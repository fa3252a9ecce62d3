"""One multi-turn episode, token in / token out.

The chat template is rendered once, for the prompt (system + task).  Each model turn then appends
exactly the ids the engine sampled (no decode/re-encode round trip, so no tokenization drift) and
gets chunk id k (k-th model turn).  The environment's answer is appended as the template's
"turn end + tool message + assistant header" tokens, all masked (-1): observations and tool errors
are never trained on.  ``Episode`` exposes the steps so other drivers (lock-step, sequential
baselines) reuse the exact same token handling; ``run_episode`` is the plain loop.
"""
from __future__ import annotations

import asyncio
import hashlib
import inspect
import time
from dataclasses import dataclass, field, replace

import numpy as np

from arl.data.trajectory import Trajectory, TrajectoryStatus
from arl.env.base import Environment, Fault, StepResult

from .engine import RolloutEngine, Sample, SamplingConfig

_SENTINEL = "\x00ARL_SPLIT\x00"


def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


class ChatFormat:
    """Token-level pieces of a tokenizer's chat template."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        # What the template puts between an assistant message's content and the next turn's
        # content, found by rendering a conversation around sentinels (works for any template
        # that renders a "tool" role).
        text = _render(tokenizer, [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL},
                                   {"role": "tool", "content": _SENTINEL + "1"}], add_generation_prompt=True)
        head, mid = text.split(_SENTINEL, 1)
        between, after = mid.split(_SENTINEL + "1", 1)
        self._between, self._after = between, after  # "<|im_end|>\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n"
        eos = tokenizer.eos_token or ""
        self._between_after_eos = between[len(eos):] if eos and between.startswith(eos) else between

    def encode(self, text: str) -> list:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        """The env sees the decode of exactly the trained ids (not the engine's streamed text,
        which holds back an unfinished UTF-8 tail)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def prompt_ids(self, system: str, task: str) -> list:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": task}]
        return self.encode(_render(self.tokenizer, messages, add_generation_prompt=True))

    def observation_ids(self, observation: str, turn_ended_with_eos: bool = False) -> list:
        between = self._between_after_eos if turn_ended_with_eos else self._between
        return self.encode(between + observation + self._after)


def _turn_info(info: dict, observation: str) -> dict:
    """Per model turn, what process-reward shaping and the monitors read (arl/stabilizers/shaping.py):
    the tool, whether the call was an error, the env's own ``new_state`` verdict when it gives one,
    and a digest of the observation (equal observations, equal digests; no long text in queues)."""
    out = {"tool": info.get("tool"), "tool_error": bool(info.get("tool_error"))}
    if "new_state" in info:
        out["new_state"] = bool(info["new_state"])
    out["obs_digest"] = hashlib.blake2b(str(observation).encode(), digest_size=8).hexdigest()
    return out


@dataclass(frozen=True)
class EpisodeConfig:
    max_turns: int | None = None  # None: the environment's max_turns
    max_total_tokens: int = 1024  # prompt + every turn + every observation
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # per model turn (n is forced to 1)
    step_timeout_s: float | None = None  # an env.step slower than this is a recoverable fault
    abort_on_recoverable: bool = True  # stop the attempt at a recoverable fault (the manager retries)

    def __post_init__(self):
        if self.max_total_tokens < 2:
            raise ValueError(f"EpisodeConfig.max_total_tokens: must be >= 2, got {self.max_total_tokens}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"EpisodeConfig.max_turns: must be >= 1, got {self.max_turns}")


class Episode:
    """State of one episode; drive it with ``start`` / ``prompt`` / ``apply`` (or ``run_episode``)."""

    def __init__(self, env: Environment, fmt: ChatFormat, config: EpisodeConfig, seed: int,
                 sample: int = 0, group_id: int = 0, sample_seed: int | None = None):
        self.env, self.fmt, self.cfg = env, fmt, config
        self.seed, self.sample, self.group_id, self.sample_seed = seed, sample, group_id, sample_seed
        self.tokens: list = []
        self.chunk_ids: list = []
        self.logp: list = []
        self.turns: list = []
        self.versions: list = []
        self.reward = 0.0
        self.done = False
        self.fault = Fault.NONE
        self.meta: dict = {"task_seed": seed, "sample": sample, "tool_calls": 0, "tool_errors": 0,
                           "recoverable_faults": 0, "gen_s": 0.0, "tool_s": 0.0, "truncated": None,
                           "tools": {}, "calls": [], "turn_info": []}

    @property
    def max_turns(self) -> int:
        return self.cfg.max_turns if self.cfg.max_turns is not None else self.env.max_turns

    async def start(self) -> None:
        try:
            if "sample" in inspect.signature(self.env.reset).parameters:
                task = await self.env.reset(self.seed, sample=self.sample)
            else:
                task = await self.env.reset(self.seed)
        except Exception as e:  # the env could not start: nothing to train on, mask it
            return self._fail(Fault.UNRECOVERABLE, f"reset: {type(e).__name__}: {e}")
        ids = self.fmt.prompt_ids(self.env.system_prompt, task)
        self._append(ids, -1)
        if len(self.tokens) >= self.cfg.max_total_tokens:
            self._end(0.0, truncated="prompt_too_long")

    async def start_from(self, state) -> None:
        """IPA chunk initialization: ``start``, then replay ``state.replay_turns`` (the expert's
        turns 0..k-1, a ``arl.stabilizers.ipa.StartState``) through the environment as chunks
        0..k-1 with rollout logprob 0 (turn version -1), so sampling continues at chunk k.  The prefix must
        reproduce the expert's tokens exactly (same task seed, deterministic env); any divergence,
        or an episode the replay already ends, is a ValueError naming where."""
        if state.task_seed is not None and int(state.task_seed) != int(self.seed):
            raise ValueError(f"start_from: expert task seed {state.task_seed} != episode seed {self.seed}")
        await self.start()
        if self.done:
            return  # the env failed to start: a fault, handled like any other
        for j, text in enumerate(state.replay_turns):
            ids = self.fmt.encode(text)
            await self.apply(Sample(ids, [0.0] * len(ids), text, "stop", version=-1))  # -1: not sampled
            if self.done and self.fault is Fault.NONE:
                raise ValueError(f"start_from: replaying expert turn {j} of {state.chunk} ended the episode")
            if self.done:
                return  # a fault during the replay (e.g. injected): reported as usual
        prefix = np.asarray(state.prefix_tokens)
        if len(self.tokens) != len(prefix) or not np.array_equal(np.asarray(self.tokens), prefix):
            n = min(len(self.tokens), len(prefix))
            where = next((i for i in range(n) if self.tokens[i] != prefix[i]), n)
            raise ValueError(f"start_from: replayed prefix diverges from the expert's at token {where} "
                             f"(replayed {len(self.tokens)} tokens, expert prefix {len(prefix)})")
        self.meta["ipa_prefix_chunks"] = int(state.chunk)
        # tool metrics and monitors count what the policy did: the replayed expert calls move aside
        # (turn_info keeps one entry per chunk; shaping skips the prefix by ipa_prefix_chunks)
        self.meta["ipa_prefix_tool_calls"] = self.meta["tool_calls"]
        self.meta.update(tool_calls=0, tool_errors=0, tools={}, calls=[])

    def sampling(self) -> SamplingConfig:
        """Sampling for the next model turn (per-turn token budget, per-turn seed)."""
        room = self.cfg.max_total_tokens - len(self.tokens)
        s = self.cfg.sampling
        seed = None if self.sample_seed is None else (self.sample_seed * 7919 + len(self.turns)) % (1 << 31)
        return replace(s, n=1, max_tokens=max(1, min(s.max_tokens, room)), seed=seed)

    async def apply(self, sample: Sample) -> None:
        """Append a sampled model turn, step the env with its text, append the observation."""
        k = len(self.turns)
        start = len(self.tokens)
        self.tokens += list(sample.token_ids)
        self.chunk_ids += [k] * len(sample.token_ids)
        self.logp += list(sample.logprobs)
        self.turns.append((start, len(self.tokens)))
        self.versions.append(sample.version)
        text = self.fmt.decode(sample.token_ids)
        t0 = time.perf_counter()
        try:
            if self.cfg.step_timeout_s is not None:
                res = await asyncio.wait_for(self.env.step(text), self.cfg.step_timeout_s)
            else:
                res = await self.env.step(text)
        except asyncio.TimeoutError:
            res = StepResult("error: tool timed out", 0.0, False, {"fault": Fault.RECOVERABLE, "tool_error": True})
        except Exception as e:  # the env broke (contract: malformed calls never raise)
            self.meta["tool_s"] += time.perf_counter() - t0
            return self._fail(Fault.UNRECOVERABLE, f"step: {type(e).__name__}: {e}")
        self.meta["tool_s"] += time.perf_counter() - t0
        info = res.info
        if info.get("tool") or info.get("tool_error"):  # a tool-call attempt (an answer is not one)
            err = bool(info.get("tool_error"))
            args = None if err or info.get("args") is None else dict(info["args"])  # malformed: no args
            self.meta["calls"].append({"tool": info.get("tool"), "args": args, "error": err})
        if info.get("tool"):
            self.meta["tool_calls"] += 1
            self.meta["tools"][info["tool"]] = self.meta["tools"].get(info["tool"], 0) + 1
        self.meta["tool_errors"] += int(bool(info.get("tool_error")))
        self.meta["turn_info"].append(_turn_info(info, res.observation))
        fault = res.fault
        if fault is Fault.UNRECOVERABLE:
            return self._fail(fault, res.observation)
        if fault is Fault.RECOVERABLE:
            self.meta["recoverable_faults"] += 1
            if self.cfg.abort_on_recoverable:
                return self._fail(fault, res.observation)
        if res.done:
            return self._end(float(res.reward), truncated="env" if info.get("truncated") else None)
        if len(self.turns) >= self.max_turns:
            return self._end(0.0, truncated="max_turns")
        ended_eos = bool(sample.token_ids) and sample.token_ids[-1] == self.fmt.eos_token_id
        obs_ids = self.fmt.observation_ids(res.observation, ended_eos)
        if len(self.tokens) + len(obs_ids) >= self.cfg.max_total_tokens:
            return self._end(0.0, truncated="max_total_tokens")
        self._append(obs_ids, -1)

    def _append(self, ids, chunk):
        self.tokens += ids
        self.chunk_ids += [chunk] * len(ids)
        self.logp += [0.0] * len(ids)

    def _end(self, reward: float, truncated: str | None = None):
        self.reward, self.done = reward, True
        self.meta["truncated"] = truncated

    def _fail(self, fault: Fault, why: str):
        self.fault, self.done, self.reward = fault, True, 0.0
        self.meta["fault_reason"] = why

    def trajectory(self) -> Trajectory:
        meta = dict(self.meta, fault=self.fault.value, turn_versions=list(self.versions))
        tokens = self.tokens or [self.fmt.eos_token_id]  # reset failed: a one-token placeholder
        return Trajectory(
            tokens=tokens, chunk_ids=self.chunk_ids if self.tokens else [-1],
            rollout_logp=self.logp if self.tokens else [0.0], reward=self.reward, group_id=self.group_id,
            policy_version=next((v for v in self.versions if v >= 0), 0), turns=list(self.turns),
            status=TrajectoryStatus.OK, metadata=meta)


async def run_episode(engine: RolloutEngine, env: Environment, fmt: ChatFormat, seed: int,
                      config: EpisodeConfig | None = None, *, sample: int = 0, group_id: int = 0,
                      sample_seed: int | None = None, start=None) -> Trajectory:
    """Play one episode to the end.  Faults are reported in ``metadata["fault"]``; turning them
    into MASKED / FILTERED statuses is the manager's job.  ``start``: an IPA ``StartState`` to
    resume the expert's trajectory from (see ``Episode.start_from``)."""
    ep = Episode(env, fmt, config or EpisodeConfig(), seed, sample, group_id, sample_seed)
    if start is None:
        await ep.start()
    else:
        await ep.start_from(start)
    while not ep.done:
        t0 = time.perf_counter()
        s = await engine.generate_one(ep.tokens, ep.sampling())
        ep.meta["gen_s"] += time.perf_counter() - t0
        await ep.apply(s)
    return ep.trajectory()
