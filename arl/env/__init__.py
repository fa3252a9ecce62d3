"""Multi-turn tool environments (async), their registry, the tool-call formats, tools and rewards."""
from .base import ANSWER_END, STOP_STRINGS, TOOL_CALL_END, Environment, Fault, StepResult
from .registry import ENVIRONMENTS, check_env, env_class, env_kwargs, make_env, register_env
from .toolcall import ParsedTurn, ToolSpec, format_answer, format_tool_call, parse_turn
from .reward import EpisodeRecord, RewardError, load_reward_fn, score
from .tool_env import ToolEnv
from .tool_parsers import ParsedCall, ParsedCalls, ToolParser, get_parser, register_parser
from .tools import Tool, load_tools, tool_from_callable, tool_from_schema
from .vllm_parsers import make_parser
from . import bfcl, code, gym_env, long_lookup, mcp_env, openenv_env, toy, verifiers_env  # noqa: F401  (register bfcl, code_exec, gym, long_lookup, mcp, openenv, toy_lookup, verifiers; ToolEnv: tools)

__all__ = ["ANSWER_END", "ENVIRONMENTS", "Environment", "EpisodeRecord", "Fault", "ParsedCall", "ParsedCalls",
           "ParsedTurn", "RewardError", "STOP_STRINGS", "StepResult", "TOOL_CALL_END", "Tool", "ToolEnv", "ToolParser",
           "ToolSpec", "check_env", "env_class", "env_kwargs", "format_answer", "format_tool_call", "get_parser", "load_reward_fn",
           "load_tools", "make_env", "make_parser", "parse_turn", "register_env", "register_parser", "score", "tool_from_callable",
           "tool_from_schema"]
