"""Tasks from data (arl/data/tasks.py): reading JSONL / JSON / parquet / saved HF datasets, bad rows
(fail, or skip and count), the seeded train/eval split without leakage, exact resume, epochs, and
SFT demonstrations."""
import json
import re
import sys
from pathlib import Path

import pytest

from arl.config import ConfigError, DatasetConfig, EnvConfig, load_config
from arl.data import EVAL_SEED_BASE, TaskSet, load_demonstrations, read_tasks

ARL = Path(__file__).resolve().parents[1] / "arl"


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def prompts(n, start=0):
    return [{"prompt": f"what is {i} + 1?", "answer": str(i + 1), "meta": {"id": i}} for i in range(start, start + n)]


def taskset(tmp_path, rows, seed=0, **kw):
    return TaskSet.from_config(DatasetConfig(path=write_jsonl(tmp_path / "t.jsonl", rows), **kw), seed)


# ----------------------------------------------------------------------------- config

def test_config_section_takes_a_bare_path_or_a_mapping():
    assert EnvConfig(dataset="t.jsonl").dataset == DatasetConfig(path="t.jsonl")
    cfg = load_config(None, ["env.dataset={path: a.jsonl, eval_path: b.jsonl, bad_rows: skip}"]).env.dataset
    assert (cfg.path, cfg.eval_path, cfg.bad_rows, cfg.eval_fraction, cfg.shuffle) == ("a.jsonl", "b.jsonl",
                                                                                         "skip", 0.1, True)
    assert load_config(None, []).env.dataset is None


@pytest.mark.parametrize("override,msg", [
    ("env.dataset={path: a.jsonl, eval_fraction: 1}", "env.dataset.eval_fraction: Input should be less than 1"),
    ("env.dataset={path: a.jsonl, bad_rows: ignore}", "env.dataset.bad_rows: Input should be 'fail' or 'skip'"),
    ("env.dataset={path: a.jsonl, split: 2}", "env.dataset.split: unknown key (allowed: bad_rows, eval_fraction,"),
    ("env.dataset=3", "env.dataset: expected a path or a mapping"),
])
def test_config_errors_are_one_line(override, msg):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- reading

def test_jsonl_rows_keep_their_keys_and_blank_lines_are_ignored(tmp_path):
    msgs = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "gt": [1, 2]}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(prompts(1)[0]) + "\n\n   \n" + json.dumps(msgs) + "\r\n")
    data = read_tasks(str(path))
    assert data.rows == [prompts(1)[0], msgs] and data.where == ["line 1", "line 4"] and data.skipped == 0


@pytest.mark.parametrize("line,problem", [
    ('{"prompt": "ok"', "invalid JSON"),
    ('["prompt", "x"]', "not a JSON object (got a JSON array)"),
    ('{"answer": 3}', "needs 'prompt' (a string) or 'messages' (a list of {role, content}); its keys: answer"),
    ('{"prompt": 7}', "'prompt' must be a string (got a JSON number)"),
    ('{"prompt": "  "}', "'prompt' is empty"),
    ('{"messages": []}', "'messages' must be a non-empty list of {role, content} (got an empty array)"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', "messages[0].role 'bot' is not one of system, user,"),
    ('{"messages": [{"role": "user", "content": ["x"]}]}', "messages[0].content must be a string (got a JSON array)"),
    ('{"messages": ["hi"]}', "messages[0] must be an object (got a JSON string)"),
    ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "has both 'prompt' and 'messages'"),
])
def test_a_bad_row_fails_with_its_line_number(tmp_path, line, problem):
    path = write_jsonl(tmp_path / "t.jsonl", prompts(2) + [line] + prompts(1))
    with pytest.raises(ValueError) as e:
        read_tasks(path)
    msg = str(e.value)
    assert msg.startswith(f"env.dataset: {path} line 3: ") and problem in msg and "\n" not in msg, msg


def test_bad_rows_skip_is_counted_and_reported(tmp_path):
    rows = prompts(3) + ["not json", {"answer": 1}] + prompts(20, 3) + ["[1]"] * 6
    ts = taskset(tmp_path, rows, bad_rows="skip")
    assert ts.skipped == 8 and ts.n_train + ts.n_eval == 23
    assert len(ts.skip_reasons) == 5 and re.search(r"t\.jsonl line 4: invalid JSON", ts.skip_reasons[0])
    assert "line 5: needs 'prompt'" in ts.skip_reasons[1]
    assert "8 bad rows skipped (first: " in ts.describe() and "skipped=8" in repr(ts)


@pytest.mark.parametrize("content,msg", [
    ("", "no rows"), ("\n\n", "no rows"), ("nope\n[2]\n", "no valid rows (2 bad; first: "),
])
def test_no_rows_at_all_is_one_error_naming_the_path(tmp_path, content, msg):
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"^env.dataset: {re.escape(str(path))}: {re.escape(msg)}"):
        read_tasks(str(path), bad_rows="skip")


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(ValueError, match=r"^env.dataset: .*nope.jsonl: no such file or directory$"):
        read_tasks(str(tmp_path / "nope.jsonl"))
    (tmp_path / "t.csv").write_text("prompt\nx\n")
    with pytest.raises(ValueError, match=r"unknown format '.csv' \(expected .jsonl, .json, .parquet, or a dir"):
        read_tasks(str(tmp_path / "t.csv"))


def test_json_array_and_json_lines(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(prompts(3)))
    assert read_tasks(str(tmp_path / "a.json")).where == ["row 0", "row 1", "row 2"]
    (tmp_path / "l.json").write_text("\n".join(json.dumps(r) for r in prompts(2)))
    assert read_tasks(str(tmp_path / "l.json")).rows == prompts(2)
    (tmp_path / "b.json").write_text(json.dumps(prompts(2) + [{"prompt": 3}]))
    with pytest.raises(ValueError, match=r"b.json row 2: 'prompt' must be a string"):
        read_tasks(str(tmp_path / "b.json"))


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow not installed (pip install pyarrow)")
    import pyarrow.parquet as pq
    rows = [{"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"},
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": "{}"}]},
                          {"role": "user", "content": "go"}], "answer": "5"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    data = read_tasks(str(tmp_path / "t.parquet"))
    # a column's nulls (the first message's missing tool_calls, a null content) are dropped, not handed to a template
    assert data.rows[0] == rows[0] and data.where == ["row 0", "row 1"]
    assert data.rows[1]["messages"][0] == {"role": "assistant", "tool_calls": [{"name": "f", "arguments": "{}"}]}
    pq.write_table(pa.Table.from_pylist(prompts(2) + [{"prompt": None, "answer": "x", "meta": None}]),
                   tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet row 2: needs 'prompt'"):
        read_tasks(str(tmp_path / "bad.parquet"))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"junk.parquet: not a readable parquet file"):
        read_tasks(str(tmp_path / "junk.parquet"))


def test_saved_hf_dataset_directory(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets", reason="datasets not installed (pip install datasets)")
    rows = prompts(6)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    ts = TaskSet.from_config(DatasetConfig(path=str(tmp_path / "ds"), eval_fraction=0.5), seed=1)
    assert ts.n_train == 3 and ts.n_eval == 3 and sorted(ts.rows, key=str) == sorted(rows, key=str)
    datasets.DatasetDict(train=datasets.Dataset.from_list(rows),
                         test=datasets.Dataset.from_list(rows)).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError,
                       match=r"dd holds the splits train, test: give one split's directory, e\.g\. .*dd/train"):
        read_tasks(str(tmp_path / "dd"))
    assert read_tasks(str(tmp_path / "dd" / "test")).rows == rows
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match=r"plain: a directory, but not one written by datasets' save_to_disk"):
        read_tasks(str(tmp_path / "plain"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(ValueError, match=r"needs the datasets package \(pip install datasets\)"):
        read_tasks(str(tmp_path / "ds"))


def test_hf_sources_through_load_dataset(tmp_path, monkeypatch):
    """``hf:<folder or hub id>[:config][@split]``: a dataset folder of data files (a clone of a Hub
    dataset) with its splits; a Hub id that is neither cached nor reachable is one line."""
    pytest.importorskip("datasets", reason="datasets not installed (pip install datasets)")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "repo" / "data"
    repo.mkdir(parents=True)
    train, test = prompts(4), [{"prompt": f"held out {i}", "answer": str(i)} for i in range(2)]
    (repo / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (repo / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    src = f"hf:{tmp_path / 'repo'}"
    assert read_tasks(src + "@test").rows == test
    ts = TaskSet.from_config(DatasetConfig(path=src + "@train", eval_path=src + "@test"), seed=0)
    assert ts.n_train == 4 and ts.n_eval == 2
    with pytest.raises(ValueError, match=r"repo holds the splits (train, test|test, train): name one, e\.g\. hf:.*@"):
        read_tasks(src)
    with pytest.raises(ValueError) as e:
        read_tasks("hf:arl-no-such-org/no-such-dataset@train")
    assert str(e.value).startswith("env.dataset: hf:arl-no-such-org/no-such-dataset@train: datasets.load_dataset "
                                   "failed (") and "\n" not in str(e.value)


def test_an_uncached_hub_id_fails_at_once_when_the_hub_cannot_be_reached(tmp_path, monkeypatch):
    """A run (not offline mode, which this suite's conftest sets) whose Hub cannot be reached: an
    uncached hub id is one line within seconds, not after huggingface_hub's half a minute of
    "Retrying in Ns"; the offline mode it borrows for the call is given back."""
    datasets = pytest.importorskip("datasets", reason="datasets not installed (pip install datasets)")
    import time

    from huggingface_hub import constants

    from arl.procs import free_port

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    start = time.monotonic()
    with pytest.raises(ValueError) as e:
        read_tasks("hf:arl-no-such-org/no-such-dataset@train")
    took = time.monotonic() - start
    msg = str(e.value)
    assert msg.startswith("env.dataset: hf:arl-no-such-org/no-such-dataset@train: not in the local datasets cache, "
                          "and the Hub (127.0.0.1) cannot be reached from here (") and "\n" not in msg
    assert msg.endswith("; download it where there is network, or give a local folder as hf:<folder>")
    assert took < 15, took  # the retries alone take 31 s (1 + 2 + 4 + 8 + 16)
    assert datasets.config.HF_HUB_OFFLINE is False and constants.HF_HUB_OFFLINE is False


# ----------------------------------------------------------------------------- split and order

@pytest.mark.parametrize("n,fraction,n_eval", [(100, 0.1, 10), (10, 0.04, 1), (2, 0.01, 1), (1, 0.1, 0),
                                               (50, 0.0, 0), (7, 0.5, 4)])
def test_eval_split_size(tmp_path, n, fraction, n_eval):
    ts = taskset(tmp_path, prompts(n), eval_fraction=fraction)
    assert (ts.n_eval, ts.n_train) == (n_eval, n - n_eval)


def test_an_empty_train_split_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"t.jsonl: no training rows left of 2 \(2 held out\)"):
        taskset(tmp_path, prompts(2), eval_fraction=0.9)


def test_eval_rows_are_never_trained_on(tmp_path):
    ts = taskset(tmp_path, prompts(200), seed=5, eval_fraction=0.15)
    held = set(ts.eval_ids.tolist())
    trained = {ts.train_index(s) for s in range(20 * ts.n_train)}
    assert len(held) == ts.n_eval == 30 and trained.isdisjoint(held) and len(trained) == ts.n_train == 170
    eval_prompts = {ts.eval_row(i)["prompt"] for i in range(ts.n_eval)}
    assert not eval_prompts & {ts.row(s)["prompt"] for s in range(0, 20 * ts.n_train, 7)}
    assert [ts.row(EVAL_SEED_BASE + i) for i in range(ts.n_eval)] == [ts.rows[i] for i in ts.eval_ids]


def test_a_duplicate_of_an_eval_prompt_is_not_trained_on(tmp_path):
    ts = taskset(tmp_path, prompts(10) * 3, seed=2, eval_fraction=0.1)
    eval_prompts = {ts.eval_row(i)["prompt"] for i in range(ts.n_eval)}
    train_prompts = {ts.train_row(s)["prompt"] for s in range(ts.n_train)}
    assert ts.n_eval == 3 and ts.overlap > 0 and ts.n_train + ts.n_eval + ts.overlap == 30
    assert not eval_prompts & train_prompts and "train rows dropped (same prompt as a held-out row)" in ts.describe()


def test_eval_path_gives_the_held_out_rows(tmp_path):
    ev = write_jsonl(tmp_path / "eval.jsonl", prompts(4, 100) + [prompts(1, 3)[0]])
    same_as_message = {"messages": [{"role": "user", "content": prompts(1, 100)[0]["prompt"]}]}
    train = write_jsonl(tmp_path / "t.jsonl", prompts(10) + [same_as_message])
    ts = TaskSet.from_config(DatasetConfig(path=train, eval_path=ev, eval_fraction=0.5), seed=0)  # fraction ignored
    assert ts.eval_ids is None and ts.n_eval == 5 and ts.eval_row(0) == prompts(1, 100)[0]
    # row 3 and row 10 (the same question as a message) are held-out prompts: never trained on
    assert ts.n_train == 9 and ts.overlap == 2 and {3, 10}.isdisjoint(ts.train_index(s) for s in range(40))
    assert ts.origin(EVAL_SEED_BASE + 4) == f"{ev} line 5" and "held out (from " in ts.describe()
    with pytest.raises(ValueError, match=r"^env.dataset: .*eval.jsonl line 2: invalid JSON"):
        TaskSet.from_config(DatasetConfig(path=str(tmp_path / "t.jsonl"),
                                          eval_path=write_jsonl(tmp_path / "eval.jsonl", prompts(1) + ["{"])), 0)


def test_every_epoch_covers_every_train_row_once_in_a_new_order(tmp_path):
    ts = taskset(tmp_path, prompts(40), seed=3)
    n = ts.n_train
    epochs = [[ts.train_index(s) for s in range(e * n, (e + 1) * n)] for e in range(4)]
    assert all(sorted(ep) == sorted(ts.train_ids.tolist()) for ep in epochs)
    assert len({tuple(ep) for ep in epochs}) == 4
    ordered = taskset(tmp_path, prompts(40), seed=3, shuffle=False)
    assert [ordered.train_index(s) for s in range(2 * n)] == ordered.train_ids.tolist() * 2


def test_resuming_at_any_seed_continues_exactly(tmp_path):
    rows = prompts(23)
    whole = [taskset(tmp_path, rows, seed=11).train_row(s) for s in range(100)]
    for k in (0, 1, 20, 21, 57):
        resumed = taskset(tmp_path, rows, seed=11)  # a new process: nothing cached
        assert [resumed.train_row(s) for s in range(k, 100)] == whole[k:]
    other = taskset(tmp_path, rows, seed=12)
    assert [other.train_row(s) for s in range(100)] != whole


def test_rows_handed_out_are_copies(tmp_path):
    ts = taskset(tmp_path, prompts(5))
    ts.train_row(0)["meta"]["id"] = "changed by an env"
    assert "changed by an env" not in json.dumps(ts.rows)


def test_row_lookups_and_description(tmp_path):
    ts = taskset(tmp_path, prompts(10), seed=-4)  # any int seed
    assert ts.row(3) == ts.train_row(3) and ts.row(EVAL_SEED_BASE) == ts.eval_row(0)
    with pytest.raises(IndexError, match="eval row 1 out of range: 1 held-out rows"):
        ts.row(EVAL_SEED_BASE + 1)
    with pytest.raises(ValueError, match="task seed -1 must be >= 0"):
        ts.train_row(-1)
    assert re.fullmatch(r".*t.jsonl line \d+", ts.origin(4))
    assert repr(ts) == "TaskSet(n_train=9, n_eval=1, skipped=0, overlap=0)"
    assert ts.describe() == f"tasks: {tmp_path / 't.jsonl'}: 9 train, 1 held out (0.1 of it, seed -4)"


def test_from_rows_checks_rows():
    assert TaskSet.from_rows(prompts(4), eval_rows=prompts(1, 9)).n_train == 4
    with pytest.raises(ValueError, match=r"^tasks: rows row 1: 'prompt' is empty"):
        TaskSet.from_rows([{"prompt": "a"}, {"prompt": ""}])


def test_the_eval_seed_base_is_defined_once():
    defined = [p.relative_to(ARL).as_posix() for p in ARL.rglob("*.py")
               if re.search(r"^EVAL_SEED_BASE\s*=", p.read_text(), re.M)]
    assert defined == ["config/schema.py"]  # below env and data, which both read it


# ----------------------------------------------------------------------------- demonstrations

def test_demonstrations_normalize_tool_calls(tmp_path):
    simple = {"messages": [{"role": "user", "content": "12*7?"},
                           {"role": "assistant", "content": "", "tool_calls": [{"name": "calc",
                                                                                "arguments": {"x": "12*7"}}]},
                           {"role": "tool", "content": "84"}, {"role": "assistant", "content": "84"}]}
    openai = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                           {"role": "assistant", "content": None, "tool_calls": [
                               {"id": "c1", "type": "function", "function": {"name": "calc",
                                                                             "arguments": '{"x": "1+1"}'}},
                               {"type": "function", "function": {"name": "now", "arguments": {}}}]},
                           {"role": "tool", "content": "2", "tool_call_id": "c1"},
                           {"role": "assistant", "content": "2", "tool_calls": None}]}
    demos = load_demonstrations(write_jsonl(tmp_path / "d.jsonl", [simple, "", openai]))
    assert demos[0] == simple["messages"]
    calls = [{"name": "calc", "arguments": {"x": "1+1"}}, {"name": "now", "arguments": {}}]
    assert demos[1][2] == {"role": "assistant", "content": "", "tool_calls": calls}
    assert demos[1][3]["tool_call_id"] == "c1" and demos[1][4] == {"role": "assistant", "content": "2"}


@pytest.mark.parametrize("row,problem", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"prompt": "hi"}, "needs 'messages'"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f",
                                                                                      "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments is not valid JSON"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]}]},
     "messages[0].tool_calls[0].name must be a non-empty string"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": [1]}]}]},
     "messages[0].tool_calls[0].arguments must be an object (got a JSON array)"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"name": "f"}]},
                   {"role": "assistant", "content": "y"}]}, "messages[0].tool_calls must be a list on an assistant"),
    ({"messages": [{"role": "assistant"}]}, "messages[0].content must be a string (got a JSON null)"),
])
def test_a_bad_demonstration_fails_with_its_line(tmp_path, row, problem):
    good = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, row])
    with pytest.raises(ValueError) as e:
        load_demonstrations(path)
    assert str(e.value).startswith(f"sft.dataset: {path} line 2: ") and problem in str(e.value), str(e.value)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"^sft.dataset: .*empty.jsonl: no demonstrations$"):
        load_demonstrations(str(tmp_path / "empty.jsonl"))
