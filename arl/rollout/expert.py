"""The environment's expert, played through the rollout's own episode code: SFT demonstrations, and
the expert prefixes IPA resampling starts groups from.

The expert plays with the run-time faults off (a fault would make its fixed turns diverge from the
episode), but with the task definition the rollout sees (``unsolvable_frac``: an unsolvable task has
no expert prefix and starts fresh).
"""
from __future__ import annotations

import asyncio
from typing import Callable, Optional, Protocol

from ..config import TrainConfig
from ..data.expert import expert_trajectory, start_state
from ..data import load_demonstrations
from ..env import Environment, env_class, env_kwargs, make_env
from ..env.expert import expert_transcript
from .engine import Sample
from .episode import ChatFormat, Episode, EpisodeConfig, demonstration

# env kwargs that inject run-time faults; the expert plays without them
FAULT_KEYS = ("recoverable_rate", "unrecoverable_rate", "unsolvable_frac", "latency_median_s", "latency_p99_s",
              "tool_timeout_s")


def expert_env_kwargs(cfg: TrainConfig, keep_task_definition: bool, model_dir: Optional[str] = None) -> dict:
    """``env.kwargs`` without the fault keys (``unsolvable_frac`` kept when it defines the task)."""
    keep = ("unsolvable_frac",) if keep_task_definition else ()
    return {k: v for k, v in env_kwargs(cfg.env, model_dir).items() if k not in FAULT_KEYS or k in keep}


def written_turn(ep: Episode, text: str) -> Sample:
    """A written model turn as the engine returns a sampled one: it ends with the end-of-sequence
    token unless the text ends on one of the turn's stop strings (sampling stops there and keeps
    it).  SFT learns to end a turn from this token: an env whose turns end at end of sequence
    (``stop = ()``: BFCL, MCP tools) would otherwise get a policy that never stops."""
    ids = ep.fmt.encode(text)
    if not any(s and text.endswith(s) for s in ep.sampling().stop):
        ids = ids + [ep.fmt.eos_token_id]
    return Sample(ids, [0.0] * len(ids), text, "stop")


def expert_demos(cfg: TrainConfig, fmt: ChatFormat, n: int, seed_base: int = 2_000_000,
                 env_kwargs: Optional[dict] = None) -> list:
    """Up to ``n`` successful expert demonstrations (tasks from ``seed_base`` on), rendered exactly as
    the rollout renders a model's turns: the SFT warm start's data.  ``env_kwargs``: the env's
    arguments instead of the demonstrator's (``demo_kwargs``), e.g. the run's own tasks."""
    kwargs = (env_class(cfg.env.name).demo_kwargs(expert_env_kwargs(cfg, keep_task_definition=False,
                                                                    model_dir=fmt.tokenizer.name_or_path))
              if env_kwargs is None else env_kwargs)
    env = make_env(cfg.env.name, **kwargs)
    ep_cfg = EpisodeConfig(max_turns=cfg.env.max_turns, max_total_tokens=cfg.rollout.max_total_tokens)

    async def one(seed):
        ep = Episode(env, fmt, ep_cfg, seed)
        await ep.start()
        turns = env.expert_turns()
        if turns is None:
            return None
        for text in turns:
            if ep.done:
                break
            await ep.apply(written_turn(ep, text))
        t = ep.trajectory()
        return t if t.reward > 0 else None

    async def all_():
        out = []
        for s in range(seed_base, seed_base + 4 * n):
            t = await one(s)
            if t is not None:
                out.append(t)
            if len(out) >= n:
                break
        return out

    return asyncio.run(all_())


def dataset_demos(cfg: TrainConfig, fmt: ChatFormat) -> list:
    """The first ``sft.episodes`` demonstrations of ``sft.dataset``, rendered with the configured
    environment's system prompt, tools and call format, exactly as its episodes are: the SFT
    warm start's data when the user brings demonstrations."""
    env = make_env(cfg.env.name, **env_kwargs(cfg.env, fmt.tokenizer.name_or_path))
    parser = getattr(env, "parser", None) or "hermes"
    out = []
    for i, messages in enumerate(load_demonstrations(cfg.sft.dataset)[:cfg.sft.episodes]):
        try:
            out.append(demonstration(fmt, messages, tools=getattr(env, "tools", None), system=env.system_prompt,
                                     parser=parser, group_id=i))
        except ValueError as e:
            raise ValueError(f"sft.dataset: {cfg.sft.dataset} row {i}: {e}") from None
    return out


def sft_source(cfg: TrainConfig) -> str | None:
    """Where the SFT warm start's demonstrations come from ("dataset" or "expert"; None when SFT
    is off); a one-line ValueError when it is on with neither."""
    if not cfg.sft.enabled or cfg.sft.steps == 0:
        return None
    if cfg.sft.dataset is not None:
        return "dataset"
    if env_class(cfg.env.name).expert_turns is Environment.expert_turns:
        raise ValueError(f"sft.enabled: environment {cfg.env.name!r} has no expert to demonstrate; give "
                         f"sft.dataset (JSONL of demonstration chats) or set sft.enabled: false")
    return "expert"


def sft_demonstrations(cfg: TrainConfig, fmt: ChatFormat) -> list:
    """The SFT warm start's demonstrations (see ``sft_source``)."""
    source = sft_source(cfg)
    if source == "dataset":
        return dataset_demos(cfg, fmt)
    return expert_demos(cfg, fmt, cfg.sft.episodes) if source == "expert" else []


class StartChooser(Protocol):
    """The judge that picks the chunk an IPA group starts from (``arl.stabilizers.IPAResampler``);
    its state comes from the trainer with every weight sync."""

    def start_chunks(self, num_chunks: int) -> list: ...
    def load_state_dict(self, state: dict) -> None: ...


def expert_start_hook(cfg: TrainConfig, fmt: ChatFormat, chooser: StartChooser) -> Callable:
    """``start_for(seed)`` for ``RolloutManager``: the expert plays task ``seed`` and the group starts
    at the chunk ``chooser`` picks (several anchors: one of them, by task seed); None when the env
    has no demonstrator for the task, the expert failed, or it needs more turns than an episode may."""
    kwargs = expert_env_kwargs(cfg, keep_task_definition=True, model_dir=fmt.tokenizer.name_or_path)
    max_turns = cfg.env.max_turns

    async def start_for(seed: int):
        env = make_env(cfg.env.name, **kwargs)
        try:
            res = await expert_transcript(env, seed)
        finally:
            await env.close()
        if res is None:
            return None
        task, transcript = res
        expert = expert_trajectory(fmt, env.system_prompt, task, transcript, task_seed=seed)
        if expert.reward <= 0 or len(expert.turns) > max_turns:
            return None
        ks = chooser.start_chunks(len(expert.turns))
        return start_state(expert, ks[seed % len(ks)])

    return start_for

