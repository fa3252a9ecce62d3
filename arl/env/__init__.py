"""Multi-turn tool environments (async), their registry and the tool-call turn format."""
from .base import ANSWER_END, TOOL_CALL_END, Environment, Fault, StepResult
from .registry import ENVIRONMENTS, make_env, register_env

__all__ = ["ANSWER_END", "ENVIRONMENTS", "Environment", "Fault", "StepResult", "TOOL_CALL_END",
           "make_env", "register_env"]
