"""The independent reference of tests/test_bfcl_env.py and tests/test_bfcl_eval.py: BFCL's own
checker functions, called directly on calls decoded here from hand-written generations
(tests/fixtures/bfcl_generations.json)."""
import ast
import json
import re
import uuid
from pathlib import Path

from arl.env.bfcl import bfcl, scoring

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "bfcl_generations.json").read_text())
CATEGORIES = ["simple_python", "live_simple", "irrelevance", "live_irrelevance", "multi_turn_base"]
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def ref_decode(text):
    """BFCL's decoded AST of a hermes turn, or None when a call does not decode."""
    out = []
    for body in _CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        out.append({obj["name"]: obj["arguments"]})
    return out


def ref_single(entry, text):
    b = bfcl()
    decoded = ref_decode(text)
    if entry["category"].endswith("irrelevance"):
        return decoded is None or b.is_empty_output(decoded)
    if decoded is None or not b.is_function_calling_format_output(decoded):
        return False
    return b.ast_checker(entry["function"], decoded, entry["ground_truth"], b.Language.PYTHON, entry["category"],
                         "ref")["valid"]


def bfcl_convert_to_function_call():
    """BFCL's own ``convert_to_function_call``, read from its source (its module needs tree-sitter)."""
    import bfcl_eval

    src = (Path(bfcl_eval.__file__).parent / "model_handler" / "utils.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "convert_to_function_call")
    space = {"json": json}
    exec(compile(ast.Module([fn], []), "bfcl_eval/model_handler/utils.py", "exec"), space)
    return space["convert_to_function_call"]


def ref_multi_turn(entry, turns):
    """BFCL's multi-turn checker on the fixture's turns: per user turn, the steps whose calls decode,
    as BFCL's own call strings (names outside the task's functions: an undefined name)."""
    convert, known = bfcl_convert_to_function_call(), {d["name"] for d in entry["function"]}
    decoded = []
    for turn in turns:
        steps = []
        for text in turn:
            calls = ref_decode(text)
            if calls:
                calls = [c if next(iter(c)) in known else {"ref_undefined_name": {}} for c in calls]
                steps.append(convert(calls))
        decoded.append(steps)
    name = f"ref_{uuid.uuid4().hex}"
    try:
        return bfcl().multi_turn_checker(decoded, entry["ground_truth"], entry, entry["category"], name)["valid"]
    finally:
        scoring.drop_instances(name)
