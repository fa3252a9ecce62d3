"""``toy_lookup``: multi-hop key lookup, small enough for a tiny model to learn on 2 CPU cores.

An episode hides a chain ``k17 -> k03 -> k88 -> v42`` of 2-5 hops.  The task is "Find the value
for k17."; the only tool is ``lookup(key)``, which answers with the next key (``kNN``), the value
(``vNN``) or ``none`` for a key off the chain.  The model looks keys up until it sees a value and
answers it: ``<answer>v42</answer>`` earns 1, anything else 0.  Strings are short and regular
(``k``/``v`` + fixed-width digits) so a small BPE vocabulary covers them and observations stay a
few tokens long.  Solving needs copying, not counting, so a tiny model can get to ~100%.

Everything is deterministic for ``reset(seed, sample=...)``: the task depends on ``seed`` only (all
samples of a group see the same task); tool latency and faults on ``(fault_seed, seed, sample)``.
With ``unsolvable_frac > 0`` that fraction of tasks ends in a cycle of keys (no value reachable;
every answer earns 0) -- the "hard cases" of the stability bench, which invite long failure loops.
"""
from __future__ import annotations

import asyncio
import random
from typing import List, Optional

from .base import Environment, Fault, StepResult
from .faults import FAULT_KINDS, FaultConfig, LatencyModel, draw_tool_call
from .registry import register_env
from .toolcall import ToolSpec, describe_tools, format_answer, format_tool_call, parse_turn

LOOKUP = ToolSpec("lookup", {"key": "string"}, "the next key (kNN) or the value (vNN)")
NOT_FOUND = "none"


@register_env("toy_lookup")
class ToyLookupEnv(Environment):
    tool_specs = (LOOKUP,)  # described in the system prompt (``tools`` would go to the template)

    def __init__(self, min_hops: int = 2, max_hops: int = 5, num_keys: int = 100,
                 latency_median_s: float = 0.0, latency_p99_s: float = 0.0,
                 tool_timeout_s: Optional[float] = None, recoverable_rate: float = 0.0,
                 unrecoverable_rate: float = 0.0, unsolvable_frac: float = 0.0,
                 fault_seed: int = 0, max_turns: Optional[int] = None):
        if not 1 <= min_hops <= max_hops:
            raise ValueError(f"min_hops/max_hops: need 1 <= min_hops <= max_hops, got "
                             f"{min_hops}/{max_hops}")
        if num_keys < max_hops:
            raise ValueError(f"num_keys: need >= max_hops ({max_hops}), got {num_keys}")
        if not 0.0 <= unsolvable_frac <= 1.0:
            raise ValueError(f"unsolvable_frac must be in [0, 1], got {unsolvable_frac}")
        self.min_hops, self.max_hops, self.num_keys = min_hops, max_hops, num_keys
        self.latency = LatencyModel(latency_median_s, latency_p99_s)
        self.faults = FaultConfig(recoverable_rate, unrecoverable_rate, tool_timeout_s)
        self.unsolvable_frac, self.fault_seed = unsolvable_frac, fault_seed
        # room for every hop, the answer and a few mistakes or retries
        self.max_turns = max_turns if max_turns is not None else max_hops + 3
        if self.max_turns < max_hops + 1:
            raise ValueError(f"max_turns (env.max_turns): need >= max_hops + 1 ({max_hops + 1}) to answer the longest "
                             f"chain, got {self.max_turns}")
        self._width = len(str(num_keys - 1))
        self.system_prompt = (
            "Find the value for a key. Tool:\n" + describe_tools(self.tool_specs) + "\n"
            "Look keys up until you get a value, then answer it.\n"
            + format_tool_call("lookup", {"key": self._key(17 % num_keys)}) + "\n"
            + format_answer(self._val(42 % num_keys)))
        self._active = False

    def _key(self, i: int) -> str:
        return f"k{i:0{self._width}d}"

    def _val(self, i: int) -> str:
        return f"v{i:0{self._width}d}"

    # -- episode ---------------------------------------------------------------------------------
    async def reset(self, seed: int, *, sample: int = 0) -> str:
        """``sample`` (optional) decorrelates faults/latency between the members of a group that
        share ``seed``; the task itself depends on ``seed`` only."""
        if not isinstance(seed, int):
            raise ValueError(f"reset: seed must be an int, got {type(seed).__name__}")
        task_rng = random.Random(f"toy_lookup/task/{seed}")
        hops = task_rng.randint(self.min_hops, self.max_hops)
        chain = [self._key(i) for i in task_rng.sample(range(self.num_keys), hops)]
        self.value = self._val(task_rng.randrange(self.num_keys))
        self.solvable = random.Random(f"toy_lookup/hard/{seed}").random() >= self.unsolvable_frac
        end = self.value if self.solvable else chain[0]  # unsolvable: the chain is a cycle
        self.table = dict(zip(chain, chain[1:] + [end]))
        self.chain, self.seed = chain, seed
        self._fault_rng = random.Random(f"toy_lookup/fault/{self.fault_seed}/{seed}/{sample}")
        self._latency_rng = random.Random(f"toy_lookup/latency/{self.fault_seed}/{seed}/{sample}")
        self.turns, self._active, self._revealed = 0, True, set()
        return f"Find the value for {chain[0]}."

    def expert_turns(self) -> Optional[List[str]]:
        """The exact model turns that solve the current episode (None for an unsolvable one)."""
        if not hasattr(self, "chain") or not self.solvable:
            return None
        return [format_tool_call("lookup", {"key": k}) for k in self.chain] + [format_answer(self.value)]

    async def step(self, action_text: str) -> StepResult:
        if not self._active:
            raise ValueError("step: no episode in progress; call reset(seed) first")
        self.turns += 1
        turn = parse_turn(action_text, self.tool_specs)
        info = {"fault": Fault.NONE, "tool": turn.tool, "args": turn.arguments, "tool_error": turn.is_error,
                "turn": self.turns}
        if turn.kind == "answer":
            correct = self.solvable and turn.answer == self.value
            return self._end("done", 1.0 if correct else 0.0, info, correct=correct)
        if turn.kind == "error":
            return self._maybe_truncate(StepResult(turn.error, 0.0, False, info))
        kind, wait = draw_tool_call(self._fault_rng, self._latency_rng, self.faults, self.latency)
        if wait > 0:
            await asyncio.sleep(wait)
        info["latency_s"] = wait
        if kind is not None:
            fault, obs = FAULT_KINDS[kind]
            info.update(fault=fault, fault_kind=kind)
            if fault is Fault.UNRECOVERABLE:
                return self._end(obs, 0.0, info, correct=False)
            return self._maybe_truncate(StepResult(obs, 0.0, False, info))
        obs = self.table.get(turn.arguments["key"], NOT_FOUND)
        # progress for process-reward shaping: a chain key (or the value) revealed for the first time
        info["new_state"] = obs != NOT_FOUND and obs not in self._revealed
        self._revealed.add(obs)
        return self._maybe_truncate(StepResult(obs, 0.0, False, info))

    def _maybe_truncate(self, res: StepResult) -> StepResult:
        if self.turns >= self.max_turns:
            res.done = True
            res.info["truncated"] = True
            res.info["correct"] = False
            self._active = False
        return res

    def _end(self, obs: str, reward: float, info: dict, correct: bool) -> StepResult:
        self._active = False
        info.update(correct=correct, solvable=self.solvable)
        return StepResult(obs, reward, True, info)
