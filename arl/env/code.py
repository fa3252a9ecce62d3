"""``code_exec``: write a small Python function, try code with ``run_python``, answer with the code.

The task ("Write add(a, b) that returns a + b.") is chosen by the seed from ``TASKS``.  The tool
``run_python(code)`` runs the code in the sandbox and shows the exit status and (truncated) output,
or which limit killed it.  The final ``<answer>`` holds the solution code; it is graded by the
task's hidden tests, run in the sandbox after the solution: reward 1 if every test passes, else 0.
A sandbox that does not start is ``Fault.UNRECOVERABLE``; a limit hit by the model's own code is
not a fault (it is the model's doing) and is reported in ``info["sandbox"]``.
"""
from __future__ import annotations

import random
import re
import secrets
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

from .base import Environment, Fault, StepResult
from .registry import register_env
from .sandbox import Sandbox, SandboxLimits, SandboxResult
from .toolcall import ToolSpec, describe_tools, format_answer, format_tool_call, parse_turn

RUN_PYTHON = ToolSpec("run_python", {"code": "string"}, "run Python code, see its output")


@dataclass(frozen=True)
class CodeTask:
    func: str  # function name the solution must define
    prompt: str
    reference: str  # expert solution
    tests: Tuple[Tuple[tuple, Any], ...]  # (args, expected result)


TASKS: Tuple[CodeTask, ...] = (
    CodeTask("add", "Write add(a, b) that returns a + b.", "def add(a, b):\n    return a + b",
             (((1, 2), 3), ((-5, 5), 0), ((10, 32), 42))),
    CodeTask("reverse", "Write reverse(s) that returns the string s reversed.",
             "def reverse(s):\n    return s[::-1]", ((("abc",), "cba"), (("",), ""), (("ab a",), "a ba"))),
    CodeTask("is_even", "Write is_even(n) that returns True if n is even, else False.",
             "def is_even(n):\n    return n % 2 == 0", (((4,), True), ((7,), False), ((0,), True))),
    CodeTask("fib", "Write fib(n) that returns the n-th Fibonacci number (fib(0) = 0, fib(1) = 1).",
             "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
             (((0,), 0), ((1,), 1), ((10,), 55), ((30,), 832040))),
    CodeTask("count_vowels", "Write count_vowels(s) that returns how many of the letters of s are "
             "vowels (aeiou, lower case).",
             "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)",
             ((("hello",), 2), (("xyz",), 0), (("aeiou",), 5))),
    CodeTask("max_of", "Write max_of(xs) that returns the largest number in the non-empty list xs.",
             "def max_of(xs):\n    return max(xs)", ((([3, 9, 2],), 9), (([-4, -2],), -2), (([7],), 7))),
    CodeTask("fizz", "Write fizz(n) that returns 'FizzBuzz' if 15 divides n, 'Fizz' if 3 does, "
             "'Buzz' if 5 does, else str(n).",
             "def fizz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n    if n % 3 == 0:\n"
             "        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n    return str(n)",
             (((15,), "FizzBuzz"), ((9,), "Fizz"), ((10,), "Buzz"), ((7,), "7"))),
    CodeTask("sum_digits", "Write sum_digits(n) that returns the sum of the decimal digits of n >= 0.",
             "def sum_digits(n):\n    return sum(int(c) for c in str(n))",
             (((0,), 0), ((123,), 6), ((9999,), 36))),
    CodeTask("is_palindrome", "Write is_palindrome(s) that returns True if s reads the same "
             "backwards.", "def is_palindrome(s):\n    return s == s[::-1]",
             ((("abba",), True), (("abc",), False), (("",), True))),
    CodeTask("factorial", "Write factorial(n) that returns n! (factorial(0) = 1).",
             "def factorial(n):\n    r = 1\n    for i in range(2, n + 1):\n        r *= i\n    return r",
             (((0,), 1), ((5,), 120), ((10,), 3628800))),
)

_FENCE = re.compile(r"^\s*```(?:python|py)?\s*\n(.*?)\n?```\s*$", re.S)


def strip_fence(code: str) -> str:
    m = _FENCE.match(code)
    return m.group(1) if m else code


def grading_program(task: CodeTask, solution: str, token: str) -> str:
    """The solution, then the hidden tests; prints ``token`` only if all pass.  Types are compared
    exactly so an object whose ``__eq__`` always says True does not pass."""
    cases = repr([(list(a), e) for a, e in task.tests])
    return (f"{solution}\n\n"
            f"for _args, _exp in {cases}:\n"
            f"    _got = {task.func}(*_args)\n"
            f"    if type(_got) is not type(_exp) or not (_exp == _got):\n"
            f"        raise SystemExit('test failed: {task.func}(%s)' % ', '.join(map(repr, _args)))\n"
            f"print({token!r})\n")


def format_run(res: SandboxResult, max_chars: int) -> str:
    """The tool's observation: short, head of stdout and tail of stderr."""
    head = f"killed: {res.limit} {res.detail}".rstrip() if res.limit else f"exit {res.exit_code}"
    out, err = res.stdout, res.stderr
    budget = max(max_chars - len(head) - 1, 0)
    out = out[:budget]
    err = err[-max(budget - len(out), 0):] if budget > len(out) else ""
    return "\n".join(x for x in (head, out.rstrip("\n"), err.rstrip("\n")) if x)


@register_env("code_exec")
class CodeExecEnv(Environment):
    tool_specs = (RUN_PYTHON,)

    def __init__(self, limits: Union[SandboxLimits, dict, None] = None, python: Optional[str] = None,
                 obs_chars: int = 400, max_turns: int = 6, tasks: Optional[Sequence[str]] = None):
        if isinstance(limits, dict):
            limits = SandboxLimits(**limits)
        self.sandbox = Sandbox(limits, python=python)
        if obs_chars < 40:
            raise ValueError(f"obs_chars must be >= 40, got {obs_chars}")
        by_name = {t.func: t for t in TASKS}
        if tasks is not None:
            bad = [n for n in tasks if n not in by_name]
            if bad:
                raise ValueError(f"tasks: unknown {bad[0]!r}; choose from {sorted(by_name)}")
        self.tasks = tuple(by_name[n] for n in tasks) if tasks else TASKS
        self.obs_chars, self.max_turns = obs_chars, max_turns
        self.system_prompt = (
            "Write the Python function asked for. Tool:\n" + describe_tools(self.tool_specs) + "\n"
            "Answer with the code of the function.\n"
            + format_tool_call("run_python", {"code": "print(1 + 1)"}) + "\n"
            + format_answer("def f(x):\n    return x"))
        self._active = False
        self.task: Optional[CodeTask] = None

    async def reset(self, seed: int, *, sample: int = 0) -> str:
        if not isinstance(seed, int):
            raise ValueError(f"reset: seed must be an int, got {type(seed).__name__}")
        self.task = self.tasks[random.Random(f"code_exec/{seed}").randrange(len(self.tasks))]
        self.turns, self._active = 0, True
        return self.task.prompt

    def expert_turns(self) -> Optional[List[str]]:
        if self.task is None:
            return None
        t = self.task
        args = ", ".join(map(repr, t.tests[0][0]))
        return [format_tool_call("run_python", {"code": f"{t.reference}\nprint({t.func}({args}))"}),
                format_answer(t.reference)]

    async def close(self) -> None:
        self._active = False

    async def step(self, action_text: str) -> StepResult:
        if not self._active:
            raise ValueError("step: no episode in progress; call reset(seed) first")
        self.turns += 1
        turn = parse_turn(action_text, self.tool_specs)
        info = {"fault": Fault.NONE, "tool": turn.tool, "args": turn.arguments, "tool_error": turn.is_error,
                "turn": self.turns, "sandbox": None}
        if turn.kind == "error":
            return self._cap(StepResult(turn.error, 0.0, False, info))
        if turn.kind == "tool":
            res = await self.sandbox.run(turn.arguments["code"])
            info["sandbox"] = res.limit
            if not res.started:
                return self._died(res, info)
            return self._cap(StepResult(format_run(res, self.obs_chars), 0.0, False, info))
        token = "tests passed " + secrets.token_hex(8)
        res = await self.sandbox.run(grading_program(self.task, strip_fence(turn.answer), token))
        info["sandbox"] = res.limit
        if not res.started:
            return self._died(res, info)
        passed = res.ok and res.stdout.rstrip("\n").endswith(token)
        info.update(tests_passed=passed, correct=passed)
        self._active = False
        return StepResult("done", 1.0 if passed else 0.0, True, info)

    def _died(self, res: SandboxResult, info: dict) -> StepResult:
        self._active = False
        info.update(fault=Fault.UNRECOVERABLE, fault_kind="sandbox_start", detail=res.detail,
                    correct=False)
        return StepResult("error: sandbox failed to start", 0.0, True, info)

    def _cap(self, res: StepResult) -> StepResult:
        if self.turns >= self.max_turns:
            res.done, self._active = True, False
            res.info.update(truncated=True, correct=False)
        return res
