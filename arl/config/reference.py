"""The config reference, made from the schema itself (every key's type, default and ``description``):
``python -m arl.train --help-config [SECTION|SECTION.key]`` prints it as a table, and
``python -m arl.config.reference --write`` writes it to docs/config.md, which
tests/test_config_reference.py keeps current.  Sections are the fields of ``TrainConfig``, walked
recursively, so a new section or key appears here by itself."""
from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
import types
from pathlib import Path
from typing import Any, Literal, NamedTuple, Union, get_args, get_origin

from pydantic import BaseModel

from .schema import TrainConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


class Key(NamedTuple):
    name: str  # dotted; items of a list of mappings: stabilizers.monitors.alarms[].signal
    type: str
    default: str
    description: str


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def _type(ann: Any) -> str:
    origin, args = get_origin(ann), get_args(ann)
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        return "|".join(_type(a) for a in args)
    if origin in (tuple, list):
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            return f"list[{_type(args[0])}]"
        return "[" + ", ".join(_type(a) for a in args) + "]"
    if origin is dict:
        return f"dict[{_type(args[0])}, {_type(args[1])}]"
    if ann is type(None):
        return "null"
    if ann is Any:
        return "any"
    return "section" if _is_model(ann) else getattr(ann, "__name__", str(ann))


def _value(v: Any) -> str:
    """A default as YAML writes it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, str):
        return v or '""'
    return repr(v)


def _nested(ann: Any) -> list[tuple[str, type]]:
    """``(separator, model)`` for each model inside a field's annotation (itself, Optional, a list of)."""
    if _is_model(ann):
        return [(".", ann)]
    seq = get_origin(ann) in (tuple, list)
    return [("[]." if seq else sep, m) for a in get_args(ann) for sep, m in _nested(a)]


def keys(model: type = TrainConfig, prefix: str = "") -> list[Key]:
    """Every key of ``model``, depth first, in the schema's order; a section is a key too."""
    out = []
    for name, f in model.model_fields.items():
        if f.is_required():
            default = "required"
        else:
            v = f.get_default(call_default_factory=True)
            default = "-" if isinstance(v, BaseModel) else _value(v)
        out.append(Key(prefix + name, _type(f.annotation), default, f.description or ""))
        for sep, sub in _nested(f.annotation):
            out += keys(sub, prefix + name + sep)
    return out


def sections() -> list[str]:
    return list(TrainConfig.model_fields)


def select(query: str = "") -> list[Key]:
    """The keys under ``query`` (a section, or a dotted key with what is below it); all for ''.
    Raises ValueError (one line) for a query that names nothing."""
    rows = [k for k in keys() if not query or k.name == query or k.name.startswith((query + ".", query + "[]"))]
    if rows:
        return rows
    head = query.split(".")[0]
    if head in sections():
        below = [k.name[len(head) + 1:] for k in keys() if k.name.startswith(head + ".")]
        raise ValueError(f"unknown key {query} (keys of {head}: {', '.join(below)})")
    raise ValueError(f"unknown section {query} (sections: {', '.join(sections())})")


def table(rows: list[Key], width: int = 0) -> str:
    """Key, type and default in aligned columns, the description wrapped below each key."""
    width = width or max(60, shutil.get_terminal_size((100, 24)).columns)
    kw = min(max(len(k.name) for k in rows), 44)
    tw = min(max(len(k.type) for k in rows), 28)
    lines = [f"{'KEY':<{kw}}  {'TYPE':<{tw}}  DEFAULT"]
    for k in rows:
        lines.append(f"{k.name:<{kw}}  {k.type:<{tw}}  {k.default}".rstrip())
        text = k.description or "(no description)"
        lines += textwrap.wrap(text, width - 1, initial_indent="    ", subsequent_indent="    ",
                               break_on_hyphens=False)
    return "\n".join(lines)


HEADER = """\
# Config reference

<!-- Generated from the schema (arl/config/) by `python -m arl.config.reference --write`; do not edit.
     tests/test_config_reference.py fails when this file is stale. -->

Every key of the training config: its type, its default and what it does. The same table, for one
section or key, in the terminal: `python -m arl.train --help-config [SECTION|SECTION.key]`.

How a config is made (`arl/config/load.py`):

* `python -m arl.train --config PATH`: PATH is opened as given, so a relative PATH is relative to
  the working directory. Without `--config` the run is the built-in default (`BUILTIN_DEFAULT`,
  equal to `configs/tiny_cpu.yaml`); with it, the file alone is the start (it is not merged with
  the built-in default).
* Paths inside a config (`output_dir`, `model.name_or_path`, `env.dataset`, `sft.dataset`, ...)
  are used as written: a relative one is relative to the working directory the run starts in,
  not to the YAML file's directory.
* Overrides are the positional `key.sub=value` arguments after the options (there is no `--set`
  flag), e.g. `python -m arl.train --config configs/tiny_cpu.yaml trainer.steps=10
  loss.dual_clip=null 'logging.wandb={project: p}'`. Each value is parsed as YAML (an empty value
  is null), they apply in order on top of the file (a later one wins; missing sections are
  created), and the result is validated as a whole: an unknown key or a bad value is one line.
* Keys left out take the defaults below, which are the schema's; the built-in default run sets some
  differently. `--print-config` prints the resolved config, every key, as a valid `--config` file.
* Types: `a|b` is one of the values listed; `section` is a mapping of the keys listed under it;
  `list[section]` is a list of such mappings (its keys are listed as `key[].sub`).
"""


def _cell(s: str) -> str:
    """Table cell text: a pipe escaped (also inside a code span, as GFM tables want)."""
    return s.replace("|", "\\|")


def _md(s: str) -> str:
    return _cell(s).replace("<", "&lt;").replace("*", "\\*")


def markdown() -> str:
    """docs/config.md: the header, then one table per section (top-level keys first)."""
    top = TrainConfig.model_fields
    rows = keys()
    out = [HEADER]
    groups = [("Top level", "", [k for k in rows if k.name in top and not _nested(top[k.name].annotation)])]
    groups += [(f"`{s}`", top[s].description or "", [k for k in rows if k.name.startswith(s + ".")])
               for s in top if _nested(top[s].annotation)]
    for title, text, group in groups:
        out += [f"## {title}", ""] + ([_md(text), ""] if text else [])
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        out += [f"| `{k.name}` | {_md(k.type)} | `{_cell(k.default)}` | {_md(k.description)} |" for k in group]
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m arl.config.reference", description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write {DOC.name} (default: print it)")
    args = ap.parse_args(argv)
    if args.write:
        DOC.write_text(markdown())
        print(f"wrote {DOC} ({len(keys())} keys)")
    else:
        sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
