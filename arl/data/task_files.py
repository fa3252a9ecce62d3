"""Reading task and demonstration files into ``Record``s: ``(where, value, problem)`` per row.

JSONL / JSON are read here, line by line: a bad line is named (``line 7: invalid JSON ...``) and
``bad_rows: skip`` can pass over it, where ``datasets``' JSON loader fails the whole file at the
first bad line.  Everything columnar goes through HF ``datasets``: ``.parquet`` files, directories
written by ``save_to_disk``, and ``hf:<source>[:config][@split]`` -- a Hub id (``hf:openai/gsm8k:main@test``,
from the Hub or its local cache) or a local dataset folder (``hf:./my_dataset@train``), loaded by
``datasets.load_dataset``.  Every problem with a file as a whole is a one-line ValueError.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

Record = tuple[str, Any, Optional[str]]  # (where: "line 7" / "row 3", the value, what is wrong or None)
HF_PREFIX = "hf:"


def json_type(v: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if v is None else names.get(type(v), type(v).__name__)


def _json_lines(data: bytes, first_line: int = 1) -> Iterator[Record]:
    for n, raw in enumerate(data.split(b"\n"), first_line):
        if not raw.strip():
            continue
        try:
            yield f"line {n}", json.loads(raw), None  # bytes: json detects UTF-8 (and a BOM) itself
        except json.JSONDecodeError as e:
            yield f"line {n}", None, f"invalid JSON: {e.msg} at column {e.colno}"
        except UnicodeDecodeError:
            yield f"line {n}", None, "not valid UTF-8"


def _json_file(path: Path, key: str) -> Iterator[Record]:
    data = path.read_bytes()
    body = data.lstrip()
    if body.startswith(b"\xef\xbb\xbf"):
        body = body[3:].lstrip()
    if not body.startswith(b"["):
        yield from _json_lines(data)  # .json is often JSON lines too
        return
    try:
        items = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        at = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise ValueError(f"{key}: {path}: not valid JSON ({getattr(e, 'msg', 'not UTF-8')}{at})") from None
    if not isinstance(items, list):
        raise ValueError(f"{key}: {path}: expected an array of rows, got a JSON {json_type(items)}")
    for i, obj in enumerate(items):
        yield f"row {i}", obj, None


def _without_nulls(row: Any) -> Any:
    """A columnar source stores a key some rows (or messages) lack as null in all the others: drop
    those nulls, so a row reads as it was written (a chat template may test ``'tool_calls' in
    message``; a reward fn ``'meta' in task``).  A row's own explicit null is dropped too."""
    if not isinstance(row, dict):
        return row
    row = {k: v for k, v in row.items() if v is not None}
    msgs = row.get("messages")
    if isinstance(msgs, list):
        row["messages"] = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in msgs]
    return row


def _datasets(key: str, what: str):
    try:
        import datasets  # only when asked: a slow import most runs do not need
    except ImportError:
        raise ValueError(f"{key}: {what} needs the datasets package (pip install datasets)") from None
    return datasets


def _one_split(ds: Any, datasets: Any, key: str, where: str, hint: str) -> Any:
    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            raise ValueError(f"{key}: {where} holds the splits {', '.join(ds)}: {hint.format(next(iter(ds)))}")
        ds = next(iter(ds.values()))
    return ds


def _rows(ds: Any) -> Iterator[Record]:
    for i, row in enumerate(ds.to_list()):
        yield f"row {i}", _without_nulls(row), None


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"


def _parquet(path: Path, key: str) -> Iterator[Record]:
    datasets = _datasets(key, f"{path}: reading parquet")
    try:
        ds = datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
    except Exception as e:  # pyarrow's ArrowInvalid / OSError for a damaged file
        raise ValueError(f"{key}: {path}: not a readable parquet file ({_first_line(e)})") from None
    yield from _rows(ds)


def _saved(path: Path, key: str) -> Iterator[Record]:
    datasets = _datasets(key, f"{path} is a directory; loading a dataset saved with save_to_disk")
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise ValueError(f"{key}: {path}: a directory, but not one written by datasets' save_to_disk (a dataset "
                         f"folder of data files: {HF_PREFIX}{path})") from None
    yield from _rows(_one_split(ds, datasets, key, str(path), f"give one split's directory, e.g. {path}/{{}}"))


HUB_PROBE_S = 3.0  # how long the Hub gets to accept a connection before a hub id is read from the cache alone


def _hub_endpoint() -> str:
    try:
        from huggingface_hub import constants
        return constants.ENDPOINT
    except ImportError:
        return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def _hub_unreachable() -> Optional[str]:
    """The Hub's host when it cannot be reached from here (no DNS, no route, nothing listening within
    ``HUB_PROBE_S``), else None.  Behind a proxy the answer is left to the HTTP client (None)."""
    from urllib.parse import urlparse

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return None
    url = urlparse(_hub_endpoint())
    ok = []

    def probe():
        try:
            socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                     HUB_PROBE_S).close()
            ok.append(True)
        except OSError:
            pass

    # in a thread: the connect timeout does not cover the name lookup (5 s per try without DNS)
    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(HUB_PROBE_S)
    return None if ok else (url.hostname or str(url))


@contextlib.contextmanager
def _offline(datasets):
    """datasets and huggingface_hub in offline mode for one call (what HF_HUB_OFFLINE=1 does): the
    cache is read, the Hub is not asked -- no "Retrying in Ns" loop of half a minute."""
    from huggingface_hub import constants

    old = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = old


def _hub(source: str, key: str) -> Iterator[Record]:
    """``hf:<id or folder>[:config][@split]`` through ``datasets.load_dataset``."""
    spec = source[len(HF_PREFIX):]
    spec, _, split = spec.partition("@")
    name, _, config = spec.partition(":")
    if not name:
        raise ValueError(f"{key}: {source!r}: expected hf:<hub id or folder>[:config][@split]")
    datasets = _datasets(key, source)
    # a hub id while the Hub cannot be reached: the cache alone, so an uncached one fails at once
    # instead of after huggingface_hub's retries (offline mode already set: the caller's choice)
    host = None
    if not Path(name).expanduser().exists() and not datasets.config.HF_HUB_OFFLINE:
        host = _hub_unreachable()
    try:
        with _offline(datasets) if host else contextlib.nullcontext():
            ds = datasets.load_dataset(name, config or None, split=split or None)
    except Exception as e:  # not on the Hub, offline and not cached, no such split or config, ...
        if host:
            raise ValueError(f"{key}: {source}: not in the local datasets cache, and the Hub ({host}) cannot be "
                             f"reached from here ({_first_line(e)}); download it where there is network, or give "
                             f"a local folder as {HF_PREFIX}<folder>") from None
        raise ValueError(f"{key}: {source}: datasets.load_dataset failed ({_first_line(e)})") from None
    yield from _rows(_one_split(ds, datasets, key, source, f"name one, e.g. {HF_PREFIX}{spec}@{{}}"))


def records(source: str, key: str) -> Iterator[Record]:
    """Every row of ``source`` (a file by its suffix, a saved-dataset directory, or ``hf:...``)."""
    if source.startswith(HF_PREFIX):
        yield from _hub(source, key)
        return
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"{key}: {path}: no such file or directory")
    if path.is_dir():
        yield from _saved(path, key)
        return
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        yield from _json_lines(path.read_bytes())
    elif suffix == ".json":
        yield from _json_file(path, key)
    elif suffix == ".parquet":
        yield from _parquet(path, key)
    else:
        raise ValueError(f"{key}: {path}: unknown format {suffix or '(no suffix)'!r} (expected .jsonl, .json, "
                         f".parquet, or a directory written by datasets' save_to_disk; or {HF_PREFIX}<dataset id or "
                         f"folder>)")
