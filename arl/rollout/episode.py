"""One multi-turn episode, token in / token out.

The chat template is rendered once, for the prompt (system + task, and the env's ``tools``).  Each
model turn then appends exactly the ids the engine sampled (no decode/re-encode round trip, so no
tokenization drift) and gets chunk id k (k-th model turn).  The environment's answer is appended as
the template's "turn end + tool message(s) + assistant header" tokens, all masked (-1):
observations and tool errors are never trained on.  An observation may be a list (one tool message
per call); the template's own layout of k consecutive tool messages is used (Qwen2.5 merges them
into one user block of ``<tool_response>``s).  ``Episode`` exposes the steps so other drivers
(lock-step, sequential baselines) reuse the exact same token handling; ``run_episode`` is the
plain loop.

Tools in the prompt: when the env has ``tools`` (OpenAI function schemas), the prompt is rendered
with ``apply_chat_template(messages, tools=tools)`` if the template renders tools (found by
rendering a probe tool).  Otherwise (a template without tool support) the tools go in the system
message, Hermes style: the system prompt, a blank line, then the ``hermes`` parser's
``tools_prompt`` -- "# Tools", the schemas one JSON per line inside ``<tools></tools>``, and the
instruction to answer each call as ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``
(a system message holding only that block when there is no system prompt).
"""
from __future__ import annotations

import asyncio
import hashlib
import inspect
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from arl.data.trajectory import Trajectory, TrajectoryStatus
from arl.env.base import STOP_STRINGS, Environment, Fault, StepResult
from arl.env.tool_parsers import get_parser

from .engine import RolloutEngine, Sample, SamplingConfig

_SENTINEL = "\x00ARL_SPLIT\x00"
OBSERVATION_ROLES = ("tool", "user")  # who answers a model turn: a tool, or the user (a game, a simulator)
_PROBE_TOOL = {"type": "function", "function": {"name": "arl_probe_tool_7f3a", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


def _render(tokenizer, messages, add_generation_prompt: bool, **kw) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)


def _check_tools(tools) -> list:
    """``env.tools`` as a list of OpenAI function schemas; a one-line ValueError otherwise."""
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"env.tools: expected a list of OpenAI function schemas, got {type(tools).__name__}")
    for i, t in enumerate(tools):
        if not (isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"]):
            raise ValueError(f"env.tools[{i}]: expected an OpenAI function schema {{'type': 'function', "
                             f"'function': {{'name', 'description', 'parameters'}}}}, got {type(t).__name__}")
    return list(tools)


def _messages(system: str, task) -> list:
    """The chat a prompt starts with: ``task`` (the first user message, or the messages), after
    ``system`` unless the messages bring their own system message."""
    if isinstance(task, str):
        msgs = [{"role": "user", "content": task}]
    elif isinstance(task, (list, tuple)) and task and all(isinstance(m, dict) and "role" in m for m in task):
        msgs = [dict(m) for m in task]
    else:
        raise ValueError(f"reset: must return the task (str) or a non-empty list of chat messages, got {task!r:.80}")
    if system and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": system})
    return msgs


class ChatFormat:
    """Token-level pieces of a tokenizer's chat template."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self._pieces: dict = {}  # k tool messages -> the text around them
        self._supports_tools = None
        self._observation_pieces(1)  # a template that cannot render tool messages fails here

    def _observation_pieces(self, k: int, role: str = "tool") -> tuple:
        """What the template puts between an assistant message's content and the first of k
        ``role`` messages (tool results, or a game's / user simulator's ``user`` turn), between
        consecutive ones, and after the last (through the next assistant header), found by
        rendering a conversation around sentinels (any template that renders that role)."""
        if (k, role) not in self._pieces:
            marks = [f"{_SENTINEL}{i}{_SENTINEL}" for i in range(k + 1)]
            msgs = ([{"role": "user", "content": "u"}, {"role": "assistant", "content": marks[0]}]
                    + [{"role": role, "content": m} for m in marks[1:]])
            text = _render(self.tokenizer, msgs, add_generation_prompt=True)
            if any(text.count(m) != 1 for m in marks):
                raise ValueError(f"chat template: cannot tell where {role} messages go (does it render the "
                                 f"{role!r} role after an assistant message?)")
            rest = text.split(marks[0], 1)[1]
            pieces = []
            for m in marks[1:]:
                piece, rest = rest.split(m, 1)
                pieces.append(piece)
            between = pieces[0]
            eos = self.tokenizer.eos_token or ""
            self._pieces[k, role] = (between, pieces[1:], rest,
                                     between[len(eos):] if eos and between.startswith(eos) else between)
        return self._pieces[k, role]

    @property
    def supports_tools(self) -> bool:
        """Whether the template renders ``tools=`` itself (else: the Hermes-style fallback)."""
        if self._supports_tools is None:
            msgs = [{"role": "user", "content": "u"}]
            try:
                with_tools = _render(self.tokenizer, msgs, True, tools=[_PROBE_TOOL])
            except Exception:  # a template that chokes on tools does not support them
                with_tools = ""
            name = _PROBE_TOOL["function"]["name"]
            self._supports_tools = name in with_tools and with_tools != _render(self.tokenizer, msgs, True)
        return self._supports_tools

    def encode(self, text: str) -> list:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids, keep_tokens: tuple = ()) -> str:
        """The env sees the decode of exactly the trained ids (not the engine's streamed text,
        which holds back an unfinished UTF-8 tail), without special tokens but ``keep_tokens``."""
        ids = list(ids)
        keep = {i for i in self.tokenizer.convert_tokens_to_ids(list(keep_tokens)) if i is not None}
        if not keep.intersection(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        out, run = [], []
        for i in ids + [None]:
            if i is None or i in keep:
                out.append(self.tokenizer.decode(run, skip_special_tokens=True))
                out.append(self.tokenizer.convert_ids_to_tokens(i) if i is not None else "")
                run = []
            else:
                run.append(i)
        return "".join(out)

    def render_prompt(self, system: str, task, tools=None) -> str:
        """The prompt text: ``task`` (a str: the first user message; or chat messages) after
        ``system``, with ``tools`` (OpenAI schemas) rendered by the template or in the system
        message (see the module docstring); ends with the assistant header."""
        messages = _messages(system, task)
        if not tools:
            return _render(self.tokenizer, messages, add_generation_prompt=True)
        tools = _check_tools(tools)
        if self.supports_tools:
            return _render(self.tokenizer, messages, add_generation_prompt=True, tools=tools)
        block = get_parser("hermes").tools_prompt(tools)
        if messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{block}" if messages[0]["content"] else block
        else:
            messages.insert(0, {"role": "system", "content": block})
        return _render(self.tokenizer, messages, add_generation_prompt=True)

    def prompt_ids(self, system: str, task, tools=None) -> list:
        return self.encode(self.render_prompt(system, task, tools))

    def observation_ids(self, observation, turn_ended_with_eos: bool = False, role: str = "tool") -> list:
        """The masked ids after a model turn: one ``role`` message (a str) or one per call (a list)."""
        obs = [observation] if isinstance(observation, str) else list(observation)
        if not obs or not all(isinstance(o, str) for o in obs):
            raise ValueError(f"observation: expected a str or a non-empty list of str, got {observation!r:.80}")
        if role not in OBSERVATION_ROLES:
            raise ValueError(f"observation role: expected one of {OBSERVATION_ROLES}, got {role!r}")
        between, seps, after, between_after_eos = self._observation_pieces(len(obs), role)
        text = between_after_eos if turn_ended_with_eos else between
        for i, o in enumerate(obs):
            text += (seps[i - 1] if i else "") + o
        return self.encode(text + after)


def demonstration(fmt: ChatFormat, messages: list, tools=None, system: str = "", parser="hermes",
                  group_id: int = 0) -> Trajectory:
    """A demonstration chat as the rollout would have played it (SFT data): ``messages`` in
    OpenAI shape -- system/user messages, then assistant messages (``content`` and/or
    ``tool_calls``, written in ``parser``'s native text: a name or a ``ToolParser``) each followed by its tool messages, the last
    one the final answer.  Assistant turns are chunks 0..K-1, each closed by EOS as a model closes
    its turn; the prompt and the tool messages are -1.  One-line ValueError naming the message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("demonstration: expected a non-empty list of chat messages")
    first = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"), None)
    if first is None or first == 0:
        raise ValueError("demonstration: needs the prompt (system/user messages) then at least one assistant message")
    if messages[-1].get("role") != "assistant":
        raise ValueError(f"demonstration: messages[{len(messages) - 1}] must be the final assistant answer, "
                         f"got role {messages[-1].get('role')!r}")
    fmt_calls = (get_parser(parser) if isinstance(parser, str) else parser).format_calls
    tokens = list(fmt.prompt_ids(system, messages[:first], tools=tools) if tools
                  else fmt.prompt_ids(system, messages[:first]))
    chunks, turns, i = [-1] * len(tokens), [], first
    while i < len(messages):
        m = messages[i]
        if m.get("role") != "assistant":
            raise ValueError(f"demonstration: messages[{i}] must be an assistant message, got role {m.get('role')!r}")
        content = m.get("content") or ""
        try:
            text = fmt_calls(content, m["tool_calls"]) if m.get("tool_calls") else content
        except ValueError as e:
            raise ValueError(f"demonstration: messages[{i}]: {e}") from None
        ids = fmt.encode(text) + [fmt.eos_token_id]
        turns.append((len(tokens), len(tokens) + len(ids)))
        tokens += ids
        chunks += [len(turns) - 1] * len(ids)
        i += 1
        obs = []
        while i < len(messages) and messages[i].get("role") == "tool":
            obs.append(str(messages[i].get("content", "")))
            i += 1
        if obs:
            ids = fmt.observation_ids(obs, turn_ended_with_eos=True)
            tokens += ids
            chunks += [-1] * len(ids)
        elif i < len(messages):
            raise ValueError(f"demonstration: messages[{i - 1}]: an assistant turn before the last needs its tool messages")
    return Trajectory(tokens=tokens, chunk_ids=chunks, rollout_logp=np.zeros(len(tokens), np.float32), reward=1.0,
                      group_id=group_id, turns=turns, metadata={"demonstration": True})


def _turn_info(info: dict, observation) -> dict:
    """Per model turn, what process-reward shaping and the monitors read (arl/algo/shaping.py):
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
                 sample: int = 0, group_id: int = 0, sample_seed: int | None = None, task: dict | None = None):
        self.env, self.fmt, self.cfg = env, fmt, config
        self.seed, self.sample, self.group_id, self.sample_seed = seed, sample, group_id, sample_seed
        self.task = task  # the dataset row, for an env whose reset takes ``task``
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
        params = inspect.signature(self.env.reset).parameters
        kwargs = {"sample": self.sample} if "sample" in params else {}
        if self.task is not None and "task" in params:
            kwargs["task"] = self.task
        try:
            task = await self.env.reset(self.seed, **kwargs)
        except Exception as e:  # the env could not start: nothing to train on, mask it
            return self._fail(Fault.UNRECOVERABLE, f"reset: {type(e).__name__}: {e}")
        tools = getattr(self.env, "tools", None)
        # (only with tools: drivers' minimal formats take (system, task))
        ids = (self.fmt.prompt_ids(self.env.system_prompt, task, tools=tools) if tools
               else self.fmt.prompt_ids(self.env.system_prompt, task))
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
        """Sampling for the next model turn (per-turn token budget, per-turn seed, the env's stop
        strings).  An env on the legacy default stop strings keeps the config's (tests and benches
        pin ``stop=()`` for fixed-length turns)."""
        room = self.cfg.max_total_tokens - len(self.tokens)
        s = self.cfg.sampling
        seed = None if self.sample_seed is None else (self.sample_seed * 7919 + len(self.turns)) % (1 << 31)
        stop = tuple(getattr(self.env, "stop", STOP_STRINGS))
        return replace(s, n=1, max_tokens=max(1, min(s.max_tokens, room)), seed=seed,
                       stop=s.stop if stop == tuple(STOP_STRINGS) else stop)

    async def apply(self, sample: Sample) -> None:
        """Append a sampled model turn, step the env with its text, append the observation."""
        k = len(self.turns)
        start = len(self.tokens)
        self.tokens += list(sample.token_ids)
        self.chunk_ids += [k] * len(sample.token_ids)
        self.logp += list(sample.logprobs)
        self.turns.append((start, len(self.tokens)))
        self.versions.append(sample.version)
        text = self.fmt.decode(sample.token_ids, tuple(getattr(self.env, "keep_tokens", ())))
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
        self._count_calls(info)
        self.meta["turn_info"].append(_turn_info(info, res.observation))
        self._add_counts(info.get("counts"))
        fault = res.fault
        if info.get("reward_exception"):
            self.meta["reward_exception"] = str(info["reward_exception"])
        if fault is Fault.UNRECOVERABLE:
            return self._fail(fault, res.observation)
        if fault is Fault.RECOVERABLE:
            self.meta["recoverable_faults"] += 1
            if self.cfg.abort_on_recoverable:
                return self._fail(fault, res.observation)
        if res.done:
            if info.get("reward_components"):
                self.meta["reward_components"] = {str(k): float(v) for k, v in info["reward_components"].items()}
            return self._end(float(res.reward), truncated="env" if info.get("truncated") else None)
        if len(self.turns) >= self.max_turns:
            return self._end(0.0, truncated="max_turns")
        ended_eos = bool(sample.token_ids) and sample.token_ids[-1] == self.fmt.eos_token_id
        obs_ids = self.fmt.observation_ids(res.observation, ended_eos, getattr(self.env, "observation_role", "tool"))
        if len(self.tokens) + len(obs_ids) >= self.cfg.max_total_tokens:
            return self._end(0.0, truncated="max_total_tokens")
        self._append(obs_ids, -1)

    def _add_counts(self, counts) -> None:
        """Sums the env's ``info["counts"]`` into ``meta["env_counts"]`` (logged as ``env/<name>``)."""
        if counts is None:
            return
        if not isinstance(counts, dict):
            raise ValueError(f"env step info['counts']: expected a dict of numbers, got {type(counts).__name__}")
        acc = self.meta.setdefault("env_counts", {})
        for k, v in counts.items():
            if not isinstance(v, (int, float)) or not math.isfinite(v):  # a bool counts 0 or 1
                raise ValueError(f"env step info['counts'][{k!r}]: expected a finite number, got {v!r}")
            acc[str(k)] = acc.get(str(k), 0.0) + float(v)

    def _count_calls(self, info: dict) -> None:
        """One ``meta["calls"]`` record per tool-call attempt (an answer is not one): from the
        env's per-call ``info["calls"]`` when it gives them, else from the turn's one call."""
        if isinstance(info.get("calls"), list):
            calls = [(c.get("name"), c.get("arguments"), bool(c.get("error"))) for c in info["calls"]]
        elif info.get("tool") or info.get("tool_error"):
            calls = [(info.get("tool"), info.get("args"), bool(info.get("tool_error")))]
        else:
            calls = []
        for tool, args, err in calls:
            args = None if err or args is None else dict(args)  # malformed: no args
            self.meta["calls"].append({"tool": tool, "args": args, "error": err})
            if tool:
                self.meta["tool_calls"] += 1
                self.meta["tools"][tool] = self.meta["tools"].get(tool, 0) + 1
            self.meta["tool_errors"] += int(err)

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
                      sample_seed: int | None = None, start=None, task: dict | None = None) -> Trajectory:
    """Play one episode to the end.  Faults are reported in ``metadata["fault"]``; turning them
    into MASKED / FILTERED statuses is the manager's job.  ``start``: an IPA ``StartState`` to
    resume the expert's trajectory from (see ``Episode.start_from``).  ``task``: the dataset row,
    passed to an env whose reset takes it."""
    ep = Episode(env, fmt, config or EpisodeConfig(), seed, sample, group_id, sample_seed, task)
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
