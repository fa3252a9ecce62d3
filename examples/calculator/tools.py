"""The calculator example's tools: plain typed Python functions with docstrings.  arl turns each into
an OpenAI function schema (name, description, typed parameters) and renders them with the model's
chat template."""
from __future__ import annotations

import ast
import operator
from fractions import Fraction

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}

# factors to a base unit per kind; conversions only within a kind
UNITS = {
    "length": {"mm": Fraction(1, 1000), "cm": Fraction(1, 100), "m": 1, "km": 1000},
    "mass": {"mg": Fraction(1, 1000), "g": 1, "kg": 1000, "t": 1000000},
    "volume": {"ml": Fraction(1, 1000), "l": 1},
    "time": {"s": 1, "min": 60, "h": 3600, "day": 86400},
}


def _number(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):.6g}"


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    raise ValueError("only numbers, + - * / and parentheses are allowed")


def calculator(expression: str) -> str:
    """Exact arithmetic.

    Args:
        expression: e.g. "317 * 2489"
    """
    if len(expression) > 200:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expression.replace(",", ""), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    return _number(_eval(tree))


def convert_units(value: float, from_unit: str, to_unit: str) -> str:
    """Convert units.

    Args:
        value: the quantity
        from_unit: mm, cm, m, km, mg, g, kg, t, ml, l, s, min, h or day
        to_unit: a unit of the same kind
    """
    for kind, table in UNITS.items():
        if from_unit in table and to_unit in table:
            return _number(Fraction(value) * Fraction(table[from_unit]) / Fraction(table[to_unit]))
    raise ValueError(f"cannot convert {from_unit!r} to {to_unit!r}")


TOOLS = [calculator, convert_units]
