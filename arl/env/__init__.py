"""Multi-turn tool environments (async), their registry and the tool-call turn format."""
from .base import ANSWER_END, STOP_STRINGS, TOOL_CALL_END, Environment, Fault, StepResult
from .registry import ENVIRONMENTS, check_env, env_class, make_env, register_env
from .toolcall import ParsedTurn, ToolSpec, format_answer, format_tool_call, parse_turn
from . import code, toy  # noqa: F401  (register code_exec, toy_lookup)

__all__ = ["ANSWER_END", "ENVIRONMENTS", "Environment", "Fault", "ParsedTurn", "STOP_STRINGS",
           "StepResult", "TOOL_CALL_END", "ToolSpec", "check_env", "env_class", "format_answer", "format_tool_call",
           "make_env", "parse_turn", "register_env"]
