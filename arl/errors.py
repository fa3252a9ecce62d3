"""The project's one formatter of pydantic validation errors (bottom layer: imports nothing of arl)."""
from __future__ import annotations

from pydantic import ValidationError


def one_line_error(err: ValidationError, where: str) -> str:
    """Pydantic's multi-line report squeezed into one line naming the key and what is allowed."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            msg = "unknown key"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return f"{where}: " + "; ".join(parts)
