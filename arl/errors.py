"""One-line errors from pydantic validation.

Every config section and every op config reports through ``one_line_error``, so a bad key reads
the same wherever it is caught: ``trainer.zero_stag: unknown key (allowed: ...)``.
"""
from __future__ import annotations

from typing import Any, Optional, Union, get_args, get_origin

import numpy as np
from pydantic import BaseModel, ValidationError


def _section(root: type, loc: tuple) -> Optional[type]:
    """The (nested) model class ``loc`` points into, or None."""
    cur: Any = root
    for part in loc:
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)) or part not in cur.model_fields:
            return None
        ann = cur.model_fields[part].annotation
        if get_origin(ann) is Union:
            ann = next((a for a in get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)), ann)
        cur = ann
    return cur if isinstance(cur, type) and issubclass(cur, BaseModel) else None


def _is_key_path(s: str) -> bool:
    return bool(s) and all(p.isidentifier() or p.isdigit() for p in s.split("."))


def one_line_error(err: ValidationError, where: str = "", root: Optional[type] = None) -> str:
    """Pydantic's report as one line naming each dotted key.  A nested section that raised its own
    one-line error (``"clip_low: 1.5 must be ..."``) has its key joined to the outer path; with
    ``root`` (the top model), an unknown key lists the keys allowed there."""
    parts = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            msg = "unknown key"
        else:
            for name in ("LossConfig", "StabilizerConfig", "PackerConfig"):  # nested sections' own prefix
                msg = msg.removeprefix(f"{name}: ")
            sub, sep, rest = msg.partition(": ")
            if sep and _is_key_path(sub):
                loc, msg = loc + tuple(sub.split(".")), rest
        if msg == "unknown key" and root is not None:
            sec = _section(root, loc[:-1])
            if sec is not None:
                msg += f" (allowed: {', '.join(sorted(sec.model_fields))})"
        key = ".".join(loc)
        parts.append(f"{key}: {msg}" if key else msg)
    return (f"{where}: " if where else "") + "; ".join(parts)


class OneLineErrors(BaseModel):
    """Base of models built directly from user input: construction raises a one-line ValueError
    (prefixed with the class name) instead of pydantic's multi-line report."""

    def __init__(self, **data):
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ValueError(one_line_error(e, type(self).__name__)) from None


def finite_vector(name: str, values, n: int) -> np.ndarray:
    """``values`` as a float64 array of shape ``(n,)``; a wrong shape or a non-finite entry is a
    one-line ValueError naming ``name`` and the first bad index."""
    a = np.asarray(values, dtype=np.float64)
    if a.shape != (n,):
        raise ValueError(f"{name}: shape {a.shape} does not match {n} trajectories")
    if not np.isfinite(a).all():
        i = int(np.flatnonzero(~np.isfinite(a))[0])
        raise ValueError(f"{name}: non-finite value {a[i]} at index {i}")
    return a
