"""The user's own task end to end through the rollout side: dataset rows reach the environment's
reset (training rows only; held-out rows only in evaluation), the reward function's components
become metrics, SFT demonstrations come from ``sft.dataset``, the one turn limit, and every
mistake of such a config fails ``--dry-run`` with one line."""
from __future__ import annotations

import json
import re

import pytest

from arl.config import RolloutConfig, load_config
from arl.data import EVAL_SEED_BASE, TaskSet, Trajectory
from arl.env import Environment, StepResult, env_kwargs
from arl.metrics import trajectory_metrics
from arl.rollout import ChatFormat, EpisodeConfig, RolloutManager, SamplingConfig
from arl.rollout.engine import Sample
from arl.rollout.episode import Episode
from arl.rollout.expert import sft_demonstrations
from arl.rollout.worker import engine_task_seeds, evaluate
from arl.train import main

SAMPLING = SamplingConfig(max_tokens=4, stop=())  # a random tiny model: fixed-length turns
SEEN: list = []  # rows RowEnv's resets got (the env runs in this process)


class RowEnv(Environment):
    """Records the row each episode gets; one turn; the reward says which row it was."""

    system_prompt = "sys"

    async def reset(self, seed, task=None):
        SEEN.append((seed, task["id"]))
        self.task = task
        return task["prompt"]

    async def step(self, action_text):
        return StepResult("", 1.0, True, {"reward_components": {"correct": 1.0, "row": float(self.task["id"])}})


def _rows(path, n):
    path.write_text("".join(json.dumps({"prompt": f"task {i}", "id": i}) + "\n" for i in range(n)))
    return str(path)


@pytest.mark.slow  # the session vLLM engine
def test_rollout_trains_on_training_rows_and_evaluates_held_out_ones(vllm_engine, tiny_tokenizer, arun, tmp_path):
    data = _rows(tmp_path / "tasks.jsonl", 12)
    cfg = load_config(None, [f"env.name={__name__}:RowEnv", f"env.dataset={data}", "sft.enabled=false",
                             "env.eval_tasks=8", "rollout.max_turn_tokens=4"])
    ts = TaskSet.from_config(cfg.env.dataset, cfg.seed)
    eval_ids = {ts.eval_row(i)["id"] for i in range(ts.n_eval)}
    assert 0 < len(eval_ids) < 12
    SEEN.clear()

    async def train_batches():  # 16 tasks: more than one epoch of the training rows
        async with RolloutManager(vllm_engine, RowEnv, ChatFormat(tiny_tokenizer),
                                  tasks=engine_task_seeds(0, 4, 0, 1), task_row=ts.row,
                                  config=RolloutConfig(group_size=2, tasks_per_step=4, staleness=3),
                                  episode=EpisodeConfig(sampling=SAMPLING)) as m:
            return [await m.get_batch() for _ in range(4)]

    arun(train_batches())
    trained = {i for _, i in SEEN}
    assert trained and not trained & eval_ids, "a held-out row reached a training episode"
    assert all(ts.row(s)["id"] == i for s, i in SEEN)  # the row of the task seed, as the data says
    SEEN.clear()
    acc = arun(evaluate(vllm_engine, ChatFormat(tiny_tokenizer), cfg, 100, ts))  # capped at n_eval
    assert acc == 1.0
    assert sorted(i for _, i in SEEN) == sorted(eval_ids) and all(s >= EVAL_SEED_BASE for s, _ in SEEN)


def test_reward_components_become_metrics():
    def traj(comps, reward):
        return Trajectory(tokens=[1, 2, 3], chunk_ids=[-1, 0, 0], rollout_logp=[0.0] * 3, reward=reward,
                          metadata={"reward_components": comps})

    m = trajectory_metrics([traj({"correct": 1.0, "mean": 0.5}, 1.5), traj({"correct": 0.0}, 0.0)])
    assert m["reward/correct"] == 0.5
    assert m["reward/fn_mean"] == 0.25 and m["reward/mean"] == 0.75  # a component never hides a statistic


class CountEnv(Environment):
    """Two turns, each reporting the event counts it was built with."""

    system_prompt = "sys"

    def __init__(self, counts):
        self.counts = counts

    async def reset(self, seed):
        self.n = 0
        return "task"

    async def step(self, action_text):
        self.n += 1
        return StepResult("obs", float(self.n >= 2), self.n >= 2, {"counts": self.counts})


def _play_counts(counts, tiny_tokenizer, arun):
    fmt = ChatFormat(tiny_tokenizer)
    ep = Episode(CountEnv(counts), fmt, EpisodeConfig(sampling=SAMPLING), 0)

    async def go():
        await ep.start()
        for _ in range(2):
            ids = fmt.encode("hi")
            await ep.apply(Sample(ids, [0.0] * len(ids), "hi", "stop"))
    arun(go())
    return ep.meta


def test_env_counts_are_summed_per_episode_and_logged_as_step_totals(tiny_tokenizer, arun):
    meta = _play_counts({"fork_go": True, "fork_no": 0, "seen": 1.5}, tiny_tokenizer, arun)
    assert meta["env_counts"] == {"fork_go": 2.0, "fork_no": 0.0, "seen": 3.0}  # a bool counts 0 or 1

    def traj(counts):
        return Trajectory(tokens=[1, 2, 3], chunk_ids=[-1, 0, 0], rollout_logp=[0.0] * 3, reward=0.0,
                          metadata={"env_counts": counts} if counts is not None else {})

    m = trajectory_metrics([traj({"fork_go": 2.0}), traj({"fork_go": 1.0, "fork_no": 1.0}), traj(None)])
    assert m["env/fork_go"] == 3.0 and m["env/fork_no"] == 1.0  # totals over the step's trajectories
    assert not any(k.startswith("env/") for k in trajectory_metrics([traj(None)]))


@pytest.mark.parametrize("counts,msg", [
    ([1, 2], "info['counts']: expected a dict of numbers, got list"),
    ({"go": "yes"}, "info['counts']['go']: expected a finite number, got 'yes'"),
    ({"go": float("nan")}, "info['counts']['go']: expected a finite number, got nan"),
])
def test_bad_env_counts_fail_with_one_line(counts, msg, tiny_tokenizer, arun):
    with pytest.raises(ValueError, match=re.escape(msg)):
        _play_counts(counts, tiny_tokenizer, arun)


def test_the_one_turn_limit_reaches_the_environment():
    cfg = load_config(None, ["env.max_turns=7"])
    assert env_kwargs(cfg.env)["max_turns"] == 7  # toy_lookup takes it: the env and the episode agree
    with pytest.raises(ValueError, match="env.kwargs.max_turns: set env.max_turns instead"):
        env_kwargs(load_config(None, ["env.kwargs={max_turns: 9}"]).env)


CALC = ["--config", "configs/smollm2_tools_cpu.yaml", "model.name_or_path=tiny"]


@pytest.mark.parametrize("overrides,msg", [
    (["env.name=nope"], "env: unknown 'nope'"),
    (["env.kwargs.colour=red"], "env.kwargs: got an unexpected keyword argument 'colour' (ToolEnv)"),
    (["env.dataset=/no/such/tasks.jsonl"], "/no/such/tasks.jsonl"),
    (["env.dataset=null"], "env.dataset: environment 'tools' plays tasks from data; give env.dataset"),
    (["env.reward_fn=examples.calculator.reward:nope"], "env.reward_fn"),
    (["env.kwargs.tools=[examples.calculator.tools:nope]"], "nope"),
    (["sft.dataset=/no/such/demos.jsonl"], "/no/such/demos.jsonl"),
    (["sft.dataset=null"], "sft.enabled: environment 'tools' has no expert to demonstrate; give sft.dataset"),
    (["env.name=toy_lookup", "env.dataset=null", "sft.dataset=null"],
     "env.reward_fn: environment 'toy_lookup' takes no reward function"),
])
def test_dry_run_says_what_is_wrong_in_one_line(overrides, msg, capsys):
    assert main(["--dry-run", *CALC, *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("arl.train: config error:") and msg in err and "\n" not in err, err


def test_dry_run_of_the_example_passes(capsys):
    assert main(["--dry-run", *CALC]) == 0
    out = capsys.readouterr().out
    assert "tasks OK:" in out and "env OK: tools" in out and "sft OK: 128 demonstrations" in out


def test_sft_demonstrations_from_the_dataset_render_as_episodes(tiny_tokenizer):
    cfg = load_config("configs/smollm2_tools_cpu.yaml", ["model.name_or_path=tiny", "sft.episodes=3"])
    fmt = ChatFormat(tiny_tokenizer)
    demos = sft_demonstrations(cfg, fmt)
    rows = [json.loads(line) for line in open(cfg.sft.dataset)][:3]
    assert len(demos) == 3
    for t, row in zip(demos, rows):
        call, answer = row["messages"][2]["tool_calls"][0], row["messages"][4]["content"]
        first = fmt.decode(t.tokens[t.turns[0][0]:t.turns[0][1]])
        assert json.loads(first.split("<tool_call>")[1].split("</tool_call>")[0]) == call
        assert fmt.decode(t.tokens[t.turns[1][0]:t.turns[1][1]]) == answer
        assert t.reward == 1.0 and len(t.turns) == 2
