"""BFCL's verdicts on arl's parsed tool calls: every verdict is a BFCL function's.

What arl does before handing a turn to BFCL is what BFCL's own handlers for function-calling models
do with an API's ``tool_calls``: a turn's calls become BFCL's decoded AST,
``[{name: {argument: value}}, ...]`` (a call whose JSON does not parse fails the decode, as
``json.loads`` fails in BFCL's handlers), and for the multi-turn executor each call becomes the
string ``name(k=repr(v),...)`` (``bfcl_eval.model_handler.utils.convert_to_function_call``, which
cannot be imported without tree-sitter; tests/test_bfcl_scoring.py checks this copy against its
source).  Then:

* AST categories: BFCL's runner's order of checks (``_evaluate_single_ast_entry``): a failed decode,
  then ``is_function_calling_format_output``, then ``ast_checker``.
* irrelevance categories: right when the turn holds no call (``_evaluate_single_relevance_entry``:
  a failed decode or ``is_empty_output`` means no call).
* multi-turn: ``multi_turn_checker`` on the calls of every user turn, replayed on fresh instances.

BFCL's executor ``eval``s the call strings on instances it keeps in its module's globals, keyed by
a model name and the task id: arl gives every episode and every check a name of its own and drops
its instances after (``Executor.close``).  Only the task's own function names are ``eval``ed; a call
to any other name (``open``, ``__import__``, ...) runs nothing and reaches the checker as a call to
an undefined function, which fails exactly like BFCL's own execution of an unknown name would.
"""
from __future__ import annotations

import re
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .loader import bfcl

UNKNOWN_CALL = "arl_unknown_function()"  # evaluates to a NameError in BFCL's executor: runs nothing
_NAME = re.compile(r"[A-Za-z_]\w*")


def decode(calls: Sequence[Any]) -> Tuple[Optional[List[Dict[str, dict]]], Optional[str]]:
    """``(BFCL's decoded AST, None)`` of a turn's parsed calls (``ParsedCall``s), or ``(None, why)``
    when one of them is malformed (BFCL's decoder would raise on it)."""
    for c in calls:
        if c.error is not None:
            return None, c.error
    return [{c.name: dict(c.arguments)} for c in calls], None


def verdict(valid: bool, error_type: str = "", error: Any = None) -> Dict[str, Any]:
    return {"valid": bool(valid), "error_type": error_type, "error": error}


def score_ast(entry: Dict[str, Any], decoded, decode_error: Optional[str], model_name: str = "arl") -> Dict[str, Any]:
    """BFCL's AST verdict on one single-turn row."""
    b = bfcl()
    if decoded is None:
        return verdict(False, "ast_decoder:decoder_failed", [f"Invalid syntax. Failed to decode AST. {decode_error}"])
    if not b.is_function_calling_format_output(decoded):
        return verdict(False, "ast_decoder:decoder_wrong_output_format", ["Did not output in the specified format."])
    out = b.ast_checker(entry["function"], decoded, entry["ground_truth"], b.Language.PYTHON, entry["category"],
                        model_name)
    return verdict(out["valid"], out.get("error_type", ""), out.get("error"))


def ast_credit(entry: Dict[str, Any], decoded, model_name: str = "arl") -> float:
    """The share of a single-turn row's ground truth that a decoded turn gets right, in [0, 1], judged
    by BFCL's own ``simple_function_checker`` one argument at a time (ToolRL's fine-grained reward,
    arXiv 2504.13958, with BFCL's value rules).  Each expected call is matched to the first unused
    model call of its name; it scores (1 + arguments right) / (1 + its arguments + arguments it does
    not name), and the row is the sum over max(expected calls, model calls).  An undecodable turn,
    or no call, scores 0; only a turn BFCL calls valid can reach 1."""
    if not decoded:
        return 0.0
    b, used, total = bfcl(), set(), 0.0
    for answer in entry["ground_truth"]:
        name, params = next(iter(answer.items()))
        desc = b.find_description(entry["function"], name)
        j = next((i for i, call in enumerate(decoded) if i not in used and name in call), None)
        if j is None or desc is None:
            continue
        used.add(j)
        args, props = decoded[j][name], desc["parameters"].get("properties", {})
        required = desc["parameters"].get("required", [])
        right = 0
        for p, answers in params.items():
            one = {"name": desc["name"], "parameters": {"type": "dict", "properties": {p: props[p]} if p in props else {},
                                                          "required": [p] if p in required else []}}
            got = {name: {p: args[p]} if p in args else {}}
            right += bool(b.simple_function_checker(one, got, {name: {p: answers}}, b.Language.PYTHON, model_name)["valid"])
        extra = sum(1 for p in args if p not in params)
        total += (1 + right) / (1 + len(params) + extra)
    return total / max(len(entry["ground_truth"]), len(decoded))


def score_irrelevance(entry: Dict[str, Any], decoded, decode_error: Optional[str]) -> Dict[str, Any]:
    """BFCL's irrelevance verdict: right when the turn holds no decodable call."""
    contains_call = decoded is not None and not bfcl().is_empty_output(decoded)
    if contains_call:
        return verdict(False, "irrelevance_error:decoder_success",
                       ["Valid syntax. Successfully decode AST when it should not."])
    return verdict(True)


def call_string(name: str, arguments: Dict[str, Any]) -> str:
    """One call as BFCL's executor reads it (BFCL's ``convert_to_function_call``)."""
    return f"{name}({','.join([f'{k}={repr(v)}' for k, v in arguments.items()])})"


def function_names(entry: Dict[str, Any]) -> set:
    return {d["name"] for d in entry.get("function", [])}


def safe_call_string(name: Optional[str], arguments: Dict[str, Any], known: set) -> str:
    if name in known and _NAME.fullmatch(name or ""):
        return call_string(name, arguments)
    return UNKNOWN_CALL


def _long_context(entry: Dict[str, Any]) -> bool:
    category = entry["id"].rsplit("_", 1)[0]  # what BFCL's checker derives it from
    return "long_context" in category or "composite" in category


class Executor:
    """BFCL's executable classes of one task, instantiated from its ``initial_config`` under a
    name of this executor's own; ``run`` executes call strings through BFCL's executor."""

    def __init__(self, entry: Dict[str, Any]):
        self.entry = entry
        self.model_name = f"arl_live_{uuid.uuid4().hex}"

    def run(self, call_strings: List[str]) -> List[str]:
        results, _ = bfcl().execute_multi_turn_func_call(
            func_call_list=call_strings, initial_config=self.entry["initial_config"],
            involved_classes=self.entry["involved_classes"], model_name=self.model_name,
            test_entry_id=self.entry["id"], long_context=_long_context(self.entry), is_evaL_run=False)
        return [str(r) for r in results]

    def close(self) -> None:
        drop_instances(self.model_name)


def drop_instances(model_name: str) -> None:
    """Forget the instances BFCL's executor keeps for ``model_name`` (and its ``_eval`` and
    ``_ground_truth`` replays): they would otherwise live as long as the process."""
    g = bfcl().executor_globals
    prefix = re.sub(r"[-./:]", "_", model_name)
    for k in [k for k in g if k.startswith(prefix) and k.endswith("_instance")]:
        del g[k]


def score_multi_turn(entry: Dict[str, Any], turns: List[List[List[str]]]) -> Dict[str, Any]:
    """BFCL's multi-turn verdict on ``turns`` (per user turn, per model step, its call strings), as
    BFCL's runner gives it (``_evaluate_single_multi_turn_entry``): a trajectory with another number
    of user turns than the ground truth was force-terminated; else ``multi_turn_checker``."""
    truth = entry["ground_truth"]
    if len(turns) != len(truth):
        return verdict(False, "multi_turn:force_terminated",
                       [f"model turns ({len(turns)}) != ground-truth turns ({len(truth)})"])
    b = bfcl()
    decoded = [[step for step in turn if not b.is_empty_execute_response(step)] for turn in turns]
    name = f"arl_check_{uuid.uuid4().hex}"
    try:
        out = b.multi_turn_checker(decoded, truth, entry, entry["category"], name)
    finally:
        drop_instances(name)
    return verdict(out["valid"], out.get("error_type", ""), out.get("error_message"))


def turns_passed(entry: Dict[str, Any], turns: List[List[List[str]]]) -> int:
    """How many leading user turns pass BFCL's multi-turn checker (its verdict on the first k turns
    of the trajectory and of the ground truth): the per-turn shaping signal."""
    k = 0
    while k < min(len(turns), len(entry["ground_truth"])):
        sub = dict(entry, ground_truth=entry["ground_truth"][:k + 1])
        if not score_multi_turn(sub, turns[:k + 1])["valid"]:
            break
        k += 1
    return k
