"""``bfcl``: the Berkeley Function Calling Leaderboard's tasks as arl episodes, scored by BFCL.

    env:
      name: bfcl
      kwargs:
        categories: [simple_python, live_simple, irrelevance, multi_turn_base]
        turn_credit: 0.0      # multi-turn shaping, in [0, 1): see below
      tool_parser: hermes     # how the model writes calls (arl's hermes or any vLLM parser name)
      max_turns: 24           # model turns per episode (multi-turn tasks need several per user turn)

Tasks: BFCL's rows of the categories, in BFCL's order; ``reset(seed)`` plays row ``seed mod N``,
``reset(seed, task=row)`` a given row (``load_entries``).  With ``split: FILE`` (arl/env/bfcl/split.py,
``examples/bfcl/split.json``) the categories are the file's instead: seed s plays train row s mod N,
and a held-out seed ``EVAL_SEED_BASE + i`` (below the SFT demonstrations' 2,000,000) plays the
file's held-out row i, round robin over its held-out categories.  ``expert_turns`` writes BFCL's
ground truth (the first allowed value of every argument, an optional one left out) in the parser's
call format, and a short refusal on an irrelevance row: the SFT demonstrations.  Each row's function docs are the env's
``tools`` (BFCL's types mapped to JSON schema by ``loader.json_schema``), rendered by the model's
chat template like any arl tool; the row's first user turn is the prompt.

* single-turn AST categories: one model turn; its calls are decoded and the reward is BFCL's
  ``ast_checker`` verdict, 1.0 or 0.0 (``reward_components: {"bfcl": ...}``).
* irrelevance categories: one model turn; 1.0 when it calls nothing (BFCL's relevance rule).
* multi-turn categories: BFCL's executable classes of the row (GorillaFileSystem, TwitterAPI, ...)
  are instantiated from its ``initial_config``; every call the model makes is executed by BFCL's
  executor and its result is the tool message; a turn without a call ends the user's turn and the
  next user turn comes in the ``user`` role (``observation_role`` switches for that one message);
  after the last user turn the reward is BFCL's ``multi_turn_checker`` verdict on every turn's
  calls (state and execution responses).  A turn with a malformed call runs none of its calls
  (each answers an error; BFCL's decoder would drop the whole step) and the episode goes on.
  ``turn_credit`` (shaping, default 0): a failed episode gets ``turn_credit * k / K``, k the
  leading user turns BFCL's checker passes (``scoring.turns_passed``), K the turns; a success gets
  1.0, so every success still outranks every failure (named part ``turn_credit``).
* ``malformed_call_penalty`` (shaping, training rows only, default false): on an irrelevance row, a
  turn that tries a call and botches it (a ``<tool_call>`` block that does not decode) earns 0, not
  BFCL's 1.0 (its rule counts an undecodable call as none).  Without it RL learns to write broken
  calls, right on every irrelevance row, and carries them to the rows that need a call.  Named part
  ``malformed_call`` (-1.0 beside ``bfcl``'s 1.0); held-out rows and given tasks keep BFCL's rule.
* ``ast_credit`` (shaping, training rows only, in [0, 1), default 0): a failed AST turn earns
  ``ast_credit`` times the share of the ground truth it gets right, BFCL's checker run one argument
  at a time (``scoring.ast_credit``); a valid turn earns 1.0.  Without it a group whose four answers
  all miss (most AST rows, early) has no signal, and RL learns mostly from the irrelevance rows.
  Named part ``ast_credit``.

A checker that raises on a row is that episode's recoverable fault (``reward_exception``; the
rollout retries or filters it, ``python -m arl.eval --bench bfcl`` marks and counts the row).
The verdict of the last finished episode is ``env.verdict`` (valid, error_type, error).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from ...config import EVAL_SEED_BASE
from ..base import Environment, Fault, StepResult
from ..registry import register_env
from ..vllm_parsers import make_parser
from . import scoring, split as bsplit
from .loader import bfcl, check_categories, kind, load_entries, tool_schema

DEMO_SEED_BASE = 2_000_000  # SFT demonstrations (arl.rollout.expert): train rows again
REFUSAL = "None of the available functions can answer this request."

_ROLES = ("system", "user", "assistant")


def _turn_messages(turn: List[Mapping]) -> List[Dict[str, str]]:
    return [{"role": m["role"], "content": m["content"]} for m in turn if m.get("role") in _ROLES]


def _first_allowed(args: Mapping[str, list]) -> Dict[str, Any]:
    """BFCL's possible answers (every argument: a list of allowed values, ``""`` meaning "may be left
    out"; a dict value's entries likewise) -> the first allowed value of each, optional ones left out."""
    return {k: _first_allowed(v[0]) if isinstance(v[0], dict) else v[0] for k, v in args.items() if v and v[0] != ""}


@register_env("bfcl")
class BfclEnv(Environment):
    stop = ()  # a turn ends at the end of sequence: it may hold several calls

    def __init__(self, categories: Union[str, Sequence[str]] = ("simple_python",), parser: str = "hermes",
                 tokenizer: Any = None, max_turns: int = 24, turn_credit: float = 0.0, limit: Optional[int] = None,
                 system_prompt: Optional[str] = None, split: Optional[str] = None,
                 malformed_call_penalty: bool = False, ast_credit: float = 0.0):
        bfcl()  # a missing bfcl-eval: one line, here
        self.split = split
        if split is not None:
            doc = bsplit.load_split(split)
            categories = doc.get("train_categories") or ["simple_python"]
        self.categories = check_categories(categories)
        if not 0.0 <= float(turn_credit) < 1.0:
            raise ValueError(f"env.kwargs.turn_credit: must be in [0, 1) so that a success outranks every "
                             f"failure, got {turn_credit}")
        if not 0.0 <= float(ast_credit) < 1.0:
            raise ValueError(f"env.kwargs.ast_credit: must be in [0, 1) so that a success outranks every "
                             f"failure, got {ast_credit}")
        self.ast_credit = float(ast_credit)
        if limit is not None and limit < 1:
            raise ValueError(f"env.kwargs.limit: must be >= 1, got {limit}")
        self.turn_credit, self.limit, self.max_turns = float(turn_credit), limit, int(max_turns)
        self.malformed_call_penalty, self._training_row = bool(malformed_call_penalty), False
        try:
            self.parser = make_parser(parser, tokenizer)
        except ValueError as e:
            raise ValueError(f"env.{'' if str(e).startswith('tool_parser') else 'tool_'}{e}") from None
        self.keep_tokens = self.parser.keep_tokens() if hasattr(self.parser, "keep_tokens") else ()
        self.system_prompt = system_prompt or ""
        self._rows: Optional[List[Dict[str, Any]]] = None
        self._executor: Optional[scoring.Executor] = None
        self.verdict: Optional[Dict[str, Any]] = None
        self._active = False

    @property
    def rows(self) -> List[Dict[str, Any]]:
        if self._rows is None:  # read on first use, shared by the process's envs (reset copies its row)
            self._rows = (bsplit.train_rows(self.split)[:self.limit] if self.split
                          else load_entries(self.categories, self.limit, copy_rows=False))
        return self._rows

    def _row(self, seed: int) -> Mapping:
        if self.split and EVAL_SEED_BASE <= seed < DEMO_SEED_BASE:
            held = bsplit.held_out_rows(self.split, interleave=True)
            return held[(seed - EVAL_SEED_BASE) % len(held)]
        return self.rows[seed % len(self.rows)]

    async def reset(self, seed: int, task: Optional[Mapping] = None) -> List[Dict[str, str]]:
        await self.close()
        if task is not None:
            if not (isinstance(task, Mapping) and "question" in task and "category" in task):
                raise ValueError("bfcl: a task must be one of BFCL's rows (arl.env.bfcl.load_entries)")
            entry = copy.deepcopy(dict(task))
        else:
            entry = copy.deepcopy(dict(self._row(seed)))
        self._training_row = task is None and not (self.split and EVAL_SEED_BASE <= seed < DEMO_SEED_BASE)
        self.entry, self.kind = entry, kind(entry["category"])
        self.tools = [tool_schema(d) for d in entry["function"]] or None
        self.parser.tools = self.tools or []
        self.known = scoring.function_names(entry)
        self.turn, self.steps, self.verdict, self._active = 0, 0, None, True
        self.observation_role = "tool"
        if self.kind == "multi_turn":
            self.turns: List[List[List[str]]] = [[]]
            self._executor = scoring.Executor(entry)
        return _turn_messages(entry["question"][0])

    @classmethod
    def demo_kwargs(cls, kwargs: dict) -> dict:
        """The demonstrator's env judges by BFCL's verdict alone: SFT keeps a demonstration only when
        its reward is positive, and partial credit would keep the few ground truths BFCL rejects."""
        return {k: v for k, v in kwargs.items() if k not in ("ast_credit", "turn_credit")}

    def expert_turns(self) -> Optional[List[str]]:
        """BFCL's ground truth as the model's turn (single-turn rows; None for multi-turn ones)."""
        if self.kind == "irrelevance":
            return [REFUSAL]
        if self.kind != "ast":
            return None
        calls = [{"name": name, "arguments": _first_allowed(args)}
                 for call in self.entry["ground_truth"] for name, args in call.items()]
        return [self.parser.format_calls("", calls)]

    async def step(self, action_text: str) -> StepResult:
        if not self._active:
            raise ValueError("step: no episode in progress; call reset(seed) first")
        self.steps += 1
        parsed = self.parser.parse(action_text)
        if self.kind != "multi_turn":
            decoded, why = scoring.decode(parsed.calls)
            info = self._calls_info(parsed.calls)
            if self.kind == "ast":
                credit = self.ast_credit > 0 and self._training_row
                return self._finish(lambda: self._score_ast(decoded, why, credit), info)
            botched = self.malformed_call_penalty and self._training_row and decoded is None
            return self._finish(lambda: scoring.score_irrelevance(self.entry, decoded, why), info, botched)
        if parsed.calls:
            return self._run_calls(parsed.calls)
        return self._next_user_turn()

    def _calls_info(self, calls) -> Dict[str, Any]:
        first = calls[0] if calls else None
        return {"fault": Fault.NONE, "tool": first.name if first else None, "args": first.arguments if first else None,
                "tool_error": any(c.error is not None for c in calls), "turn": self.steps,
                "calls": [{"name": c.name, "arguments": c.arguments, "error": c.error} for c in calls]}

    def _run_calls(self, calls) -> StepResult:
        self.observation_role = "tool"
        info = self._calls_info(calls)
        decoded, why = scoring.decode(calls)
        if decoded is None:  # BFCL's decoder drops the step: nothing of it runs or is scored
            obs = [c.error or "error: not run: another call in this turn is malformed" for c in calls]
            return StepResult(obs, 0.0, False, info)
        strings = [scoring.safe_call_string(c.name, c.arguments, self.known) for c in calls]
        results = self._executor.run(strings)
        obs = [r if s != scoring.UNKNOWN_CALL else
               f"error: unknown function {c.name!r}; functions: {', '.join(sorted(self.known))}"
               for r, s, c in zip(results, strings, calls)]
        self.turns[-1].append(strings)
        for d, o in zip(info["calls"], obs):
            d["error"] = o if o.startswith(("error:", "Error during execution")) else None
        info["tool_error"] = any(d["error"] for d in info["calls"])
        return StepResult(obs, 0.0, False, info)

    def _next_user_turn(self) -> StepResult:
        info = {"fault": Fault.NONE, "tool": None, "tool_error": False, "turn": self.steps}
        questions = self.entry["question"]
        if self.turn + 1 < len(questions):
            self.turn += 1
            self.turns.append([])
            self.observation_role = "user"  # the user's next request, not a tool's answer
            text = "\n\n".join(m["content"] for m in _turn_messages(questions[self.turn]))
            return StepResult(text, 0.0, False, dict(info, user_turn=self.turn))
        return self._finish(self._score_multi_turn, info)

    def _score_ast(self, decoded, why: Optional[str], credit: bool) -> Dict[str, Any]:
        v = scoring.score_ast(self.entry, decoded, why)
        if credit:
            v["ast_credit"] = 0.0 if v["valid"] else scoring.ast_credit(self.entry, decoded)
        return v

    def _score_multi_turn(self) -> Dict[str, Any]:
        v = scoring.score_multi_turn(self.entry, self.turns)
        if self.turn_credit > 0 and not v["valid"]:
            v["turns_passed"] = scoring.turns_passed(self.entry, self.turns)
        return v

    def _finish(self, judge, info: Dict[str, Any], botched: bool = False) -> StepResult:
        self._active = False
        try:
            v = judge()
        except Exception as e:  # BFCL's checker failed on this row: mark it, never train on it
            why = f"bfcl checker: {type(e).__name__}: {e}"
            self.verdict = scoring.verdict(False, "arl:checker_exception", why)
            info.update(fault=Fault.RECOVERABLE, fault_reason=why, reward_exception=f"{type(e).__name__}: {e}")
            return StepResult(why, 0.0, True, info)
        self.verdict = v
        comps = {"bfcl": 1.0 if v["valid"] else 0.0}
        if self.turn_credit > 0 and self.kind == "multi_turn":
            k, n = v.get("turns_passed", 0), len(self.entry["ground_truth"])
            comps["turn_credit"] = self.turn_credit * k / n if not v["valid"] and n else 0.0
        if "ast_credit" in v:
            comps["ast_credit"] = self.ast_credit * v["ast_credit"]
        if self.malformed_call_penalty and self.kind == "irrelevance":
            comps["malformed_call"] = -1.0 if botched and v["valid"] else 0.0
        info["reward_components"] = comps
        return StepResult("", sum(comps.values()), True, info)

    async def close(self) -> None:
        if self._executor is not None:
            self._executor.close()
            self._executor = None
