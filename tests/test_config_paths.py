"""Relative paths in a YAML config: next to the YAML first, else the working directory (configs that
name repo-root paths keep working); overrides are working-directory paths; the YAML's directory is
importable, so a task folder with its config, tools, reward and data dry-runs from anywhere."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from arl.config import load_config
from arl.train import main

TOOLS = '''def get_rate(base: str, quote: str) -> str:
    """The exchange rate.

    Args:
        base: currency code
        quote: currency code
    """
    return "0.92"
'''
REWARD = "def score(task, episode):\n    return float(task['answer'] in (episode.final_answer or ''))\n"
CONFIG = """env:
  name: tools
  kwargs: {tools: ["paths_plug_tools:get_rate"]}
  reward_fn: paths_plug_reward:score
  dataset: {path: data/train.jsonl, eval_path: data/eval.jsonl}
sft: {enabled: false}
model: {name_or_path: tiny}
"""


@pytest.fixture
def task_dir(tmp_path, monkeypatch):
    """A user's task folder outside the checkout: config, tools, reward, data."""
    d = tmp_path / "my_task"
    (d / "data").mkdir(parents=True)
    (d / "paths_plug_tools.py").write_text(TOOLS)
    (d / "paths_plug_reward.py").write_text(REWARD)
    (d / "config.yaml").write_text(CONFIG)
    for name, first in (("train", 0), ("eval", 100)):
        rows = [{"prompt": f"Convert {i} USD to EUR.", "answer": str(i)} for i in range(first, first + 4)]
        (d / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_config appends the YAML's directory
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    return d


def test_paths_resolve_next_to_the_yaml_and_plugins_import_from_there(task_dir, capsys):
    cfg = load_config(str(task_dir / "config.yaml"))
    assert cfg.env.dataset.path == str(task_dir / "data" / "train.jsonl")
    assert cfg.env.dataset.eval_path == str(task_dir / "data" / "eval.jsonl")
    assert cfg.model.name_or_path == "tiny" and cfg.output_dir == "runs/default"  # outputs: the working directory
    assert str(task_dir.resolve()) in sys.path and str(task_dir.resolve()) in os.environ["PYTHONPATH"]
    assert main(["--dry-run", "--config", str(task_dir / "config.yaml")]) == 0  # run from the repo root
    assert "env OK: tools" in capsys.readouterr().out


def test_the_yaml_directory_wins_then_the_working_directory(task_dir, tmp_path, monkeypatch):
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    shutil.copy(task_dir / "data" / "train.jsonl", work / "data" / "other.jsonl")
    monkeypatch.chdir(work)
    cfg_text = CONFIG.replace("eval_path: data/eval.jsonl", "eval_path: data/other.jsonl")
    (task_dir / "config.yaml").write_text(cfg_text)
    cfg = load_config(str(task_dir / "config.yaml"))
    assert cfg.env.dataset.path == str(task_dir / "data" / "train.jsonl")  # next to the YAML
    assert cfg.env.dataset.eval_path == "data/other.jsonl"  # only in the working directory: as written
    # a command-line override is the shell's path: relative to the working directory
    cfg = load_config(str(task_dir / "config.yaml"), ["env.dataset.path=data/other.jsonl"])
    assert cfg.env.dataset.path == "data/other.jsonl"


def test_a_yaml_inside_a_package_imports_by_its_dotted_name(tmp_path, monkeypatch):
    """examples/mcp/config.yaml names examples.mcp.reward:score: it must import from any working
    directory, so the folder above the YAML's top-level package is importable too."""
    pkg = tmp_path / "repo" / "pathsplugpkg" / "task"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "config.yaml").write_text("model: {name_or_path: tiny}\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.chdir(tmp_path)
    load_config(str(pkg / "config.yaml"))
    assert str((tmp_path / "repo").resolve()) in sys.path
    assert str((tmp_path / "repo").resolve()) in os.environ["PYTHONPATH"].split(os.pathsep)
