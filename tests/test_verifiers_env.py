"""``env.name: verifiers``: a verifiers 0.4 taskset package run by the real verifiers package in a venv of its
own (``bash install.sh --verifiers``), its ``Env.run`` played with arl's engine as the model.  The real
thing: examples/verifiers/guess_taskset (verifiers' documented Taskset/Task/Env style) played by a scripted
engine through arl's episode code, and (slow) 3 RL steps of the tiny model with held-out evaluation.  Fault
injection uses tests/fixtures/vf_faults, a taskset whose model turns pick what breaks, also run by the real
verifiers package.  Tests that need the venv skip, saying why, when it is absent."""
from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import pytest

from arl.config import EVAL_SEED_BASE
from arl.env import Fault, make_env
from arl.env.verifiers_client import verifiers_python
from arl.rollout import ChatFormat, EpisodeConfig, SamplingConfig
from arl.rollout.engine import Sample
from arl.rollout.episode import run_episode
from arl.train import main
from example_runs import BinarySearch, three_rl_steps

ROOT = Path(__file__).resolve().parents[1]
FAULTS = dict(taskset="vf_faults", path=[str(ROOT / "tests" / "fixtures")], timeout_s=30.0)
GUESS = dict(taskset="guess_taskset", path=[str(ROOT / "examples" / "verifiers")], eval_taskset_args={"split": "test"})


def _need_venv():
    try:
        return verifiers_python()
    except ValueError as e:
        pytest.skip(f"the verifiers venv is absent ({e})")


def _play(env, seed, *turns):
    async def go():
        try:
            first = await env.reset(seed)
            return first, [await env.step(t) for t in turns]
        finally:
            await env.close()

    return asyncio.run(go())


def test_turns_go_to_the_env_its_answers_keep_their_role_the_rewards_are_its_rubric():
    _need_venv()
    env = make_env("verifiers", **FAULTS)
    first, (a, b, c, d, e) = _play(env, 1, "go", "tool", "hmm", "go", "go")
    assert first == [{"role": "user", "content": "Say go 3 times (task 1)."}]
    assert (a.observation, a.done, a.fault) == ("2 to go.", False, Fault.NONE)
    assert b.observation == "the tool says hi" and not b.done
    assert c.observation == "2 to go."
    assert e.done and e.reward == 1.5 and e.fault is Fault.NONE
    assert e.info["reward_components"] == {"went": 1.5} and e.info["counts"] == {"gos": 3.0}


def test_training_seeds_wrap_over_the_taskset_held_out_seeds_index_the_held_out_taskset():
    _need_venv()
    env = make_env("verifiers", **FAULTS, eval_taskset_args={"offset": 100})

    async def go():
        try:
            firsts = [(await env.reset(s))[0]["content"] for s in (1, 5, EVAL_SEED_BASE + 1)]
            with pytest.raises(ValueError, match=r"^verifiers taskset 'vf_faults' reset failed \(RuntimeError: "
                                                 r"IndexError: task 4: the taskset has 4\)$"):
                await env.reset(EVAL_SEED_BASE + 4)  # past the held-out tasks: that episode fails to start
            return firsts
        finally:
            await env.close()

    assert asyncio.run(go()) == ["Say go 3 times (task 1).", "Say go 3 times (task 1).", "Say go 3 times (task 101)."]
    with pytest.raises(ValueError, match=r"^env.kwargs.taskset: verifiers taskset 'vf_faults' failed to load "
                                         r"\(ValidationError: 1 validation error for"):
        make_env("verifiers", **FAULTS, eval_taskset_args={"offsett": 100})  # a field the config does not have


def test_the_observation_role_follows_the_env_messages():
    _need_venv()
    env = make_env("verifiers", **FAULTS)

    async def go():
        try:
            await env.reset(0)
            await env.step("tool")
            tool_role = env.observation_role
            await env.step("go")
            return tool_role, env.observation_role
        finally:
            await env.close()

    assert asyncio.run(go()) == ("tool", "user")


@pytest.mark.parametrize("turn,why", [
    ("raise", r"^verifiers taskset 'vf_faults': RuntimeError: KeyError: 'x' \(in the env's run\)$"),
    ("mixed", r"^verifiers taskset 'vf_faults': an observation of roles \['tool', 'user'\]; arl renders one"),
    ("nan", r"^verifiers taskset 'vf_faults': reward nan is not a finite number$"),
    ("badreward", r"^verifiers reward: ValueError: the reward broke$"),
    ("slow", r"^verifiers taskset 'vf_faults': TimeoutError: no reply within 2s$")])
def test_what_breaks_mid_episode_is_a_recoverable_fault_and_the_next_episode_goes_on(turn, why):
    _need_venv()
    env = make_env("verifiers", **dict(FAULTS, timeout_s=2.0 if turn == "slow" else 30.0))  # answers arrive in ms
    _, (r, ) = _play(env, 0, turn)
    assert r.done and r.fault is Fault.RECOVERABLE and r.reward == 0.0
    assert re.search(why, r.info["fault_reason"]) and "\n" not in r.info["fault_reason"], r.info["fault_reason"]
    if turn == "badreward":  # the reward's message reaches arl's log (fault/reward_exception)
        assert r.info["reward_exception"] == "ValueError: the reward broke"
    _, (ok, ) = _play(env, 1, "go")
    assert ok.observation == "2 to go."


def test_a_server_that_dies_mid_episode_is_recoverable_and_the_next_reset_restarts_it():
    _need_venv()
    env = make_env("verifiers", **FAULTS)
    pid = env._server.proc.pid
    _, (r, ) = _play(env, 0, "die")
    assert r.done and r.fault is Fault.RECOVERABLE
    assert r.info["fault_reason"].startswith("verifiers server for 'vf_faults' died mid-episode (")
    assert "dying on purpose" in r.info["fault_reason"] and "\n" not in r.info["fault_reason"]
    first, (ok, ) = _play(env, 2, "go")
    assert env._server.proc.pid != pid and ok.observation == "2 to go."


class DieOnce:
    """A scripted engine: the first turn ever says "die" (the server exits); every later turn "go"."""

    version = 0

    def __init__(self, tok):
        self.tok, self.died = tok, False

    async def generate_one(self, tokens, sampling):
        out, self.died = ("go" if self.died else "die"), True
        ids = self.tok.encode(out, add_special_tokens=False)
        return Sample(ids, [0.0] * len(ids), out, "stop")


def test_the_rollout_manager_retries_the_episode_on_a_restarted_server(tiny_tokenizer):
    _need_venv()
    from arl.config import RolloutConfig
    from arl.rollout import RolloutManager

    fmt = ChatFormat(tiny_tokenizer)

    async def go():
        m = RolloutManager(DieOnce(tiny_tokenizer), lambda: make_env("verifiers", **FAULTS), fmt, tasks=range(10),
                           groups_per_step=1, pool_size=1,
                           config=RolloutConfig(group_size=1, tasks_per_step=1, retries=1, staleness=0),
                           episode=EpisodeConfig(max_turns=4, sampling=SamplingConfig(max_tokens=8, stop=())))
        async with m:
            return await m.get_batch()

    (t,) = asyncio.run(go()).trajectories
    assert t.metadata["attempts"] == 2 and t.metadata["fault"] == "none" and t.reward == 1.5


def test_what_cannot_start_fails_in_one_line(monkeypatch, capsys):
    def one_line(match, **kw):
        with pytest.raises(ValueError) as e:
            make_env("verifiers", **kw)
        assert "\n" not in str(e.value) and re.search(match, str(e.value)), str(e.value)

    # no verifiers venv: the install flag is named
    one_line(r"^env.name: verifiers runs verifiers environments from their own venv, which is missing "
             r"\(/nonexistent/python\): bash install.sh --verifiers$", **dict(FAULTS, python="/nonexistent/python"))
    # a python without verifiers (arl's own): the server fails to start, its stderr's last line said
    one_line(r"^env.kwargs.taskset: verifiers taskset 'vf_faults' failed to load \(exited with code 1; stderr: "
             r"ModuleNotFoundError: No module named 'verifiers'\)$", **dict(FAULTS, python=sys.executable))
    one_line(r"^env.kwargs.taskset: a verifiers taskset id", **dict(FAULTS, taskset=""))
    monkeypatch.setenv("ARL_VERIFIERS_VENV", "/nonexistent-venv")
    argv = ["--dry-run", "--config", str(ROOT / "examples" / "verifiers" / "config.yaml"), "model.name_or_path=tiny"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "(/nonexistent-venv/bin/python): bash install.sh --verifiers" in err, err


def test_a_taskset_that_does_not_load_or_cannot_be_carried_fails_in_one_line():
    _need_venv()
    for kw, match in [(dict(FAULTS, taskset="no_such_taskset"),
                       r"failed to load \(ModuleNotFoundError: taskset 'no_such_taskset' not found"),
                      (dict(FAULTS, taskset="vf_harnessed"), r"ships its own Harness, whose program owns the "
                                                                    r"sampling loop \(arl's engine must be the model\)")]:
        with pytest.raises(ValueError) as e:
            make_env("verifiers", **kw)
        assert "\n" not in str(e.value) and re.search(match, str(e.value)), str(e.value)


class Script:
    """A scripted engine: says each of ``turns`` in order."""

    version = 0

    def __init__(self, tok, *turns):
        self.tok, self.turns = tok, list(turns)

    async def generate_one(self, tokens, sampling):
        out = self.turns.pop(0)
        ids = self.tok.encode(out, add_special_tokens=False)
        return Sample(ids, [0.0] * len(ids), out, "stop")


def test_tool_calls_run_in_the_tasks_toolsets_their_results_are_tool_turns(tiny_tokenizer, arun):
    """tests/fixtures/vf_tools: a vf.Toolset on the task (vf-init's layout), verifiers' SingleAgentEnv.
    arl parses the model's calls (env.tool_parser, hermes here), the server runs them in the toolset."""
    _need_venv()
    fmt = ChatFormat(tiny_tokenizer)
    env = make_env("verifiers", taskset="vf_tools", path=FAULTS["path"], max_turns=4)
    call = '<tool_call>\n{"name": "calc_add", "arguments": {"a": 12, "b": 32}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "calc_fail", "arguments": {"why": "boom"}}\n</tool_call>'
    cfg = EpisodeConfig(max_turns=4, max_total_tokens=2048, sampling=SamplingConfig(max_tokens=64, stop=()))
    try:
        t = arun(run_episode(Script(tiny_tokenizer, bad + call, "44"), env, fmt, seed=2, config=cfg))
    finally:
        arun(env.close())
    assert env.tools and [s["function"]["name"] for s in env.tools] == ["calc_add", "calc_fail"]
    assert t.metadata["fault"] == "none" and t.reward == 1.0 and len(t.turns) == 2, t.metadata
    assert t.metadata["reward_components"] == {"correct": 1.0}
    assert t.metadata["tool_calls"] == 2 and t.metadata["tool_errors"] == 1 and t.metadata["tools"] == {
        "calc_fail": 1, "calc_add": 1}
    text = tiny_tokenizer.decode(t.tokens)
    assert "calc_add" in text.split("What is 12 + 32?")[0] + text  # the schemas went to the template
    assert "error: calc_fail raised ToolError: Error executing tool fail: boom" in text and "44" in text


def test_the_real_verifiers_env_plays_an_episode_in_the_user_role(tiny_tokenizer, arun):
    _need_venv()
    fmt = ChatFormat(tiny_tokenizer)
    env = make_env("verifiers", max_turns=6, **GUESS)
    cfg = EpisodeConfig(max_turns=6, max_total_tokens=1024, sampling=SamplingConfig(max_tokens=8, stop=()))
    try:
        t = arun(run_episode(BinarySearch(tiny_tokenizer, say="I guess {}"), env, fmt, seed=3, config=cfg))
    finally:
        arun(env.close())
    # train task 3's number is 8: 10, 5, 7, then 8
    assert t.reward == 1.0 and t.metadata["fault"] == "none" and len(t.turns) == 4
    assert t.metadata["reward_components"] == {"found": 1.0}
    text = tiny_tokenizer.decode(t.tokens)
    assert "<|im_start|>system\nYou play a guessing game." in text  # the task's system prompt
    assert "<|im_start|>user\nLower.<|im_end|>" in text and "<|im_start|>user\nHigher.<|im_end|>" in text
    assert "<|im_start|>tool" not in text


@pytest.mark.slow  # a whole training run (vLLM engine, trainer rank, the verifiers server)
def test_three_rl_steps_with_held_out_evaluation(tmp_path, tiny_model_dir):
    """examples/verifiers/config.yaml as shipped but on the tests' tiny model: 3 RL steps against the real
    verifiers env, held-out evaluations (its test split) before and after, the game's answers as the user."""
    _need_venv()
    out = three_rl_steps("verifiers", tmp_path, tiny_model_dir, "env.pool_size=8")
    recs = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert all(recs[s]["rollout/num_masked"] == 0 and recs[s]["rollout/retries"] == 0 for s in (1, 2, 3)), recs
    rows = [json.loads(x) for x in (out / "transcripts" / "heldout_step3.jsonl").read_text().splitlines()]
    assert rows and all(r["fault"] == "none" for r in rows)
    tr = rows[0]["transcript"]
    assert "I am thinking of a whole number from 1 to 20." in tr["prompt"]
    obs = [t["text"] for t in tr["turns"] if t["role"] == "observation"]
    assert obs and all("user" in o and "tool" not in o for o in obs)
    assert all(any(w in o for w in ("Higher.", "Lower.", "Answer with one number.")) for o in obs), obs
