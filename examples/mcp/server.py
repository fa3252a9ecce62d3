"""An MCP tool server written in the ``mcp`` SDK's documented style (mcp 2.x: ``MCPServer``, the
FastMCP of mcp 1.x): typed functions with docstrings become tools, ``run()`` serves them over
stdio.  arl starts it as ``python examples/mcp/server.py`` (``env.name: mcp``, arl/env/mcp_env.py).

Two tools: a unit converter (lengths and masses) and a calculator.
"""
from __future__ import annotations

import ast
import operator

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError  # its message reaches the model

mcp = MCPServer("units", log_level="WARNING")

# factors to the base unit (metre, kilogram)
_UNITS = {"mm": 0.001, "cm": 0.01, "m": 1.0, "km": 1000.0, "in": 0.0254, "ft": 0.3048, "mi": 1609.344,
          "g": 0.001, "kg": 1.0, "lb": 0.45359237, "oz": 0.028349523125}
_KIND = {u: ("mass" if u in ("g", "kg", "lb", "oz") else "length") for u in _UNITS}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


@mcp.tool()
def convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a length or a mass between units (mm, cm, m, km, in, ft, mi, g, kg, lb, oz).

    Args:
        value: the amount to convert
        from_unit: the unit of value, e.g. "mi"
        to_unit: the unit to convert to, e.g. "km"
    """
    for u in (from_unit, to_unit):
        if u not in _UNITS:
            raise ToolError(f"unknown unit {u!r}; units: {', '.join(_UNITS)}")
    if _KIND[from_unit] != _KIND[to_unit]:
        raise ToolError(f"cannot convert {_KIND[from_unit]} ({from_unit}) to {_KIND[to_unit]} ({to_unit})")
    return f"{round(value * _UNITS[from_unit] / _UNITS[to_unit], 2):g}"


def _eval(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ToolError("only numbers and + - * / ( ) are allowed")


@mcp.tool()
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / and parentheses), rounded to 2 decimals.

    Args:
        expression: e.g. "12.5 * 4 + 3"
    """
    return f"{round(_eval(ast.parse(expression, mode='eval').body), 2):g}"


if __name__ == "__main__":
    mcp.run()  # stdio
