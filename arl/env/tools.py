"""Tools the model may call: a Python callable plus the OpenAI function schema the model reads.

``tool_from_callable(fn)`` builds the schema from the typed signature and the docstring::

    def get_weather(city: str, unit: Literal["c", "f"] = "c") -> str:
        \"\"\"The current weather in a city.

        Args:
            city: the city's name, e.g. "Paris"
            unit: degrees Celsius or Fahrenheit
        \"\"\"

The first paragraph of the docstring is the description, Google-style ``Args:`` lines describe the
parameters (optional, but the model only knows what it is told), a parameter with a default is not
required.  Types: str, int, float, bool, list[...], dict[...], Optional / ``X | None``, Literal,
unions of those.  ``tool_from_schema(schema, fn)`` takes a hand-written OpenAI schema instead.
``load_tools(["pkg.mod:fn", "pkg.mod:TOOLS"])`` imports them (TOOLS: a list of callables/Tools).

Why not ``transformers.utils.get_json_schema`` (5.19): it refuses a tool with any undocumented
argument, marks ``Optional[X]`` with OpenAPI's ``nullable`` (which JSON Schema validators ignore, so
the argument check below would refuse a null), and keeps line breaks and later paragraphs of the
description.  For a tool whose arguments are all documented, with plain types and a one-line
description, the two schemas are equal apart from its ``return`` entry (tested).

Arguments the model writes are checked against the schema (``jsonschema``); a missing, unknown or
mistyped argument is an error message for the model, never an exception.  Sync tools run in a
thread pool (a timed-out sync tool keeps its thread until it returns: Python cannot kill threads).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import importlib
import inspect
import json
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Union

import jsonschema

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Dict[str, Any]  # JSON schema of the arguments object
    fn: Callable = field(compare=False)

    @property
    def schema(self) -> Dict[str, Any]:
        """The OpenAI function schema (what chat templates render)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    @property
    def is_async(self) -> bool:
        return is_async_callable(self.fn)

    def check_arguments(self, arguments: Any) -> Optional[str]:
        """None when ``arguments`` fit the schema, else a one-line message for the model."""
        if not isinstance(arguments, dict):
            return f"{self.name} arguments must be a JSON object, got {type(arguments).__name__}"
        err = jsonschema.exceptions.best_match(self._arg_validator.iter_errors(arguments))
        if err is None:
            return None
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
        where = f" at {where.lstrip('.')}" if where else ""
        return f"{self.name} arguments{where}: {err.message}; expected {_signature(self)}"

    @functools.cached_property  # (writes the instance __dict__: fine on a frozen dataclass)
    def _arg_validator(self):
        schema = self.parameters
        if "additionalProperties" not in schema:  # unknown arguments are mistakes: say so
            schema = dict(schema, additionalProperties=False)
        return _validator(schema)

    async def call(self, arguments: Dict[str, Any]) -> str:
        """Run the tool (a sync one in a thread); its result as the text the model reads."""
        return result_text(await call_maybe_async(self.fn, **arguments))


# Sync tools and reward functions run here, not in asyncio's default pool (a handful of threads on
# a small machine, shared by every pooled env).  A sync call that hangs holds its thread until it
# returns -- give network calls their own timeouts.
_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="arl-tool")


def is_async_callable(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


async def call_maybe_async(fn: Callable, **kwargs) -> Any:
    """``await fn(**kwargs)`` for an async ``fn``; a sync one in a thread (its awaitable result awaited)."""
    if is_async_callable(fn):
        return await fn(**kwargs)
    ctx = contextvars.copy_context()
    out = await asyncio.get_running_loop().run_in_executor(_THREADS, functools.partial(ctx.run, fn, **kwargs))
    return await out if inspect.isawaitable(out) else out


def result_text(out: Any) -> str:
    if isinstance(out, str):
        return out
    try:
        return json.dumps(out, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(out)


def _validator(schema: dict):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


def _signature(tool: Tool) -> str:
    props = tool.parameters.get("properties", {})
    req = set(tool.parameters.get("required", []))
    args = [f"{k}: {_type_name(v)}" + ("" if k in req else "?") for k, v in props.items()]
    return f"{tool.name}({', '.join(args)})"


def _type_name(s: dict) -> str:
    if "enum" in s:
        return " | ".join(json.dumps(v) for v in s["enum"])
    t = s.get("type")
    if isinstance(t, list):
        return " | ".join(t)
    if t == "array" and isinstance(s.get("items"), dict):
        return f"array of {_type_name(s['items'])}"
    if t is None and "anyOf" in s:
        return " | ".join(_type_name(x) for x in s["anyOf"])
    return t or "any"


# -- schema from a Python signature ---------------------------------------------------------------
def _type_schema(tp: Any, where: str) -> Dict[str, Any]:
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in (list, List) or origin is list:
        return {"type": "array", **({"items": _type_schema(args[0], where)} if args else {})}
    if tp in (dict, Dict) or origin is dict:
        if args and args[0] is not str:
            raise ValueError(f"{where}: dict keys must be str (JSON objects), got {args[0]!r}")
        return {"type": "object", **({"additionalProperties": _type_schema(args[1], where)} if args else {})}
    if origin is Literal:
        kinds = {type(a) for a in args}
        if len(kinds) != 1 or next(iter(kinds)) not in _SCALARS:
            raise ValueError(f"{where}: Literal values must share one of str/int/float/bool, got {args!r}")
        return {"type": _SCALARS[kinds.pop()], "enum": list(args)}
    if origin is Union or origin is types.UnionType:
        nullable = type(None) in args
        parts = [_type_schema(a, where) for a in args if a is not type(None)]
        if len(parts) == 1 and nullable and isinstance(parts[0].get("type"), str):
            return dict(parts[0], type=[parts[0]["type"], "null"])  # Optional[X]
        if all(set(p) == {"type"} and isinstance(p["type"], str) for p in parts):
            return {"type": [p["type"] for p in parts] + (["null"] if nullable else [])}
        return {"anyOf": parts + ([{"type": "null"}] if nullable else [])}
    raise ValueError(f"{where}: unsupported type {tp!r} (use str, int, float, bool, list, dict, "
                     f"Optional, Literal or a union of them)")


_ARGS_HEADER = re.compile(r"^(\s*)(Args|Arguments|Parameters):\s*$")
_ARG_LINE = re.compile(r"^\s*\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple:
    """``(description, {param: description})`` of a Google-style docstring."""
    lines = doc.splitlines()
    first = []
    for line in lines:
        if not line.strip() or _ARGS_HEADER.match(line):
            break
        first.append(line.strip())
    params: Dict[str, str] = {}
    for i, line in enumerate(lines):
        m = _ARGS_HEADER.match(line)
        if not m:
            continue
        indent, cur, item_indent = len(m.group(1)), None, None
        for body in lines[i + 1:]:
            if not body.strip():
                continue
            ind = len(body) - len(body.lstrip())
            if ind <= indent:
                break  # the next section (Returns:, Raises:, ...)
            am = _ARG_LINE.match(body)
            if am and (item_indent is None or ind <= item_indent):
                item_indent, cur = ind, am.group(1)
                params[cur] = am.group(2).strip()
            elif cur is not None:  # a continuation line
                params[cur] = (params[cur] + " " + body.strip()).strip()
        break
    return " ".join(first), params


def tool_from_callable(fn: Callable, name: Optional[str] = None) -> Tool:
    """A Tool from ``fn``'s typed signature and docstring (see the module docstring)."""
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    if not callable(fn):
        raise ValueError(f"tool {qual}: not callable")
    name = name or getattr(fn, "__name__", None)
    if not name or not re.fullmatch(r"[A-Za-z_][\w.-]*", name):
        raise ValueError(f"tool {qual}: needs a name (a function's __name__ or name=...)")
    doc = inspect.getdoc(fn)
    if not doc or not doc.strip():
        raise ValueError(f"tool {qual}: no docstring (its first paragraph is the description the model reads)")
    description, arg_docs = _parse_docstring(doc)
    if not description:
        raise ValueError(f"tool {qual}: the docstring's first paragraph (the description) is empty")
    try:
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except Exception as e:  # unresolvable string annotations and the like
        raise ValueError(f"tool {qual}: cannot read its signature ({type(e).__name__}: {e})") from None
    props: Dict[str, Any] = {}
    required: List[str] = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise ValueError(f"tool {qual}: parameter {p.name!r} must be a plain or keyword-only "
                             f"parameter (tools are called with keyword arguments)")
        if p.name not in hints:
            raise ValueError(f"tool {qual}: parameter {p.name!r} has no type annotation")
        schema = _type_schema(hints[p.name], f"tool {qual}: parameter {p.name!r}")
        if p.name in arg_docs and arg_docs[p.name]:
            schema["description"] = arg_docs[p.name]
        props[p.name] = schema
        if p.default is p.empty:
            required.append(p.name)
    unknown = sorted(set(arg_docs) - set(props))
    if unknown:
        raise ValueError(f"tool {qual}: docstring describes {unknown[0]!r}, which is not a parameter")
    params: Dict[str, Any] = {"type": "object", "properties": props}
    if required:
        params["required"] = required
    return Tool(name, description, params, fn)


def tool_from_schema(schema: Dict[str, Any], fn: Callable) -> Tool:
    """A Tool from an OpenAI schema (``{"type": "function", "function": {...}}`` or the inner
    ``{"name", "description", "parameters"}``) and the callable that implements it."""
    if not isinstance(schema, dict):
        raise ValueError(f"tool schema: must be a dict, got {type(schema).__name__}")
    spec = schema.get("function", schema) if schema.get("type", "function") == "function" else None
    if not isinstance(spec, dict):
        raise ValueError(f"tool schema: expected {{'type': 'function', 'function': {{...}}}}, got type "
                         f"{schema.get('type')!r}")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("tool schema: 'name' must be a non-empty string")
    if not callable(fn):
        raise ValueError(f"tool {name}: the implementation is not callable")
    desc = spec.get("description", "")
    if not isinstance(desc, str):
        raise ValueError(f"tool {name}: 'description' must be a string")
    params = spec.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ValueError(f"tool {name}: 'parameters' must be a JSON schema of type 'object'")
    try:
        _validator(params).check_schema(params)
    except jsonschema.exceptions.SchemaError as e:
        raise ValueError(f"tool {name}: 'parameters' is not a valid JSON schema ({e.message})") from None
    return Tool(name, desc, params, fn)


def as_tool(obj: Any) -> Tool:
    return obj if isinstance(obj, Tool) else tool_from_callable(obj)


def load_tools(spec: Union[str, Sequence[Any]], key: str = "tools") -> List[Tool]:
    """Tools from import paths: ``"pkg.mod:fn"`` (a callable or a Tool) or ``"pkg.mod:TOOLS"`` (a
    list of them); from Python, callables and Tools may stand in the list too.  Names must be
    unique.  Errors are one line naming ``key[i]``."""
    if isinstance(spec, str):
        spec = [spec]
    if not isinstance(spec, (list, tuple)):
        raise ValueError(f"{key}: expected a list of import paths 'pkg.mod:fn', got {type(spec).__name__}")
    tools: List[Tool] = []
    for i, entry in enumerate(spec):
        where = f"{key}[{i}]"
        obj = import_object(entry, where) if isinstance(entry, str) else entry
        items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
        for item in items:
            try:
                tools.append(as_tool(item))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
    seen = set()
    for t in tools:
        if t.name in seen:
            raise ValueError(f"{key}: two tools named {t.name!r}")
        seen.add(t.name)
    return tools


def import_object(path: Any, where: str) -> Any:
    """``"pkg.mod:attr"`` -> the object; a one-line ValueError naming ``where`` otherwise."""
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise ValueError(f"{where}: expected an import path 'pkg.mod:name', got {path!r}")
    module, attr = path.split(":")
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # the user's module: its import-time error, in one line
        raise ValueError(f"{where}: cannot import {module!r} ({type(e).__name__}: {e})") from None
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{where}: module {module!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj
