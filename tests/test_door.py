"""A door that explains itself (issue #37): ``--dry-run`` runs the reward function once and checks
the demonstrations' calls against the declared tools, one line each; at run and eval time a reward
exception is printed with its type, message and row, counted as ``fault/reward_exception``, and a
step or an evaluation whose rewards all raised stops with one line.  The currency example
(examples/currency) played by a scripted engine (tests/test_eval_show.py)."""
from __future__ import annotations

import json

import pytest
from rich.console import Console

from arl.config import load_config
from arl.eval import render, summarize
from arl.rollout import ChatFormat, RolloutManager
from arl.rollout.worker import env_factory, episode_config, evaluate_tasks, task_set
from arl.train import main
from test_eval_show import HELD, ScriptedEngine

CURRENCY = ["--config", "examples/currency/config.yaml", "model.name_or_path=tiny"]


@pytest.fixture
def plug(tmp_path, monkeypatch):
    """A module of reward functions: one that always raises KeyError, one that raises on JPY tasks."""
    (tmp_path / "doorplug.py").write_text(
        "from examples.currency.reward import score\n\n"
        "def broken(task, episode):\n    return float(task['expected'] == episode.final_answer)\n\n"
        "def flaky(task, episode):\n"
        "    if 'JPY' in task['prompt']:\n        raise KeyError('JPY')\n"
        "    return score(task, episode)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def dry_run_error(overrides, capsys) -> str:
    assert main(["--dry-run", *CURRENCY, *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("arl.train: config error:") and "\n" not in err, err
    return err


def test_dry_run_runs_the_reward_once(plug, capsys):
    err = dry_run_error(["env.reward_fn=doorplug:broken"], capsys)
    assert "env.reward_fn raised KeyError: 'expected' on the first demonstration" in err
    assert "examples/currency/data/demos_any_pair.jsonl demonstration 1" in err and "examples/currency/data/train.jsonl line" in err
    assert main(["--dry-run", *CURRENCY]) == 0
    assert "reward OK: env.reward_fn scored" in capsys.readouterr().out


def _demos(tmp_path, edit) -> str:
    rows = [json.loads(x) for x in open("examples/currency/data/demos.jsonl")][:3]
    edit(rows[1]["messages"][2]["tool_calls"][0])
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_dry_run_checks_the_demonstrations_calls(tmp_path, capsys):
    path = _demos(tmp_path, lambda c: c.update(name="get_ratez"))
    err = dry_run_error([f"sft.dataset={path}"], capsys)
    assert (f"sft.dataset: {path} demonstration 2 messages[2].tool_calls[0] calls 'get_ratez', which is not a "
            "declared tool (tools: calculator, get_rate)") in err
    path = _demos(tmp_path, lambda c: c.update(arguments={"base": "USD"}))
    err = dry_run_error([f"sft.dataset={path}"], capsys)
    assert f"{path} demonstration 2 messages[2].tool_calls[0]: get_rate arguments: 'quote' is a required property" in err


def _cfg(tmp_path, reward):
    return load_config("examples/currency/config.yaml", [f"output_dir={tmp_path}", "rollout.max_total_tokens=2048",
                                                         "trainer.micro_batch_tokens=2048",
                                                         f"env.reward_fn=doorplug:{reward}", "rollout.retries=1",
                                                         "rollout.group_size=2", "rollout.tasks_per_step=3"])


def test_eval_says_which_reward_raised_and_stops_when_all_do(plug, tiny_tokenizer, arun, capsys):
    fmt = ChatFormat(tiny_tokenizer)
    cfg = _cfg(plug, "flaky")
    rows = arun(evaluate_tasks(ScriptedEngine(tiny_tokenizer), fmt, cfg, 3, task_set(cfg)))
    assert [r["success"] for r in rows] == [False, True, True]
    assert rows[0]["reward_exception"] == "KeyError: 'JPY'" and rows[0]["fault_reason"] == "reward_fn: KeyError: 'JPY'"
    assert "arl: reward_fn raised KeyError: 'JPY' (examples/currency/data/eval.jsonl line 1)" in capsys.readouterr().err
    console = Console(width=200, record=True)
    render(rows, summarize(rows), "m", cfg, console=console)
    assert "fault x1: reward_fn: KeyError: 'JPY'" in console.export_text()  # not only "fault: recoverable"

    cfg = _cfg(plug, "broken")
    with pytest.raises(RuntimeError) as e:
        arun(evaluate_tasks(ScriptedEngine(tiny_tokenizer), fmt, cfg, 2, task_set(cfg)))
    assert str(e.value).startswith("reward_fn raised on every held-out episode (2 of 2; last: KeyError: 'expected')")


class VersionedEngine(ScriptedEngine):
    version = 0


def _first_batch(cfg, tokenizer, arun):
    fmt = ChatFormat(tokenizer)
    manager = RolloutManager(VersionedEngine(tokenizer), env_factory(cfg), fmt, config=cfg.rollout,
                             episode=episode_config(cfg), task_row=lambda s: dict(HELD[s % 3]),
                             task_origin=lambda s: f"held-out row {s % 3}", in_order=True)

    async def one():
        async with manager:
            return await manager.get_batch()

    return arun(one())


def test_a_step_counts_reward_exceptions_and_stops_when_all_raise(plug, tiny_tokenizer, arun, capsys):
    batch = _first_batch(_cfg(plug, "flaky"), tiny_tokenizer, arun)
    # the JPY task's 2 samples raised on both attempts (1 retry): 4 exceptions, printed 3 times
    assert batch.metrics["fault/reward_exception"] == 4
    assert capsys.readouterr().err.count("arl: reward_fn raised KeyError: 'JPY' (held-out row 0)") == 3
    with pytest.raises(RuntimeError) as e:
        _first_batch(_cfg(plug, "broken"), tiny_tokenizer, arun)
    assert str(e.value).startswith("reward_fn raised on every episode of step 0 (6 of 6; last: KeyError: 'expected')")
