"""``long_lookup``: a long key chain with forks, where one wrong call early wastes the episode.

A task hides a chain of 12-16 keys ``k17 -> k03 -> ... -> v42``, as ``toy_lookup`` does, so a solution
is 12-16 ``lookup`` calls and the answer.  At 3-4 *forks* the lookup answers two keys, each after its
marker: the one to follow after ``go``, a trap after ``no`` (in random order).  The two are twins, one
key with two different prefix letters drawn per fork from ``a``-``h``: ``fork: go ck03 no fk03`` or
``fork: no fk03 go ck03``.  A fork's choice is the first letter of the call's key, and that letter
stands right after its marker, so the rule is one attention step: copy the letter that follows
``go`` (``fork:`` makes both markers the same tokens wherever they stand).  Letters that change from
fork to fork have to be copied by attention, the circuit that can learn the rule; an imitation start
copies either twin at even odds, so it samples both ways.  Why this form and not simpler ones (each
measured): docs/design.md 1.8.
The trap leads on to ``decoy_hops`` decoy keys that look like chain keys and end in ``dead end``.
Each task has a turn budget of its chain, the answer and ``slack`` (default 1) spare turns, so a
trap followed to its dead end (``decoy_hops`` + 1 wasted calls) cannot be recovered from: the rest
of the episode is wasted (turning back right after the trap's first key fits the one spare turn).
Only a key already shown (the task's first key, or one a lookup answered) is answered: a guessed key
is ``none`` even when it is on the chain, so guessing cannot skip the chain or leave a dead end; and
an answer counts only once the chain's last lookup has shown the value (``values()`` does not).
Two distractor tools cost a turn and never help: ``peek(key)`` says whether a key exists (decoys do
too), ``values()`` lists the value among two others.

Why it separates methods: the outcome reward is 1 only when every one of ~15 calls and every fork
choice was right, so a trajectory's reward says little about which call mattered; the env reports
``new_state`` (the first lookup of each chain key: progress) per turn for turn-level credit, and
counts the way taken at each fork (``env/fork_seen``, ``env/fork_go``, ``env/fork_no`` per step).

The SFT demonstrator does not know the fork rule: it plays ``blind_forks`` tasks (``demo_kwargs``),
where a fork's trap is harmless (it leads on to the same next key as the ``go`` key), and takes one of
the two branches at random.  Its demonstrations, all successful, show forks in the format and the
order the run's tasks have them, so the SFT start can read a fork and copy one of its keys, but they
carry no information about ``go``: the start follows ``go`` at about half the forks, and more SFT
cannot change that (the demonstrator's choice is independent of ``go``).  RL has to learn to read
``go``.  ``demo_forks`` sets the number of forks in the demonstrator's tasks (null: the run's range;
0: plain chains, which teach no fork at all).  The expert itself (``expert_turns`` on a run's task,
also IPA's resampling anchors) solves every task, forks included.

*Marks and checks* (the form ``configs/long_horizon_cpu.yaml`` runs, with no forks; docs/design.md 1.8
says why).
With ``marks`` a lookup shows some chain keys with a mark (``k47 ?``: the fraction ``marks`` of the
keys not shown by a fork), and with ``demo_checks`` the demonstrator has a habit: it checks a marked
key with a needless ``peek`` before looking it up, with that probability; ``demo_blind: false`` lets
it play the run's own forks (it follows ``go``), and ``fork_order: go_last`` always lists the ``go``
way second.  Its demonstrations all succeed (its tasks get the spare turns its checks need), but an
imitation of them checks every mark greedily (the habit's probability is above one half), and a run
task's one spare turn pays for one check: a task with two marks or more fails.  More SFT only fits
the habit; dropping the checks has to come from RL, and the turn that costs is one of ~15.  The turn
after each marked key is counted (``env/mark_seen``, ``env/mark_checked`` per step): the habit's
rate in every run's metrics.

Deterministic: the task depends on ``seed`` only (``reset(seed, sample=...)`` takes ``sample`` for
the rollout's API; nothing here is random per sample).  Training seeds count up from 0, held-out
ones from ``arl.data.tasks.EVAL_SEED_BASE``, SFT demonstrations from 2,000,000: disjoint seeds.
Malformed turns get an ``error: ...`` observation and use a turn; nothing raises on model text.
"""
from __future__ import annotations

import inspect
import random
from typing import List, Optional

from .base import Environment, Fault, StepResult
from .registry import register_env
from .toolcall import ToolSpec, describe_tools, format_answer, format_tool_call, parse_turn

LOOKUP = ToolSpec("lookup", {"key": "string"}, "the next key, a fork, or the value")
PEEK = ToolSpec("peek", {"key": "string"}, "yes if the key exists")
VALUES = ToolSpec("values", {}, "three values, one of them right")
NOT_FOUND, DEAD_END = "none", "dead end"
TWINS = "abcdefgh"  # a fork's two ways take two of these prefixes, drawn per fork
GO, NO, FORK = "go", "no", "fork:"
MARK = "?"  # after a key a lookup shows: "k47 ?" (marks: a cue the demonstrator checks needlessly)
FORK_ORDERS = ("random", "go_last")  # where a fork lists its go way: either place, or always second


def fork_ways(obs: str):
    """``(go_key, no_key, go_first)`` of a fork's observation ``"fork: go <key> no <key>"`` (either
    order), None for any other observation."""
    w = obs.split() if isinstance(obs, str) else []
    if len(w) != 5 or w[0] != FORK or sorted(w[1::2]) != [GO, NO]:
        return None
    go_first = w[1] == GO
    return (w[2], w[4], True) if go_first else (w[4], w[2], False)


@register_env("long_lookup")
class LongLookupEnv(Environment):
    tool_specs = (LOOKUP, PEEK, VALUES)  # described in the system prompt

    def __init__(self, min_hops: int = 12, max_hops: int = 16, min_forks: int = 3, max_forks: int = 4,
                 decoy_hops: int = 2, slack: int = 1, num_keys: int = 100, demo_forks: Optional[int] = None,
                 blind_forks: bool = False, fork_order: str = "random", demo_blind: bool = True,
                 marks: float = 0.0, demo_checks: float = 0.0, checks: float = 0.0,
                 max_turns: Optional[int] = None):
        if not 2 <= min_hops <= max_hops:
            raise ValueError(f"min_hops/max_hops: need 2 <= min_hops <= max_hops, got {min_hops}/{max_hops}")
        if not 0 <= min_forks <= max_forks < min_hops:
            raise ValueError(f"min_forks/max_forks: need 0 <= min_forks <= max_forks < min_hops ({min_hops}), "
                             f"got {min_forks}/{max_forks}")
        if demo_forks is not None and not 0 <= demo_forks < min_hops:
            raise ValueError(f"demo_forks: need 0 <= demo_forks < min_hops ({min_hops}) or null, got {demo_forks}")
        if decoy_hops < 0 or slack < 0:
            raise ValueError(f"decoy_hops/slack: need >= 0, got {decoy_hops}/{slack}")
        need_keys = max_hops + max(max_forks, demo_forks or 0) * decoy_hops
        if num_keys < need_keys:
            raise ValueError(f"num_keys: need >= {need_keys} (chain + decoys), got {num_keys}")
        self.min_hops, self.max_hops, self.min_forks, self.max_forks = min_hops, max_hops, min_forks, max_forks
        for name, flag in (("blind_forks", blind_forks), ("demo_blind", demo_blind)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}: need true or false, got {flag!r}")
        if fork_order not in FORK_ORDERS:
            raise ValueError(f"fork_order: need one of {', '.join(FORK_ORDERS)}, got {fork_order!r}")
        for name, p in (("marks", marks), ("demo_checks", demo_checks), ("checks", checks)):
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
                raise ValueError(f"{name}: need a probability in [0, 1), got {p!r}")
        self.decoy_hops, self.slack, self.num_keys, self.demo_forks = decoy_hops, slack, num_keys, demo_forks
        self.blind_forks, self.fork_order, self.demo_blind = blind_forks, fork_order, demo_blind
        self.marks, self.demo_checks, self.checks = float(marks), float(demo_checks), float(checks)
        longest = max_hops + 1 + slack  # the longest chain's budget: every lookup, the answer, the slack
        self.max_turns = max_turns if max_turns is not None else longest
        if self.max_turns < max_hops + 1:
            raise ValueError(f"max_turns (env.max_turns): need >= max_hops + 1 ({max_hops + 1}) to answer the longest "
                             f"chain, got {self.max_turns}")
        self._width = len(str(num_keys - 1))
        self.system_prompt = (
            "Find the value for a key. Tools:\n" + describe_tools(self.tool_specs) + "\n"
            f"Look keys up until you get a value, then answer it. At a fork follow the key after {GO}, "
            f"not the one after {NO}: that way is a {DEAD_END}.\n"
            + format_tool_call("lookup", {"key": self._key(17 % num_keys)}) + "\n"
            + format_answer(self._val(42 % num_keys)))
        self._active = False

    @classmethod
    def demo_kwargs(cls, kwargs: dict) -> dict:
        """The demonstrator's tasks: harmless forks taken at random (``blind_forks``, unless
        ``demo_blind`` is false), ``demo_forks`` of them (None: the run's range), and a needless
        ``peek`` of a marked key before its lookup with probability ``demo_checks``, with the spare
        turns for them (every turn the episode limit ``max_turns`` leaves beyond the longest chain)."""
        d, out = kwargs.get("demo_forks"), dict(kwargs)
        if out.get("demo_blind", True):
            out["blind_forks"] = True
        if d is not None:
            out.update(min_forks=d, max_forks=d)
        if out.get("demo_checks"):
            longest = out.get("max_hops", inspect.signature(cls).parameters["max_hops"].default) + 1
            out.update(checks=out["demo_checks"],
                       slack=max(out.get("slack", 1), (out.get("max_turns") or longest + 1) - longest))
        return out

    def _key(self, i: int) -> str:
        return f"k{i:0{self._width}d}"

    def _val(self, i: int) -> str:
        return f"v{i:0{self._width}d}"

    # -- episode ---------------------------------------------------------------------------------
    async def reset(self, seed: int, *, sample: int = 0) -> str:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"reset: seed must be an int, got {type(seed).__name__}")
        rng = random.Random(f"long_lookup/task/{seed}")
        hops = rng.randint(self.min_hops, self.max_hops)
        forks = rng.randint(self.min_forks, self.max_forks)
        keys = [self._key(i) for i in rng.sample(range(self.num_keys), hops + forks * self.decoy_hops)]
        chain, decoys = keys[:hops], keys[hops:]
        self.value = self._val(rng.randrange(self.num_keys))
        # forks on the lookups of chain keys 0..hops-2 (the last one answers the value); the two ways
        # of a fork are twins, one key with two prefix letters of TWINS, both drawn per fork
        self.forks = sorted(rng.sample(range(hops - 1), forks))
        self._traps = {}
        for i in self.forks:
            go, no = rng.sample(TWINS, 2)
            self._traps[i] = no + chain[i + 1]
            chain[i + 1] = go + chain[i + 1]
        self.table = {k: nxt for k, nxt in zip(chain, chain[1:] + [self.value])}
        for n, i in enumerate(self.forks):
            right, trap = chain[i + 1], self._traps[i]
            go_first = rng.random() < 0.5 and self.fork_order == "random"  # one draw per fork either way
            self.table[chain[i]] = (f"{FORK} {GO} {right} {NO} {trap}" if go_first else
                                    f"{FORK} {NO} {trap} {GO} {right}")
            if not self.blind_forks:
                path = [trap] + decoys[n * self.decoy_hops:(n + 1) * self.decoy_hops]
                self.table.update(zip(path, path[1:] + [DEAD_END]))
        # marked keys: the lookup that shows chain key j (not a fork's) adds " ?"; a seed-only coin, so
        # the tasks without marks are the ones above
        mark = random.Random(f"long_lookup/mark/{seed}")
        self.marked = [j for j in range(1, hops) if j - 1 not in self.forks and self.marks
                       and mark.random() < self.marks]
        for j in self.marked:
            self.table[chain[j - 1]] = f"{chain[j]} {MARK}"
        if self.blind_forks:  # a trap answers what its go key answers (a next fork included)
            self.table.update({trap: self.table[chain[i + 1]] for i, trap in self._traps.items()})
        others = rng.sample([i for i in range(self.num_keys) if self._val(i) != self.value], 2)
        vals = [self.value] + [self._val(i) for i in others]
        rng.shuffle(vals)
        self._values_obs = " ".join(vals)
        self.chain, self.seed, self.budget = chain, seed, hops + 1 + self.slack
        self.turns, self._active, self._looked_up, self._revealed = 0, True, set(), {chain[0]}
        self._fork = None  # the (go, no, go_first) ways the last observation showed, if a fork
        self._mark = False  # the last observation showed a marked key
        return f"Find the value for {chain[0]}."

    def expert_turns(self) -> Optional[List[str]]:
        """The exact model turns that solve the current episode: every chain key, then the value.  On
        ``blind_forks`` tasks the expert is the blind demonstrator: at each fork it follows the go key
        or the (harmless) trap at random, a choice drawn from the seed alone.  With ``checks`` it
        first ``peek``s a marked key with that probability (a needless check that costs a turn), as
        many times as the task's spare turns allow (coins from the seed alone)."""
        if not hasattr(self, "chain"):
            return None
        keys = list(self.chain)
        if self.blind_forks:
            coin = random.Random(f"long_lookup/demo/{self.seed}")
            for i in self.forks:
                if coin.random() < 0.5:
                    keys[i + 1] = self._traps[i]
        turns, spare, marked = [], self.budget - len(keys) - 1, set(self.marked)
        coin = random.Random(f"long_lookup/check/{self.seed}")
        for j, k in enumerate(keys):
            if j in marked and self.checks and spare > 0 and coin.random() < self.checks:
                turns.append(format_tool_call("peek", {"key": k}))
                spare -= 1
            turns.append(format_tool_call("lookup", {"key": k}))
        return turns + [format_answer(self.value)]

    async def step(self, action_text: str) -> StepResult:
        if not self._active:
            raise ValueError("step: no episode in progress; call reset(seed) first")
        self.turns += 1
        turn = parse_turn(action_text, self.tool_specs)
        info = {"fault": Fault.NONE, "tool": turn.tool, "args": turn.arguments, "tool_error": turn.is_error,
                "turn": self.turns, "new_state": False}
        ways, self._fork = self._fork, None
        if ways:  # the turn right after a fork: which way it took (logged as env/fork_*)
            took = turn.arguments.get("key") if turn.kind == "tool" and turn.tool == "lookup" else None
            info["counts"] = {"fork_seen": 1, "fork_go": took == ways[0], "fork_no": took == ways[1]}
        marked, self._mark = self._mark, False
        if marked:  # the turn right after a marked key: checked it first, or not (env/mark_*)
            info["counts"] = {"mark_seen": 1, "mark_checked": turn.kind == "tool" and turn.tool == "peek"}
        if turn.kind == "answer":
            correct = turn.answer == self.value and self.value in self._revealed
            return self._end("done", 1.0 if correct else 0.0, info, correct=correct)
        if turn.kind == "error":
            return self._budget(StepResult(turn.error, 0.0, False, info))
        key = turn.arguments.get("key")
        if turn.tool == "peek":
            obs = "yes" if key in self.table else "no"
        elif turn.tool == "values":
            obs = self._values_obs
        else:
            # only a key shown so far answers: guessing keys cannot skip the chain (or a dead end)
            shown = key in self._revealed
            obs = self.table.get(key, NOT_FOUND) if shown else NOT_FOUND
            self._revealed.update(w for w in obs.split() if w in self.table or w == self.value)
            # progress for turn credit: a chain key looked up for the first time reveals the next one
            info["new_state"] = shown and key in self.chain and key not in self._looked_up
            self._fork = fork_ways(obs)
            self._mark = obs.endswith(f" {MARK}")
            info["fork"] = self._fork is not None
            info["dead_end"] = obs == DEAD_END
            if shown:
                self._looked_up.add(key)
        return self._budget(StepResult(obs, 0.0, False, info))

    def _budget(self, res: StepResult) -> StepResult:
        """Ends the episode (reward 0) once the task's budget or the run's turn limit is used up."""
        if self.turns >= min(self.budget, self.max_turns):
            res.done = True
            res.info.update(truncated=True, correct=False)
            self._active = False
        return res

    def _end(self, obs: str, reward: float, info: dict, correct: bool) -> StepResult:
        self._active = False
        info.update(correct=correct)
        return StepResult(obs, reward, True, info)
