"""BFCL (the Berkeley Function Calling Leaderboard, PyPI ``bfcl-eval==2026.3.23``): its data and its
checkers, imported once, without its model table.

Why a stand-in module: ``bfcl_eval.eval_checker.ast_eval.ast_checker`` imports
``bfcl_eval.constants.model_config``, the leaderboard's table of hosted models, which imports every
vendor SDK (anthropic, cohere, mistralai, google-genai, ...) that ``install.sh --bfcl`` leaves out.
The checker reads the table for one thing only: whether a model's API renamed ``.`` to ``_`` in
function names (``convert_func_name``).  arl renders BFCL's function names as BFCL writes them,
dots kept, so the answer is "no" for every model: the stand-in below is a table whose every entry
says ``underscore_to_dot = False``; it is placed in ``sys.modules`` before BFCL is imported.
Nothing of BFCL's checking is re-implemented: the verdicts are its own functions'.

BFCL writes generated results and lock files under ``BFCL_PROJECT_ROOT`` (default: the
site-packages directory); arl points it at ``~/.cache/arl/bfcl`` unless it is set.
"""
from __future__ import annotations

import copy
import functools
import importlib
import os
import sys
import types
from pathlib import Path
from typing import Any, Dict, List

INSTALL_HINT = "bfcl: bfcl-eval is not installed: bash install.sh --bfcl"
MODEL_TABLE = "bfcl_eval.constants.model_config"

# The categories arl runs (BFCL's own lists, less the ones it cannot run yet): single-turn Python
# ones scored by the AST checker, the irrelevance ones (the right answer calls nothing), the
# multi-turn ones scored by the multi-turn checker.  Java/JavaScript, live_relevance and
# multi_turn_miss_func are left out (docs/bfcl.md says why).
AST = ("simple_python", "multiple", "parallel", "parallel_multiple",
       "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
IRRELEVANCE = ("irrelevance", "live_irrelevance")
MULTI_TURN = ("multi_turn_base", "multi_turn_miss_param", "multi_turn_long_context")
CATEGORIES = AST + IRRELEVANCE + MULTI_TURN


class _NoRename:
    underscore_to_dot = False  # arl keeps BFCL's function names as written (see the module docstring)


class _ModelTable(dict):
    def __missing__(self, name: str) -> _NoRename:
        return _NoRename()


def _stand_in_model_table() -> None:
    if MODEL_TABLE not in sys.modules:
        mod = types.ModuleType(MODEL_TABLE, "arl's stand-in for BFCL's model table (arl/env/bfcl/loader.py)")
        mod.MODEL_CONFIG_MAPPING = _ModelTable()
        sys.modules[MODEL_TABLE] = mod


@functools.lru_cache(maxsize=1)
def bfcl() -> types.SimpleNamespace:
    """BFCL's checker functions, loaders and tables; ``ValueError(INSTALL_HINT)`` when missing."""
    if importlib.util.find_spec("bfcl_eval") is None:
        raise ValueError(INSTALL_HINT)
    os.environ.setdefault("BFCL_PROJECT_ROOT", str(Path.home() / ".cache" / "arl" / "bfcl"))
    _stand_in_model_table()
    from bfcl_eval.constants import enums, type_mappings
    from bfcl_eval.eval_checker.ast_eval import ast_checker
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils
    from bfcl_eval.eval_checker import eval_runner_helper
    from bfcl_eval import utils
    return types.SimpleNamespace(
        ast_checker=ast_checker.ast_checker, Language=enums.Language,
        simple_function_checker=ast_checker.simple_function_checker, find_description=ast_checker.find_description,
        is_function_calling_format_output=utils.is_function_calling_format_output,
        is_empty_output=utils.is_empty_output, load_dataset_entry=utils.load_dataset_entry,
        load_ground_truth_entry=utils.load_ground_truth_entry,
        multi_turn_checker=multi_turn_checker.multi_turn_checker,
        multi_turn_irrelevance_checker=multi_turn_checker.multi_turn_irrelevance_checker,
        execute_multi_turn_func_call=multi_turn_utils.execute_multi_turn_func_call,
        executor_globals=vars(multi_turn_utils), is_empty_execute_response=multi_turn_utils.is_empty_execute_response,
        calculate_weighted_accuracy=eval_runner_helper.calculate_weighted_accuracy,
        calculate_unweighted_accuracy=eval_runner_helper.calculate_unweighted_accuracy,
        GORILLA_TO_OPENAPI=type_mappings.GORILLA_TO_OPENAPI)


def check_categories(categories: Any) -> List[str]:
    """``categories`` (a list, or a comma-separated str) checked against ``CATEGORIES``; one line otherwise."""
    if isinstance(categories, str):
        categories = [c.strip() for c in categories.split(",") if c.strip()]
    if not isinstance(categories, (list, tuple)) or not categories:
        raise ValueError(f"bfcl: categories must be a non-empty list; known: {', '.join(CATEGORIES)}")
    for c in categories:
        if c not in CATEGORIES:
            raise ValueError(f"bfcl: unknown category {c!r}; known: {', '.join(CATEGORIES)}")
    return list(dict.fromkeys(categories))


def kind(category: str) -> str:
    return "ast" if category in AST else "irrelevance" if category in IRRELEVANCE else "multi_turn"


@functools.lru_cache(maxsize=None)
def _entries(category: str) -> tuple:
    b = bfcl()
    rows = b.load_dataset_entry(category)
    if kind(category) != "irrelevance":  # irrelevance rows have no ground truth: calling nothing is right
        truth = {r["id"]: r["ground_truth"] for r in b.load_ground_truth_entry(category)}
        for r in rows:
            r["ground_truth"] = truth[r["id"]]
    for r in rows:
        r["category"] = category
    return tuple(rows)


def load_entries(categories: List[str], limit: int | None = None, copy_rows: bool = True) -> List[Dict[str, Any]]:
    """BFCL's rows of ``categories`` in its order (``limit``: the first N of each), each with its
    ``ground_truth`` and ``category``, prepared by BFCL's own loader (its function docs, with the
    language hint it adds to every description).  ``copy_rows=False``: the process's shared rows,
    read-only (a pool of environments holds them once)."""
    out = []
    for c in check_categories(categories):
        rows = _entries(c)
        rows = rows if limit is None else rows[:limit]
        out += [copy.deepcopy(r) for r in rows] if copy_rows else list(rows)
    return out


_KEEP = ("description", "enum", "default", "format")


def json_schema(param: Dict[str, Any]) -> Dict[str, Any]:
    """One BFCL parameter as JSON schema.  BFCL's types are its own (``dict``, ``float``, ``tuple``,
    ``any``, ...); they are mapped by BFCL's own table ``GORILLA_TO_OPENAPI`` (what the leaderboard
    sends OpenAI-style function-calling APIs): dict -> object, float -> number, tuple -> array,
    any -> string, an unknown type -> string, recursively through ``items`` and ``properties``."""
    table = bfcl().GORILLA_TO_OPENAPI
    out: Dict[str, Any] = {"type": table.get(param.get("type", "string"), "string")}
    out.update({k: param[k] for k in _KEEP if k in param})
    if isinstance(param.get("items"), dict):
        out["items"] = json_schema(param["items"])
    if isinstance(param.get("properties"), dict):
        out["properties"] = {k: json_schema(v) for k, v in param["properties"].items()}
        if param.get("required"):
            out["required"] = list(param["required"])
    return out


def tool_schema(doc: Dict[str, Any]) -> Dict[str, Any]:
    """A BFCL function doc as the OpenAI function schema a chat template renders (name kept as written)."""
    params = doc.get("parameters") or {}
    schema = json_schema(dict(params, type="dict"))
    schema.setdefault("properties", {})
    return {"type": "function", "function": {"name": doc["name"], "description": doc.get("description", ""),
                                             "parameters": schema}}
