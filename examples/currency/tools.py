"""The currency example's tools: a rate lookup and the calculator.  A conversion needs both, in
sequence: ``get_rate`` gives the rate, ``calculator`` multiplies the amount by it."""
from __future__ import annotations

import ast

from examples.calculator.tools import _eval

# a fixed snapshot: units of ``quote`` per one unit of ``base`` (the inverse pairs are derived)
_RATES = {
    ("USD", "EUR"): "0.9213", ("GBP", "JPY"): "190.37", ("EUR", "USD"): "1.0854",
    ("CHF", "CAD"): "1.5312", ("GBP", "EUR"): "1.1647", ("CAD", "JPY"): "109.48",
}
CURRENCIES = sorted({c for pair in _RATES for c in pair})


def rate(base: str, quote: str) -> str:
    if (base, quote) in _RATES:
        return _RATES[(base, quote)]
    if (quote, base) in _RATES:
        return f"{1 / float(_RATES[(quote, base)]):.4f}"
    raise ValueError(f"no rate for {base} to {quote} (known currencies: {', '.join(CURRENCIES)})")


def calculator(expression: str) -> str:
    """Exact arithmetic, rounded to the cent.

    Args:
        expression: the amount times the rate, e.g. "<amount> * <rate>"
    """
    if len(expression) > 200:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expression.replace(",", ""), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    cents = round(_eval(tree) * 100)
    sign = "-" if cents < 0 else ""
    return f"{sign}{abs(cents) // 100}.{abs(cents) % 100:02d}"


def get_rate(base: str, quote: str) -> str:
    """The exchange rate: how many units of ``quote`` one unit of ``base`` buys.

    Args:
        base: the currency converted from, a code such as USD, EUR, GBP, JPY, CHF or CAD
        quote: the currency converted to, a code
    """
    return rate(base.strip().upper(), quote.strip().upper())


TOOLS = [get_rate, calculator]
